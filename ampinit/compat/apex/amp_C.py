"""``amp_C``: Apex's multi-tensor kernels under their Apex names (``import amp_C`` resolves here once installed)."""

from ampinit.multi_tensor import (
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

__all__ = [
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
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
