"""``amp_C``: Apex's multi-tensor ops under their Apex names, written on ampinit's kernel boundary.

``import amp_C`` resolves to this module once the aliases are installed (``ampinit run``); ``ampinit.multi_tensor``
re-exports it. Every op takes Apex's leading ``(chunk_size, noop_flag, tensor_lists)`` arguments followed by
Apex's own; call them directly or through ``apex.multi_tensor_apply.multi_tensor_applier``. ``chunk_size`` is
accepted and ignored: torch's kernels choose their own chunking. ``noop_flag`` is an int32 tensor of shape [1];
ops set it to 1 where Apex's kernels do and never clear it, and the ops that Apex makes exit early when it is
set (``multi_tensor_sgd``) skip their update on the device, without a host sync.

An optimizer's ops live in its module, beside the update they call (``multi_tensor_adam`` in
:mod:`ampinit.optimizers.fused_adam`, ``multi_tensor_lamb_mp`` in
:mod:`ampinit.optimizers.fused_mixed_precision_lamb`...), and the L2 norm the LAMB ops take in
:mod:`ampinit.optimizers._apex_ops`; this module names them. The ops no optimizer calls (the scale, axpby and
norm-and-scale ops of Apex's loss scalers and gradient clipping, and the hysteresis scale update) are written
here.

Differences from Apex's harness: tensors in one list may mix dtypes (each op runs once per device and
dtype combination), an empty ``tensor_lists[0]`` is a no-op instead of an error, and the tensors need not be
on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import device_scalar, fp32_copies, group_indices, l2_norms, pick
from ampinit.optimizers._apex_ops import TensorLists, check_lists, flag_if, multi_tensor_l2norm, norm_result
from ampinit.optimizers.fused_adagrad import multi_tensor_adagrad
from ampinit.optimizers.fused_adam import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
)
from ampinit.optimizers.fused_lamb import multi_tensor_lamb
from ampinit.optimizers.fused_mixed_precision_lamb import multi_tensor_l2norm_mp, multi_tensor_lamb_mp
from ampinit.optimizers.fused_novograd import multi_tensor_novograd
from ampinit.optimizers.fused_sgd import multi_tensor_sgd

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

# Each op spells out Apex's positional signature (Megatron, NeMo and Apex's optimizers call them positionally),
# so ops with the same arguments repeat them.


def _exact_copy(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or dst in (torch.float32, torch.float64)


def _scale_into(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: float) -> list[Tensor]:
    """``outputs = inputs * scale`` in float32 math; returns per-device flags of non-finite *inputs*."""
    flags = []
    for (device, (src_dtype, dst_dtype)), indices in group_indices([inputs, outputs]).items():
        src, dst = pick(inputs, indices), pick(outputs, indices)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        # The amp kernel checks the values before multiplying, which is Apex's rule, so the copy it works on
        # must hold the inputs exactly: the output itself when it can, else a float32 copy.
        if _exact_copy(src_dtype, dst_dtype):
            pairs = [(d, s) for s, d in zip(src, dst) if s is not d]
            if pairs:
                _torch_kernels.copy_([d for d, _ in pairs], [s for _, s in pairs])
            work = dst
        else:
            work = fp32_copies(src)
        _torch_kernels.unscale_and_check_(work, found, device_scalar(scale, device))
        if work is not dst:
            _torch_kernels.copy_(dst, work)
        flags.append(found)
    return flags


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out = in * scale`` for lists ``[in, out]``; flags any non-finite input. Never exits early."""
    if not check_lists("multi_tensor_scale", tensor_lists, (2,)):
        return
    for found in _scale_into(tensor_lists[0], tensor_lists[1], scale):
        flag_if(noop_flag, found)


