"""``apex_C``: Apex's small C extension, whose two functions are torch's own dense-tensor flattening.

``flatten(tensors)`` concatenates the tensors' data into one 1-D tensor; ``unflatten(flat, tensors)`` splits such a
tensor back into views shaped like ``tensors``. Apex bound exactly ``torch._utils._flatten_dense_tensors`` and
``_unflatten_dense_tensors``' C++ versions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampinit import _torch_kernels

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding every tensor's elements, in order."""
    flat: torch.Tensor = _torch_kernels.flatten_dense_tensors(list(tensors))
    return flat


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` with the shapes of ``tensors`` (the inverse of :func:`flatten`).

    As torch's C++ function that Apex binds, a longer ``flat`` (a buffer padded for alignment) is accepted: the
    views cover its leading elements. A shorter one is an error.
    """
    total = sum(t.numel() for t in tensors)
    if flat.numel() < total:
        raise ValueError(f"flat has {flat.numel()} elements but the tensors hold {total}")
    return tuple(_torch_kernels.unflatten_dense_tensors(flat, list(tensors)))
