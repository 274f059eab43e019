"""The precision dial's number formats: counter-based random bits, stochastic rounding, 8-bit remainder masters,
bf16 moments and 8-bit block-wise quantized moments. Plain torch ops on any device, no host synchronisation.

**Random bits.** Counter-based, so a step is reproducible and a resumed run draws the bits the uninterrupted one
would have drawn. All arithmetic is on unsigned 32-bit values (held in int64 tensors, masked after each op)::

    mix32(x)                = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key(seed, step, stream) = mix32(mix32(mix32(stream) ^ step) ^ seed)      # one per (tensor, purpose)
    bits(key, i)            = mix32(key ^ i)                                  # i: the element's flat index

``stream = 4 * t + purpose`` (``t`` the parameter's position in the optimizer's param groups; purpose 0 weight,
1 ``exp_avg``/``momentum_buffer``, 2 ``exp_avg_sq``) and ``step`` the tensor's step count after this step's
increment. ``mix32`` is the finaliser of Chris Wellons' "lowbias32" integer hash (its two multipliers), a
bijection of 32-bit integers.

**Stochastic rounding by dropping d low bits.** On ``B``, the fp32 bit pattern read as a signed int32 (NaN made
canonical, 0x7FC00000 first), ``c = (B + (bits & (2**d - 1))) >> d`` (arithmetic shift). ``B`` grows with the
magnitude for either sign, so the magnitude is rounded up with probability (dropped bits) / 2**d and down
otherwise: the result is always one of the two neighbours in the narrower format (a representable value is kept
exactly) and its expectation is the input (unbiased). ``+-0``, subnormals and ``+-inf`` are patterns like any
other; the canonical NaN stays NaN (payloads are not kept); the largest finite values (within the dropped bits of
the format's largest) can round to ``+-inf``. With ``d = 16`` this is fp32 -> bf16: one draw keeps a relative
error below 2**-7 (one bf16 ulp; round-to-nearest keeps half of that), but repeated updates too small for a bf16
ulp still move the weight on average, which is what ``master_weights="stochastic"`` and bf16 moments rely on.

**8-bit remainder masters** (``master_weights="remainder8"``): an fp32 master as its bf16 weight (the model's own)
plus an int8 remainder, a 24-bit master (16 significant bits; relative error below 2**-15 of the fp32 master)::

    c24 = (B + (bits & 0xFF)) >> 8      # stochastically rounded to 24 bits
    w   = (c24 + 0x80) >> 8             # the bf16 weight: half up on the integer = ties away from zero
    rem = c24 - (w << 8)                # in [-128, 127]
    B   = ((w << 8) + rem) << 8         # join

The weight is rounded as ``ampinit._masters.remainder`` rounds it (ties away, overflow to ``+-inf``); join then
split again is exact (the joined master's low 8 bits are 0).

**bf16 moments** (``optimizer_state="bf16"``): stored as the stochastic rounding (d = 16) of the fp32 moment,
decoded exactly by widening.

**8-bit moments** (``optimizer_state="8bit"``): block-wise dynamic quantization, after Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (ICLR 2022), with the dynamic tree map as bitsandbytes'
``create_dynamic_map`` and torchao's 8-bit optimizers build it (``max_exponent_bits=7``, ``total_bits=8``: decade
``i`` of 7, ``10**(i-6) * [0.1, 1]``, holds the ``2**i`` (signed, each sign) or ``2**(i+1)`` (unsigned) midpoints
of equal steps, plus 0 and 1). Each flat block of :data:`QBLOCK` elements keeps its fp32 ``absmax``; each element
a uint8 code, the nearest map entry to ``y = x / absmax`` (correctly rounded fp32; 0 when absmax is 0), ties to
the lower code. Decoding is ``map[code] * absmax``. The error is at most half the local gap of the map times the
block's absmax: below ``absmax * 0.9 / 128`` (signed) and ``absmax * 0.9 / 256`` (unsigned) for elements in the top
decade of the block, relatively larger for smaller ones (about 7% of the element in the signed map's top decade,
growing as the decades thin out), and elements below ``absmax * 2.75e-7`` (signed; ``absmax * 1.4e-7`` unsigned)
become 0. The map's entries are computed in float64 and rounded once to fp32 (bitsandbytes computes them in fp32,
so an entry may differ from its in the last bit). Inputs must be finite (a skipped step never encodes).

**Slices.** The encoders and decoders that a step runs on whole tensors (:func:`encode_bf16_keyed_`,
:func:`split8_keyed_`, :func:`join8`, :func:`quantize_blockwise`, :func:`dequantize_blockwise`) work through the
flat tensor :data:`SLICE_ELEMENTS` elements at a time, writing their output slice by slice: their int64 and float64
temporaries (48 B per element for the random bits alone) are bounded by a slice, not by the largest tensor. Element
``i`` of a slice is element ``i`` of the whole tensor for its random bits and its 8-bit block, so the result does
not depend on the slice size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

QBLOCK = 256
"""Elements per block of the 8-bit moments (one fp32 absmax each)."""

SLICE_ELEMENTS = 1 << 18
"""The most elements an encoder or decoder takes at once (see "Slices" above): a multiple of :data:`QBLOCK`, so
that no 8-bit block straddles two slices. Read at each call. 2**18 bounds the random bits' temporaries at 12 MiB
while a GPU without Triton (where the chunked step also runs) launches each op once per 2**18 elements, not per
few thousand."""

_MASK32 = 0xFFFFFFFF
_MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_CANONICAL_NAN = math.nan  # 0x7FC00000


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # x * constant mod 2**32 by 16-bit halves of the constant: no int64 product reaches 2**63.
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit mixing function of each element of ``x`` (int64 holding values in ``[0, 2**32)``)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MULTIPLIERS[1])
    return x ^ (x >> 16)


def keys(seed: int, steps: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """One random key per tensor: int64 values in ``[0, 2**32)``, on ``steps``' device.

    ``steps`` holds each tensor's step count (any dtype holding integers: torch's Adam keeps float steps),
    ``streams`` each tensor's ``4 * t + purpose``; both of one shape (or broadcastable).
    """
    return keys_of_mixed(seed, steps, mixed_streams(streams.to(steps.device)))


def mixed_streams(streams: torch.Tensor) -> torch.Tensor:
    """``mix32`` of each stream (``4 * t + purpose``): the part of :func:`keys` that does not change from step to
    step, for callers that keep it (:func:`keys_of_mixed`)."""
    return mix32(streams.to(torch.int64) & _MASK32)


def keys_of_mixed(seed: int, steps: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """:func:`keys` from the streams' :func:`mixed_streams` (on ``steps``' device, broadcastable with ``steps``)."""
    step = steps.to(torch.int64) & _MASK32
    return mix32(mix32(mixed ^ step) ^ (seed & _MASK32))


def random_bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The random 32 bits (int64 in ``[0, 2**32)``) of the elements at flat ``index`` of a tensor with ``key``."""
    return mix32(key ^ index)


