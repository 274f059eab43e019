"""Multi-tensor primitives the amp machinery runs on (engine layer).

Every function here takes lists of tensors and issues one PyTorch multi-tensor kernel per (device, dtype)
group, never a Python loop over tensors. The kernels are PyTorch's own: ``torch._foreach_*`` and
``torch._amp_foreach_non_finite_check_and_unscale_`` (on CUDA these are the MultiTensorApply kernels PyTorch
inherited from Apex; on CPU they are vectorised loops). Private torch ops are reached only through this module,
each with a plain-torch fallback, so a torch release that moves one breaks here, loudly, and nowhere else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from ampinit._distributed import local
from ampinit._types import TensorList

_HAS_UNSCALE_KERNEL = hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")
_HAS_UPDATE_SCALE_KERNEL = hasattr(torch, "_amp_update_scale_")


def group_by_device_and_dtype(
    *lists: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[TensorList]]:
    """Split parallel tensor lists into groups that one kernel can take, keyed by the first list's tensors."""
    groups: dict[tuple[torch.device, torch.dtype], list[TensorList]] = defaultdict(lambda: [[] for _ in lists])
    # Sharded tensors (FSDP2's DTensors) are worked on through their local shards: the ops here are
    # elementwise, and the one cross-rank fact, the overflow flag, is reduced by the caller.
    for items in zip(*([local(t) for t in tensors] for tensors in lists)):
        key = (items[0].device, items[0].dtype)
        for bucket, tensor in zip(groups[key], items):
            bucket.append(tensor)
    return dict(groups)


def unscale_and_check_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``g *= inv_scale`` for every grad, in place, and set ``found_inf`` to 1.0 if any grad is inf or NaN.

    ``found_inf`` is a one-element float32 tensor; it is only ever raised, never cleared, so several calls
    accumulate into one flag. Nothing is synchronised with the host.
    """
    for (device, _), (group,) in group_by_device_and_dtype(grads).items():
        flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
        scale = to_device(inv_scale, device)
        if _HAS_UNSCALE_KERNEL:
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, scale)
        else:  # pragma: no cover - only on a torch without the private kernel
            _unscale_and_check_reference(group, flag, scale)
        if flag is not found_inf:
            found_inf.add_(to_device(flag, found_inf.device)).clamp_(max=1.0)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, asynchronously where that is safe.

    A copy *to* an accelerator is stream-ordered: the kernels that read it run after it. A copy to the CPU is
    not: with ``non_blocking=True`` the host could read the buffer before the copy lands, so it blocks.
    """
    return tensor.to(device, non_blocking=device.type != "cpu")


def _unscale_and_check_reference(grads: TensorList, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """The plain-torch meaning of the fused kernel above (also its fallback)."""
    norms = torch._foreach_norm(grads, ord=float("inf")) if grads else []
    if norms:
        found_inf.add_(torch.stack(list(norms)).float().isfinite().logical_not().any()).clamp_(max=1.0)
    torch._foreach_mul_(grads, inv_scale)


def copy_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (casting between dtypes), one kernel per destination group."""
    with torch.no_grad():
        for _, (dst, src) in group_by_device_and_dtype(destinations, sources).items():
            if _HAS_FOREACH_COPY:
                torch._foreach_copy_(dst, src)
            else:  # pragma: no cover - only on a torch without _foreach_copy_
                for d, s in zip(dst, src):
                    d.copy_(s)


def mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """``t *= factor`` for each tensor, ``factor`` being a 0-d tensor (kept on device: no host sync).

    Runs on the unscale kernel with ``factor`` as its multiplier and a scratch flag: on CPU,
    ``torch._foreach_mul_`` by a tensor takes a slow per-tensor path (about 10x the time of this kernel).
    """
    scratch = torch.zeros(1, dtype=torch.float32, device=factor.device)
    unscale_and_check_(tensors, scratch, factor)


def add_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
    """``t += other`` for each pair."""
    for _, (group, other) in group_by_device_and_dtype(tensors, others).items():
        torch._foreach_add_(group, other)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """GradScaler's update rule in one kernel, in place and on device.

    An overflow multiplies ``scale`` by ``backoff_factor`` and resets ``growth_tracker``; a clean step counts
    it up, and reaching ``growth_interval`` multiplies ``scale`` by ``growth_factor`` (unless that would make
    it non-finite) and resets the tracker.
    """
    if _HAS_UPDATE_SCALE_KERNEL:
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return
    found = found_inf.reshape(()) > 0  # pragma: no cover - only on a torch without the private kernel
    tracker = torch.where(found, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = tracker >= growth_interval
    grown = scale * growth_factor
    scale.copy_(torch.where(found, scale * backoff_factor, torch.where(grow & grown.isfinite(), grown, scale)))
    growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
