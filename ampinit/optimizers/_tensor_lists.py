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


def device_scalar(value: float, device: torch.device) -> Tensor:
    """A 0-d float32 tensor holding ``value`` on ``device``.

    Made by a fill kernel that takes ``value`` as a kernel argument, never by ``torch.tensor(value,
    device=...)``, which stages the number in host memory and copies it (a blocking host-to-device copy on
    CUDA, and a copy of a host buffer that a CUDA graph would replay stale).
    """
    return torch.full((), value, dtype=torch.float32, device=device)


def flag_if(noop_flag: Tensor, condition: Tensor) -> None:
    """Set the int32 ``noop_flag`` to 1 if the 0-d or one-element ``condition`` is true; never clear it."""
    noop_flag.masked_fill_(condition.reshape(1).to(device=noop_flag.device, dtype=torch.bool), 1)


# torch's CPU norm kernels accumulate long vectors with too few partial sums: about 1e-3 relative error on
# fp32 tensors of tens of millions of elements (1e-5 at 1M, 1e-7 at 4k). Tensors above NORM_CHUNK * 4
# elements are therefore reduced the way Apex's kernel does it: fp32 sums of squares per chunk, then a
# (pairwise) sum of the chunk results. That costs one small temporary per tensor (numel / NORM_CHUNK floats).
NORM_CHUNK = 2048


def _chunked_norm(tensor: Tensor) -> Tensor:
    flat = tensor.reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    rows = flat[:whole].view(-1, NORM_CHUNK)
    squares = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square().sum()
    tail = flat[whole:]
    if tail.numel():
        squares = squares + torch.linalg.vector_norm(tail, dtype=torch.float32).square()
    root: Tensor = squares.sqrt()
    return root


def l2_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Float32 L2 norm (0-d) of each tensor, in input order, accurate to ~1e-7 relative at any size.

    Small tensors share one ``torch._foreach_norm`` per (device, dtype) group; large ones are reduced by
    chunks (see ``NORM_CHUNK``). Nothing is read on the host.
    """
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    for indices in group_indices([tensors]).values():
        small = [i for i in indices if tensors[i].numel() <= NORM_CHUNK * 4]
        if small:
            for i, norm in zip(small, torch._foreach_norm(pick(tensors, small), 2, dtype=torch.float32)):
                norms[i] = norm
        for i in indices:
            if tensors[i].numel() > NORM_CHUNK * 4:
                norms[i] = _chunked_norm(tensors[i])
    return norms


def total_norm(norms: Sequence[Tensor], device: torch.device) -> Tensor:
    """L2 norm (shape [1], float32, on ``device``) of a list of per-tensor L2 norms."""
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    norm: Tensor = torch.linalg.vector_norm(stacked)
    return norm.reshape(1)
