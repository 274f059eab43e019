"""Tensor-list plumbing shared by :mod:`ampinit.multi_tensor` and the fused optimizers.

Everything here stays on the device: no function reads a tensor value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GroupKey = tuple[torch.device, tuple[torch.dtype, ...]]


def group_indices(tensor_lists: Sequence[Sequence[Tensor]]) -> dict[GroupKey, list[int]]:
    """Positions grouped by the device of the first list and the dtypes found at that position in every list.

    torch's foreach and fused kernels want one device and one dtype per list, so every multi-tensor op runs
    once per group.
    """
    groups: dict[GroupKey, list[int]] = {}
    for i, first in enumerate(tensor_lists[0]):
        key = (first.device, tuple(tensors[i].dtype for tensors in tensor_lists))
        groups.setdefault(key, []).append(i)
    return groups


def pick(tensors: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
    return [tensors[i] for i in indices]


def fp32_copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Fresh float32 copies (same shapes and strides) of ``tensors``."""
    copies = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    if copies:
        torch._foreach_copy_(copies, list(tensors))
    return copies


def fp32_work(tensors: Sequence[Tensor], *, private: bool = False) -> list[Tensor]:
    """Tensors to do float32 math on.

    Float32 tensors are used in place unless ``private`` asks for copies (needed when a skipped step must
    leave the originals untouched). Other dtypes always get float32 copies, written back later with
    :func:`write_back`; this keeps half-precision parameters on Apex's numerics (fp32 math, one rounding).
    """
    if not private and all(t.dtype == torch.float32 for t in tensors):
        return list(tensors)
    return fp32_copies(tensors)


def write_back(targets: Sequence[Tensor], work: Sequence[Tensor], skip: Tensor | None = None) -> None:
    """Store ``work`` into ``targets`` (rounded to their dtype), except where the 0-d bool ``skip`` is true.

    Pairs whose work tensor *is* the target were updated in place already and are left alone.
    """
    pairs = [(t, w) for t, w in zip(targets, work) if t is not w]
    if not pairs:
        return
    if skip is None:
        torch._foreach_copy_([t for t, _ in pairs], [w for _, w in pairs])
        return
    for target, value in pairs:
        # torch has no foreach `where`; one select per tensor keeps the skip decision on the device.
        torch.where(skip, target, value.to(target.dtype), out=target)


def flag_if(noop_flag: Tensor, condition: Tensor) -> None:
    """Set the int32 ``noop_flag`` to 1 if the 0-d or one-element ``condition`` is true; never clear it."""
    noop_flag.masked_fill_(condition.reshape(1).to(device=noop_flag.device, dtype=torch.bool), 1)


def total_norm(norms: Sequence[Tensor], device: torch.device) -> Tensor:
    """L2 norm (shape [1], float32, on ``device``) of a list of per-tensor L2 norms."""
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    norm: Tensor = torch.linalg.vector_norm(stacked)
    return norm.reshape(1)