def tensor_bits(key: torch.Tensor, like: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The random bits of every element of ``like``, shaped as it: those of the flat (row-major) elements
    ``start``, ``start + 1``, ... of a tensor with ``key`` (``like`` is that tensor, or a slice of it flat)."""
    index = torch.arange(start, start + like.numel(), device=like.device, dtype=torch.int64).reshape(like.shape)
    return random_bits(key.to(like.device).reshape(()), index)


def flat_slices(numel: int) -> Iterator[slice]:
    """``range(numel)`` in consecutive slices of at most :data:`SLICE_ELEMENTS` elements."""
    size = SLICE_ELEMENTS
    if size <= 0 or size % QBLOCK:
        raise ValueError(f"SLICE_ELEMENTS must be a positive multiple of QBLOCK ({QBLOCK}), got {size}")
    return (slice(start, min(start + size, numel)) for start in range(0, numel, size))


def _flat(out: torch.Tensor) -> torch.Tensor:
    """``out`` flat, for writing slice by slice: a view of it, or for a strided ``out`` (a channels_last weight,
    whose flat reshape would be a copy that writes are lost in) a row-major copy that :func:`_written_back` copies
    back."""
    return out.contiguous().view(-1)


def _written_back(out: torch.Tensor, flat: torch.Tensor) -> None:
    if not out.is_contiguous():
        out.copy_(flat.view(out.shape))


def _signed_bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s fp32 pattern as a signed integer in int64, NaNs made canonical."""
    canonical = x.float().nan_to_num(nan=_CANONICAL_NAN, posinf=math.inf, neginf=-math.inf)
    return canonical.view(torch.int32).to(torch.int64)


def _narrow(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Values already in the target's signed range: the integer copy keeps them, the view reinterprets the pattern.
    integer = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    return values.to(integer).view(dtype)


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` stochastically rounded to bf16 with the low 16 of ``bits`` (int64, ``x``'s shape)."""
    return _narrow((_signed_bits(x) + (bits & 0xFFFF)) >> 16, torch.bfloat16)


def encode_bf16_(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> None:
    """Store fp32 ``x`` into the bf16 tensor ``out`` (a weight or a moment), stochastically rounded."""
    out.copy_(round_bf16_stochastic(x, bits))


def encode_bf16_keyed_(out: torch.Tensor, x: torch.Tensor, key: torch.Tensor) -> None:
    """:func:`encode_bf16_` with the bits of a tensor with ``key`` (:func:`tensor_bits`), a slice at a time."""
    flat_out, flat_x = _flat(out), x.reshape(-1)
    for part in flat_slices(flat_x.numel()):
        encode_bf16_(flat_out[part], flat_x[part], tensor_bits(key, flat_x[part], part.start))
    _written_back(out, flat_out)


def decode_bf16(stored: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a bf16 weight or moment: exact (widening)."""
    return stored.float()


REMAINDER8_DTYPE = torch.int8


def split8_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor, bits: torch.Tensor) -> None:
    """Write fp32 ``master`` as its bf16 ``weight`` and int8 ``remainder``, its low 8 bits stochastically rounded
    with the low 8 of ``bits`` (int64, the master's shape)."""
    c24 = (_signed_bits(master) + (bits & 0xFF)) >> 8
    w = (c24 + 0x80) >> 8
    weight.copy_(_narrow(w, torch.bfloat16))
    remainder.copy_(c24 - (w << 8))


def split8_keyed_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor, key: torch.Tensor) -> None:
    """:func:`split8_` with the bits of a tensor with ``key`` (:func:`tensor_bits`), a slice at a time."""
    flat_master, flat_weight, flat_remainder = master.reshape(-1), _flat(weight), _flat(remainder)
    for part in flat_slices(flat_master.numel()):
        bits = tensor_bits(key, flat_master[part], part.start)
        split8_(flat_master[part], flat_weight[part], flat_remainder[part], bits)
    _written_back(weight, flat_weight)
    _written_back(remainder, flat_remainder)


def join8(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``weight`` and its int8 ``remainder``: exactly what :func:`split8_` stored."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != REMAINDER8_DTYPE or weight.shape != remainder.shape:
        raise ValueError(
            f"join8 needs a bfloat16 weight and an int8 remainder of one shape, got {weight.dtype} "
            f"{tuple(weight.shape)} and {remainder.dtype} {tuple(remainder.shape)}"
        )
    master = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    flat_master, flat_weight, flat_remainder = master.view(-1), weight.reshape(-1), remainder.reshape(-1)
    for part in flat_slices(master.numel()):
        w = flat_weight[part].view(torch.int16).to(torch.int64)
        joined = ((w << 8) + flat_remainder[part].to(torch.int64)) << 8
        flat_master[part] = _narrow(joined, torch.float32)
    return master


@dataclass(frozen=True)
class QuantMap:
    """A sorted 256-entry fp32 dynamic map and its decision points, on one device.

    ``mids`` holds 256 values: the 255 decision points, then ``+inf`` (so that a search of 8 halvings runs over a
    power of two; no finite ``y`` is above it). ``mids[j]`` is the midpoint of ``values[j]`` and ``values[j + 1]``
    rounded *down* to fp32: then the number of ``mids`` strictly below an fp32 ``y`` is the code of ``y``'s nearest
    entry, ties to the lower code, also where the exact midpoint is not an fp32 value (rounded to nearest, an fp32
    ``y`` equal to a midpoint rounded up would go to the farther entry).
    """

    signed: bool
    values: torch.Tensor
    mids: torch.Tensor

    @classmethod
    def build(cls, signed: bool, device: torch.device | str = "cpu") -> QuantMap:
        values = dynamic_map(signed)
        exact = (values[:-1].double() + values[1:].double()) / 2  # exact: the entries span < 29 binades
        mids = exact.float()
        mids = torch.where(mids.double() > exact, torch.nextafter(mids, torch.tensor(-math.inf)), mids)
        mids = torch.cat([mids, torch.tensor([math.inf])])
        return cls(signed, values.to(device), mids.to(device))


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 8-bit dynamic tree map (Dettmers et al. 2022): 256 sorted fp32 values in ``[-1, 1]`` or ``[0, 1]``."""
    entries = [0.0, 1.0]
    for decade in range(7):
        steps = 2**decade if signed else 2 ** (decade + 1)
        width = 0.9 / steps
        scale = 10.0 ** (decade - 6)
        means = [scale * (0.1 + width * (k + 0.5)) for k in range(steps)]
        entries += means
        if signed:
            entries += [-m for m in means]
    return torch.tensor(sorted(entries), dtype=torch.float64).float()


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flat, zero-padded to whole blocks, as ``[blocks, QBLOCK]``."""
    flat = x.reshape(-1)
    pad = -flat.numel() % QBLOCK
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, QBLOCK)


def quantize_blockwise(x: torch.Tensor, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of fp32 ``x``: uint8 codes of ``x``'s shape and one fp32 absmax per block."""
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(absmax_blocks(x.numel()), dtype=torch.float32, device=x.device)
    flat_x, flat_codes = x.reshape(-1), codes.view(-1)
    for part in flat_slices(flat_x.numel()):
        blocks = _blocks(flat_x[part].float())
        scale = blocks.abs().amax(dim=1)
        first = part.start // QBLOCK
        absmax[first : first + scale.numel()] = scale
        divisor = scale.unsqueeze(1)
        # Through float64 the quotient is correctly rounded (torch's fp32 division by a broadcast value may not be).
        y = torch.where(divisor == 0, 0.0, (blocks.double() / divisor.double()).float())
        flat_codes[part] = torch.searchsorted(qmap.mids, y.reshape(-1))[: part.stop - part.start]
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    """The fp32 tensor (``codes``' shape) that :func:`quantize_blockwise` encoded."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    flat_out, flat_codes = out.view(-1), codes.reshape(-1)
    for part in flat_slices(flat_codes.numel()):
        blocks = _blocks(flat_codes[part].to(torch.int64))
        first = part.start // QBLOCK
        scaled = qmap.values[blocks] * absmax[first : first + blocks.shape[0]].unsqueeze(1)
        flat_out[part] = scaled.reshape(-1)[: part.stop - part.start]
    return out


def quantized_zeros(shape: torch.Size, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize_blockwise` gives for fp32 zeros of ``shape`` (every block's absmax 0, so every ``y`` 0:
    one code, the search's for 0), without an fp32 tensor of zeros to quantize: the 8-bit moments a first step
    starts from, at 1 B per element where the zeros would take 4 (and their float64 quotients, slice by slice)."""
    device = qmap.mids.device
    zero_code = torch.searchsorted(qmap.mids, torch.zeros(1, device=device)).to(torch.uint8).reshape(())
    codes = torch.empty(shape, dtype=torch.uint8, device=device)
    codes.copy_(zero_code)  # broadcast from a 0-d tensor on the device: no host sync for the code
    absmax = torch.zeros(absmax_blocks(codes.numel()), dtype=torch.float32, device=device)
    return codes, absmax


def absmax_blocks(numel: int) -> int:
    """How many absmax values (blocks) an 8-bit moment of ``numel`` elements keeps."""
    return -(-numel // QBLOCK)
