"""``ampinit.multi_tensor``: Apex's ``multi_tensor_applier`` and ``amp_C`` ops, for code that imports them from
ampinit rather than under their Apex names (``ampinit migrate`` writes ``from ampinit.multi_tensor import amp_C``).

They live with the Apex compatibility layer (:mod:`ampinit.compat.apex.amp_C`,
:mod:`ampinit.compat.apex.multi_tensor_apply`); this module re-exports them.
"""

from ampinit.compat.apex import amp_C
from ampinit.compat.apex.amp_C import (
    multi_tensor_adagrad,
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_axpby,
    multi_tensor_l2norm,
    multi_tensor_l2norm_mp,
    multi_tensor_l2norm_scale,
    multi_tensor_lamb,
    multi_tensor_lamb_mp,
    multi_tensor_novograd,
    multi_tensor_scale,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
    update_scale_hysteresis,
)
from ampinit.compat.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = [
    "MultiTensorApply",
    "amp_C",
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_applier",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "multi_tensor_novograd",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]
