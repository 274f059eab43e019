"""What amp needs from torch.distributed: one overflow decision for all ranks, and local views of shards.

Engine layer. Ranks must agree on every skip: with FSDP2's sharded gradients (or model parallelism, or any
custom all-reduce) each rank sees only part of the gradients, so one rank can overflow while another does not.
The overflow flag is therefore all-reduced (MAX) on its own device before any rank decides, also under DDP,
where the flags agree already but a rank-local corruption must not split the ranks. The reduction is one
element on the device: it adds no host synchronisation of its own.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from itertools import repeat

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


# The tensors the overflow flags are all-reduced in, by (device, dtype, shape); see _exchange_buffer.
_EXCHANGE: dict[tuple[torch.device, torch.dtype, torch.Size], torch.Tensor] = {}


def _exchange_buffer(flag: torch.Tensor) -> torch.Tensor:
    """The tensor ``flag`` is all-reduced in: one per device, dtype and shape, whose Python object is never freed.

    A collective's tensor is also held by the backend's worker thread, which lets go of it some time after the
    waiting caller has resumed (gloo's run loop, NCCL's watchdog). When the Python object of the tensor is gone
    by then, that thread frees it, which takes the GIL; if the interpreter has begun to shut down, CPython ends
    the thread inside a noexcept C++ frame and the process aborts with "terminate called without an active
    exception" (pytorch/pytorch#190489). A session's own flag dies with the session (``deinitialize``, or at
    exit), possibly right after the last step's all-reduce; this buffer outlives interpreter shutdown, so the
    last reference to it is never a torch thread's.
    """
    key = (flag.device, flag.dtype, flag.shape)
    buffer = _EXCHANGE.get(key)
    if buffer is None:
        buffer = torch.empty_like(flag)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(buffer))  # never released: see above
        _EXCHANGE[key] = buffer
    return buffer


def agree_on_overflow_(flag: torch.Tensor) -> None:
    """Make ``flag`` the maximum over all ranks, in place (a no-op outside a multi-rank job)."""
    if world_size() > 1:
        buffer = _exchange_buffer(flag)
        buffer.copy_(flag)
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        flag.copy_(buffer)


def rank0_seed(seed: int) -> int:
    """Rank 0's ``seed`` on every rank (``seed`` itself outside a multi-rank job): stochastic rounding must draw the
    same bits on every rank, whatever seed each rank's ``torch.manual_seed`` was given."""
    if world_size() <= 1:
        return seed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffer = _exchange_buffer(torch.empty(1, dtype=torch.int64, device=device))
    buffer.fill_(seed)
    dist.broadcast(buffer, src=0)
    return int(buffer.item())


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


def local_views(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """:func:`local` of each of ``tensors``; ``tensors`` itself where none can be a ``DTensor`` (its module not
    imported, or none of them one), with no Python call per tensor: a multi-tensor op over a plain model runs every
    step."""
    dtensor = _dtensor_type()
    if dtensor is None or not any(map(isinstance, tensors, repeat(dtensor))):
        return tensors
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]  # type: ignore[attr-defined]
