"""``ampinit.multi_tensor``: Apex's ``multi_tensor_applier`` and ``amp_C`` ops, for code that imports them from
ampinit rather than under their Apex names (``ampinit migrate`` writes ``from ampinit.multi_tensor import amp_C``).

Their Apex names live with the Apex compatibility layer (:mod:`ampinit.compat.apex.amp_C`,
:mod:`ampinit.compat.apex.multi_tensor_apply`), an optimizer's ops beside its update in :mod:`ampinit.optimizers`;
this module re-exports the names, so the list of ops lives in one place, ``amp_C.__all__``.
"""

from ampinit.compat.apex import amp_C
from ampinit.compat.apex.amp_C import *  # noqa: F403
from ampinit.compat.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "amp_C", "multi_tensor_applier", *amp_C.__all__]
