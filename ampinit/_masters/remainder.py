"""16-bit remainder masters: an fp32 master kept as its bf16 weight plus the low 16 bits, and the reference step.

bf16 is the upper half of fp32 (same sign and exponent, 7 of the 23 mantissa bits), so the 16 bits a bf16 copy
drops are all that is needed to get the fp32 master back. Storing them beside the bf16 weight costs 2 bytes per
parameter instead of a 4-byte master, and the weight *is* the model's bf16 weight: no copy-back pass.

The encoding (``split`` / ``join``), on the master's bits read as a signed 32-bit integer ``B``::

    weight    = (B + 0x8000) >> 16          # the upper half, rounded half up
    remainder = B - (weight << 16)          # in [-0x8000, 0x7FFF]: B's low 16 bits read as an int16
    B         = (weight << 16) + remainder  # join: exact for every pair that split produced

**The tie decision.** Round-to-nearest-even cannot be used for the weight: with it, a master whose low half is
exactly 0x8000 (a tie) rounds up or down depending on the parity of the upper half, so two masters (upper half
``h`` odd rounded up, and ``h + 1`` even rounded down, both with low half 0x8000) give the same weight with the
same low 16 bits: 65537 masters per 65536 codes, and join could not tell them apart. Rounding the upper half
*half up* on the integer ``B`` makes the map a bijection between the 2**32 masters and the 2**32 (weight,
remainder) pairs, and the remainder's sign says which way the weight was rounded. On the magnitude this is
round-to-nearest with **ties away from zero** (``B`` grows with the magnitude for either sign), the rule of
Transformer Engine's ``store_param_remainders``. So:

- the master is exact: training is bitwise identical to fp32 masters whose bf16 copy is rounded the same way;
- the bf16 weight differs from torch's round-to-nearest-even copy of the same master by one bf16 ulp, and only
  on exact ties whose upper half is even (1 in 131072 uniformly distributed masters); everywhere else the two
  roundings agree, overflow to +-inf included.

Special values: +-0, subnormals and +-inf round-trip like any other pattern. A NaN master is stored as the
quiet bf16 NaN 0x7FC0 with remainder 0, and joins back to the quiet NaN 0x7FC00000: NaN payloads are not kept,
because rounding a NaN's upper half up can carry out of the exponent field (0x7FFF -> 0x8000 is -0.0) and turn
a NaN into a number. A pair that ``split`` did not produce (a weight written behind the optimizer's back, with
a stale remainder) joins to a value within one bf16 ulp of the weight.

**Storage.** The remainders of an optimizer's contiguous parameters are carved, one view each, out of a few
shared buffers per device (``new_storages``) instead of being allocated one tensor per parameter. CUDA's caching
allocator hands a request out of a free block whole when what would be left of the block is 1 MiB or less (it
splits only a larger rest), and counts the whole block as allocated: a tensor of a few MiB per parameter can cost
up to 1 MiB more than it asks for, a buffer of many parameters that much once.

The master step on remainder masters (``ampinit._masters.reference``, with ``Masters.remainder``, and its
Triton kernels) joins each master, updates it, and splits it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

REMAINDER_DTYPE = torch.int16

#: The largest buffer ``new_storages`` allocates: a few per model (a parameter whose storage is larger gets its
#: own), small enough that one allocation is never much harder to place than the tensors it holds.
PACK_BYTES = 256 << 20

#: Where each view in a shared buffer starts: a multiple of this many bytes from the buffer's start (which torch's
#: CPU and CUDA allocators align at least as much), so the kernels' 16-byte vector accesses hold and no 32-byte
#: sector is shared. Parameters whose sizes are multiples of 32 elements (most) leave no gap between views.
ALIGN_BYTES = 64

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def new_storages(params: Sequence[torch.Tensor], dtype: torch.dtype, limit: int = PACK_BYTES) -> list[torch.Tensor]:
    """An uninitialised tensor of ``dtype`` for each of ``params``, of its shape, strides and device.

    Contiguous parameters get views into shared buffers of at most ``limit`` bytes, one buffer per run of
    parameters on one device in the given order, each view starting ``ALIGN_BYTES``-aligned; any other parameter
    (strided, empty, larger than ``limit`` on its own, or a tensor subclass such as FSDP2's DTensor, whose shape is
    not its local storage's) gets a tensor of its own, as ``torch.empty_like`` makes.
    """
    if limit <= 0:
        raise ValueError(f"new_storages packs into buffers of a positive number of bytes, got limit={limit}")
    itemsize = dtype.itemsize
    align, most = max(1, ALIGN_BYTES // itemsize), limit // itemsize
    out: list[torch.Tensor | None] = [None] * len(params)
    runs: dict[torch.device, list[list[tuple[int, int]]]] = {}  # device -> buffers -> (index, element offset)
    ends: dict[torch.device, int] = {}
    for index, param in enumerate(params):
        numel = param.numel()
        if type(param) not in _PLAIN or numel == 0 or numel > most or not param.is_contiguous():
            out[index] = torch.empty_like(param, dtype=dtype)
            continue
        buffers = runs.setdefault(param.device, [[]])
        start = -(-ends.get(param.device, 0) // align) * align
        if start + numel > most:
            buffers.append([])
            start = 0
        buffers[-1].append((index, start))
        ends[param.device] = start + numel
    for device, buffers in runs.items():
        for members in buffers:
            last, offset = members[-1]
            flat = torch.empty(offset + params[last].numel(), dtype=dtype, device=device)
            for index, offset in members:
                shape = params[index].shape
                out[index] = flat[offset : offset + params[index].numel()].view(shape)
    made = [tensor for tensor in out if tensor is not None]
    assert len(made) == len(params)
    return made


def split_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 ``master`` as its bf16 ``weight`` (ties away from zero) and int16 ``remainder``.

    ``master`` is used as scratch (it is overwritten); all three tensors must have the same shape.
    """
    # Canonical NaN first (math.nan is 0x7FC00000): B + 0x8000 would overflow the int32 for the NaNs just
    # below 0x80000000, and carry the negative NaNs 0xFFFF8000.. into +0.0.
    master.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=-math.inf)
    bits = master.view(torch.int32)
    # B - (weight << 16) is B's low half read as a signed int16 (it lies in int16's range and differs from B by
    # a multiple of 2**16), which is what the narrowing copy keeps: torch converts integers as C++ does, modulo
    # 2**16 (tests/test_remainder_masters.py checks every low half).
    remainder.copy_(bits)
    bits.add_(0x8000)
    bits.bitwise_right_shift_(16)  # arithmetic: floor((B + 0x8000) / 2**16), in int16's range
    weight.view(torch.int16).copy_(bits)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, remainder)`` of an fp32 ``master``: a bf16 tensor and an int16 tensor of its shape."""
    _check_master(master)
    weight = torch.empty_like(master, dtype=torch.bfloat16)
    remainder = torch.empty_like(master, dtype=REMAINDER_DTYPE)
    split_(master.detach().clone(), weight, remainder)
    return weight, remainder


def join_(weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the fp32 master of (``weight``, ``remainder``) into ``out`` and return it."""
    out.copy_(weight)  # bf16 -> fp32 is exact: the bits are weight << 16, NaNs included
    out.view(torch.int32).add_(remainder)  # int16 operand, int32 result: no temporary
    return out


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that ``split`` turned into ``weight`` and ``remainder``: exactly, bit for bit."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != REMAINDER_DTYPE or weight.shape != remainder.shape:
        raise ValueError(
            f"join needs a bfloat16 weight and an int16 remainder of one shape, got {weight.dtype} "
            f"{tuple(weight.shape)} and {remainder.dtype} {tuple(remainder.shape)}"
        )
    return join_(weight, remainder, torch.empty_like(weight, dtype=torch.float32))


def _check_master(master: torch.Tensor) -> None:
    if master.dtype != torch.float32:
        raise ValueError(f"remainder masters split fp32 tensors, got {master.dtype}")
