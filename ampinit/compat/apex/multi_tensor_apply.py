"""``apex.multi_tensor_apply``: ``multi_tensor_applier`` and ``MultiTensorApply``, always available.

Apex's applier called a CUDA extension op over chunks of its tensor lists; here the ops (``amp_C``) take whole
lists and the applier only forwards the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import Tensor

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

R = TypeVar("R")


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, as Apex's applier does. Always available."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raises here when its extension is missing; these ops need no extension."""

    def __call__(
        self, op: Callable[..., R], noop_flag_buffer: Tensor, tensor_lists: Sequence[Sequence[Tensor]], *args: Any
    ) -> R:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