def multi_tensor_axpby(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, a: float, b: float, arg_to_check: int
) -> None:
    """``out = a*x + b*y`` for lists ``[x, y, out]``; flags non-finite x (0), y (1) or either (-1)."""
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"Invalid arg_to_check: {arg_to_check!r}. Allowed values: -1 (both), 0 (x), 1 (y)")
    if not check_lists("multi_tensor_axpby", tensor_lists, (3,)):
        return
    for (device, _), indices in group_indices(tensor_lists).items():
        x, y = fp32_copies(pick(tensor_lists[0], indices)), fp32_copies(pick(tensor_lists[1], indices))
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for work, factor, checked in ((x, a, arg_to_check in (-1, 0)), (y, b, arg_to_check in (-1, 1))):
            if checked:
                _torch_kernels.unscale_and_check_(work, found, device_scalar(factor, device))
            else:
                _torch_kernels.foreach_mul_(work, factor)
        _torch_kernels.foreach_add_(x, y)
        _torch_kernels.copy_(pick(tensor_lists[2], indices), x)
        flag_if(noop_flag, found)


def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """Norm of ``in`` (as :func:`multi_tensor_l2norm`) and ``out = in * scale`` for lists ``[in, out]``."""
    if not check_lists("multi_tensor_l2norm_scale", tensor_lists, (2,)):
        return norm_result(noop_flag, [], noop_flag.device, per_tensor)
    result = norm_result(noop_flag, l2_norms(tensor_lists[0]), tensor_lists[0][0].device, per_tensor)
    _scale_into(tensor_lists[0], tensor_lists[1], scale)
    return result


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """Norm of ``t * inv_scale`` for list ``[t]``, leaving ``t`` untouched. Flags a non-finite norm.

    Computed as ``norm(t) * |inv_scale|`` to avoid a scaled copy of every tensor; this differs from Apex
    only by rounding, and if ``sum(t**2)`` overflows float32 while ``sum((t*inv_scale)**2)`` does not.
    """
    if not check_lists("multi_tensor_unscale_l2norm", tensor_lists, (1,)):
        return norm_result(noop_flag, [], noop_flag.device, per_tensor)
    device = tensor_lists[0][0].device
    factor = inv_scale.to(device=device, dtype=torch.float32).reshape(()).abs()
    norms = [n.to(device) * factor for n in l2_norms(tensor_lists[0])]
    return norm_result(noop_flag, norms, device, per_tensor)


def update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> Tensor:
    """Loss-scale update with hysteresis (Megatron's and NeMo's scaler), in place on the device; returns
    ``current_scale``.

    An overflow (``found_inf > 0``) first counts ``hysteresis_tracker`` down; while it stays above 0 the scale
    is kept and only ``growth_tracker`` is reset. Otherwise the scale is multiplied by ``backoff_factor``
    (overflow) or, after ``growth_interval`` clean steps in a row, by ``growth_factor`` unless that is not
    finite in float32. A clean step resets ``hysteresis_tracker`` to ``hysteresis``. The products are
    formed in float64 and rounded to float32, as Apex's kernel does.
    """
    found = found_inf.reshape(()).to(current_scale.device)
    tracker = hysteresis_tracker.reshape(())
    counted = torch.where(found > 0, tracker - 1, tracker)
    hold = (found > 0) & (counted > 0)
    backoff = ~hold & (found != 0)
    successful = growth_tracker.reshape(()) + 1
    grow = ~hold & ~backoff & (successful == growth_interval)
    scale = current_scale.reshape(())
    grown = (scale.double() * growth_factor).float()
    shrunk = (scale.double() * backoff_factor).float()
    new_scale = torch.where(backoff, shrunk, torch.where(grow & grown.isfinite(), grown, scale))
    new_growth = torch.where(hold | backoff | grow, torch.zeros_like(successful), successful)
    new_hysteresis = torch.where(found <= 0, torch.full_like(counted, hysteresis), counted)
    current_scale.copy_(new_scale.reshape(current_scale.shape))
    growth_tracker.copy_(new_growth.reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(new_hysteresis.reshape(hysteresis_tracker.shape))
    return current_scale
