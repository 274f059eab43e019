"""What Apex's multi-tensor ops share: their calling convention and the L2 norm op.

Every op takes Apex's leading ``(chunk_size, noop_flag, tensor_lists)`` arguments followed by Apex's own.
``chunk_size`` is accepted and ignored: torch's kernels choose their own chunking. ``noop_flag`` is an int32
tensor of shape [1]; ops set it to 1 where Apex's kernels do and never clear it. Each optimizer's op lives in
its file, beside the update it calls (``multi_tensor_adam`` in ``fused_adam``...), and the optimizer exposes it
as an attribute (``FusedAdam.multi_tensor_adam``), as Apex's optimizers do: code that subclasses them (fairseq's
``FusedAdamV2``) checks for those and calls them. :mod:`ampinit.compat.apex.amp_C` gives every op its Apex name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import device_scalar, fp32_copies, l2_norms, total_norm
from ampinit.optimizers._adam_math import bias_corrections

TensorLists = Sequence[Sequence[Tensor]]


def flag_if(noop_flag: Tensor, condition: Tensor) -> None:
    """Set the int32 ``noop_flag`` to 1 if the 0-d or one-element ``condition`` is true; never clear it."""
    noop_flag.masked_fill_(condition.reshape(1).to(device=noop_flag.device, dtype=torch.bool), 1)


def not_flagged(noop_flag: Tensor, device: torch.device) -> Tensor:
    """0-d bool on ``device``: true while the flag is clear (read on the device, never on the host)."""
    return noop_flag.reshape(()).to(device).eq(0)


def check_lists(name: str, tensor_lists: TensorLists, depths: tuple[int, ...]) -> bool:
    """Validate Apex's list-shape rules; return False when there is nothing to do."""
    if len(tensor_lists) not in depths:
        raise ValueError(f"{name} takes {' or '.join(map(str, depths))} tensor lists, got {len(tensor_lists)!r}")
    lengths = [len(tensors) for tensors in tensor_lists]
    if len(set(lengths)) != 1:
        raise ValueError(f"{name}: every tensor list must have the same length, got lengths {lengths!r}")
    for tensors in tensor_lists[1:]:
        for i, (first, other) in enumerate(zip(tensor_lists[0], tensors)):
            if first.numel() != other.numel():
                raise ValueError(
                    f"{name}: tensor {i} has {first.numel()} elements in the first list and {other.numel()} in another"
                )
    return lengths[0] > 0


def norm_result(
    noop_flag: Tensor, norms: list[Tensor], device: torch.device, per_tensor: bool | None
) -> tuple[Tensor, Tensor]:
    """The norm ops' ``(norm, per_tensor_norms)`` from each tensor's norm; flags a non-finite total."""
    total = total_norm(norms, device)
    flag_if(noop_flag, ~torch.isfinite(total))
    if per_tensor and norms:
        return total, torch.stack([n.to(device) for n in norms])
    return total, torch.empty(0, dtype=torch.float32, device=device)


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """``(norm, per_tensor_norms)`` of list ``[t]``: shape [1] float32, and shape [n] (or [0] unless
    ``per_tensor``). Flags a non-finite norm. Norms are float32 sums of squares per chunk, as Apex's."""
    device = noop_flag.device
    if not check_lists("multi_tensor_l2norm", tensor_lists, (1,)):
        return norm_result(noop_flag, [], device, per_tensor)
    return norm_result(noop_flag, l2_norms(tensor_lists[0]), tensor_lists[0][0].device, per_tensor)


def adam_arguments(
    device: torch.device,
    step: int,
    lr: float,
    betas: tuple[float, float],
    epsilon: float,
    weight_decay: float,
    bias_correction: int,
) -> dict[str, Any]:
    """Apex's Adam-family op arguments as the keyword arguments of ampinit's update functions."""
    return dict(
        step=device_scalar(float(step), device),
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        eps=epsilon,
        weight_decay=weight_decay,
        bias_correction=bias_correction == 1,
    )


def times(tensors: list[Tensor], factor: Tensor) -> list[Tensor]:
    """Float32 copies of ``tensors`` multiplied by the one-element ``factor`` (Apex's ``inv_scale``)."""
    work = fp32_copies(tensors)
    if work:
        _torch_kernels.foreach_mul_(work, factor.to(device=work[0].device, dtype=torch.float32).reshape(()))
    return work


def float64_corrections(
    step: Tensor, beta1: float, beta2: float, bias_correction: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Adam's bias corrections at the device-side ``step``, powers taken in float64 as Apex's kernels take them."""
    t = step.to(device=device, dtype=torch.float64).reshape(())
    return bias_corrections(t, beta1, beta2, bias_correction == 1)
