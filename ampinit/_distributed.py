"""What amp needs from torch.distributed: one overflow decision for all ranks, and local views of shards.

Engine layer. Ranks must agree on every skip: with FSDP2's sharded gradients (or model parallelism, or any
custom all-reduce) each rank sees only part of the gradients, so one rank can overflow while another does not.
The overflow flag is therefore all-reduced (MAX) on its own device before any rank decides, also under DDP,
where the flags agree already but a rank-local corruption must not split the ranks. The reduction is one
element on the device: it adds no host synchronisation of its own.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def _dtensor_type() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` has been imported, else ``None``.

    Importing it here would cost ``import ampinit`` about half a second (it pulls in sympy), and no tensor can be
    a ``DTensor`` before its module is imported (FSDP2 and tensor parallelism import it), so looking it up in
    ``sys.modules`` answers the same question for free.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def agree_on_overflow_(flag: torch.Tensor) -> None:
    """Make ``flag`` the maximum over all ranks, in place (a no-op outside a multi-rank job)."""
    if world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 / tensor-parallel shard)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a ``DTensor`` (in-place changes reach the shard); other tensors as they are."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        shard: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return shard
    return tensor
