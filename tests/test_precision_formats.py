"""The precision dial's number formats (``ampinit._masters.precision``) against references written here.

The references are plain Python on values, not the module's bit arithmetic: the mixing function on Python ints
mod 2**32; stochastic rounding against the two neighbours of a value on the narrower format's grid (from
``math.frexp``, in float64) and the exact probability of rounding up; the 8-bit codes against a brute-force
nearest entry over the 256 map values.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from ampinit._masters import precision

M32 = 0xFFFFFFFF


# -- the random bits -------------------------------------------------------------------------------------------
def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_key(seed: int, step: int, stream: int) -> int:
    return py_mix32(py_mix32(py_mix32(stream) ^ step) ^ seed)


def test_mix32_is_the_uint32_hash() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 2**32, (4000,), generator=gen, dtype=torch.int64)
    values[:6] = torch.tensor([0, 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1])
    got = precision.mix32(values)
    assert got.tolist() == [py_mix32(v) for v in values.tolist()]


def test_keys_follow_the_spec_on_the_device(device: torch.device) -> None:
    seeds = [0, 1, 12345, 2**32 - 1]
    steps = torch.arange(1, 9, device=device, dtype=torch.float32)  # torch's Adam keeps float step counts
    streams = torch.arange(16, device=device)
    seen = set()
    for seed in seeds:
        got = precision.keys(seed, steps.unsqueeze(1), streams.unsqueeze(0))
        assert got.device.type == device.type
        want = [[py_key(seed, int(step), int(stream)) for stream in range(16)] for step in range(1, 9)]
        assert got.cpu().tolist() == want
        seen.update(v for row in want for v in row)
    assert len(seen) == len(seeds) * 8 * 16  # every (seed, step, stream) its own key


def test_element_bits_follow_the_spec() -> None:
    key = torch.tensor(py_key(7, 3, 5))
    like = torch.empty(3, 5)
    got = precision.tensor_bits(key, like)
    assert got.shape == like.shape
    assert got.reshape(-1).tolist() == [py_mix32(int(key) ^ i) for i in range(15)]


# -- stochastic rounding: a value-level reference -----------------------------------------------------------------
def grid_neighbours(x: float, dropped: int) -> tuple[float, float]:
    """The two values either side of finite fp32 ``x`` on the grid of fp32 with ``dropped`` low bits zero:
    ``(toward zero, away from zero)``, equal when ``x`` is on the grid."""
    magnitude = abs(x)
    if magnitude < 2.0**-126:
        ulp = 2.0 ** (-149 + dropped)
    else:
        _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
        ulp = 2.0 ** (exponent - 24 + dropped)
    low = math.floor(magnitude / ulp) * ulp
    high = low if low == magnitude else low + ulp
    sign = -1.0 if math.copysign(1.0, x) < 0 else 1.0
    return sign * low, sign * high


def interesting_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    normal = torch.randn(40, generator=gen) * torch.logspace(-30, 30, 40)
    specials = [1.0, -1.0, 1.0 + 2**-23, -(1.0 + 2**-8 + 2**-20), 3.0e-39, -1.0e-45, 2**-126, 1.5e-40, 3.0e38]
    return torch.cat([normal, torch.tensor(specials)])


def all_low_bits(dropped: int, n: int) -> torch.Tensor:
    """Every possible value of the ``dropped`` low random bits, once each, for ``n`` elements: ``[2**dropped, n]``."""
    return torch.arange(2**dropped, dtype=torch.int64).unsqueeze(1).expand(-1, n)


def test_stochastic_bf16_lands_on_a_neighbour_and_is_exactly_unbiased() -> None:
    x = interesting_values()
    bits = all_low_bits(16, x.numel())
    rounded = precision.round_bf16_stochastic(x.expand(2**16, -1), bits).double()
    for j, value in enumerate(x.tolist()):
        low, high = grid_neighbours(value, 16)
        column = rounded[:, j]
        assert bool(((column == low) | (column == high)).all()), value
        # Over all 2**16 low-bit values the rounding goes away from zero exactly (x - low) / ulp of the time,
        # so the mean is x itself.
        ups = int((column == high).sum()) if high != low else 0
        assert ups == (round((value - low) / (high - low) * 2**16) if high != low else 0), value
        assert math.fsum(column.tolist()) / 2**16 == value


def test_stochastic_bf16_mean_converges_with_the_generator_bits() -> None:
    value = 1.0 + 0.3 * 2**-7  # 30% of a bf16 ulp above 1.0
    n = 20000
    key = precision.keys(99, torch.tensor(4), torch.tensor(1))
    bits = precision.tensor_bits(key, torch.empty(n))
    rounded = precision.round_bf16_stochastic(torch.full((n,), value), bits).double()
    low, high = grid_neighbours(value, 16)
    assert set(rounded.unique().tolist()) == {low, high}
    p = (value - low) / (high - low)
    standard_error = (high - low) * math.sqrt(p * (1 - p) / n)
    assert abs(rounded.mean().item() - value) < 4 * standard_error


def test_stochastic_bf16_keeps_representable_values_and_specials() -> None:
    representable = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**-133, -(2.0**-126), 3.3895313892515355e38, 65280.0])
    specials = torch.tensor([math.inf, -math.inf])
    x = torch.cat([representable, specials])
    bits = all_low_bits(16, x.numel())
    got = precision.round_bf16_stochastic(x.expand(2**16, -1), bits)
    want = x.to(torch.bfloat16).expand(2**16, -1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise: -0.0 stays -0.0
    nans = torch.tensor([math.nan, -math.nan, torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)])
    got_nan = precision.round_bf16_stochastic(nans.expand(2**16, -1), all_low_bits(16, 3))
    assert bool((got_nan.view(torch.int16) == 0x7FC0).all())


def test_stochastic_bf16_may_overflow_only_from_the_top_ulp() -> None:
    largest = torch.tensor(torch.finfo(torch.float32).max)
    got = precision.round_bf16_stochastic(largest.expand(2**16), all_low_bits(16, 1).reshape(-1)).float()
    assert set(got.tolist()) == {3.3895313892515355e38, math.inf}


def test_bf16_moments_decode_exactly() -> None:
    stored = torch.tensor([1.0, -3.0e-39, 1.5e20, -0.0], dtype=torch.bfloat16)
    assert torch.equal(precision.decode_bf16(stored).double(), stored.double())
    out = torch.empty(4, dtype=torch.bfloat16)
    precision.encode_bf16_(out, stored.float(), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(out.view(torch.int16), stored.view(torch.int16))


# -- 8-bit remainder masters --------------------------------------------------------------------------------------
def nearest_bf16_ties_away(value: float) -> float:
    """``value`` (fp32) rounded to the nearest bf16, ties away from zero: from its two bf16 neighbours."""
    low, high = grid_neighbours(value, 16)
    if high != low and abs(value - low) >= abs(high - value):
        return high if abs(high) < 2.0**128 else math.copysign(math.inf, value)
    return low


def split8(master: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.empty_like(master, dtype=torch.bfloat16)
    remainder = torch.empty_like(master, dtype=torch.int8)
    precision.split8_(master.clone(), weight, remainder, bits)
    return weight, remainder


def test_remainder8_rounds_the_master_to_24_bits_unbiased() -> None:
    x = interesting_values()[:-1]  # the last one, 3.0e38, rounds its weight to inf: its own test below
    bits = all_low_bits(8, x.numel())
    weight, remainder = split8(x.expand(256, -1).contiguous(), bits)
    joined = precision.join8(weight, remainder).double()
    for j, value in enumerate(x.tolist()):
        low, high = grid_neighbours(value, 8)
        column = joined[:, j]
        assert bool(((column == low) | (column == high)).all()), value
        assert math.fsum(column.tolist()) / 256 == value
        weights = weight[:, j].double()
        assert weights.tolist() == [nearest_bf16_ties_away(v) for v in column.tolist()]


def test_remainder8_second_split_is_exact() -> None:
    x = interesting_values()
    gen = torch.Generator().manual_seed(2)
    first = split8(x, torch.randint(0, 2**32, x.shape, generator=gen))
    joined = precision.join8(*first)
    second = split8(joined, torch.randint(0, 2**32, x.shape, generator=gen))
    assert torch.equal(precision.join8(*second).view(torch.int32), joined.view(torch.int32))
    assert torch.equal(second[0].view(torch.int16), first[0].view(torch.int16))
    assert torch.equal(second[1], first[1])


def test_remainder8_specials() -> None:
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1.0e-45, -3.0e38])
    bits = torch.full(x.shape, 0xFF, dtype=torch.int64)
    weight, remainder = split8(x, bits)
    joined = precision.join8(weight, remainder)
    assert joined.view(torch.int32)[:4].tolist() == x.view(torch.int32)[:4].tolist()
    assert joined.view(torch.int32)[4:6].tolist() == [0x7FC00000, 0x7FC00000]
    assert joined[6].item() == 2.0**-141  # the smallest subnormal rounds up to the 24-bit grid: all bits set
    assert weight[6:].double().tolist() == [nearest_bf16_ties_away(v) for v in joined[6:].tolist()]
    assert remainder.dtype == torch.int8


def test_join8_refuses_other_storages() -> None:
    message = "join8 needs a bfloat16 weight and an int8 remainder of one shape, got torch.bfloat16 (2,) and "
    with pytest.raises(ValueError, match=re.escape(message + "torch.int16 (2,)")):
        precision.join8(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))


# -- 8-bit block-wise moments -------------------------------------------------------------------------------------
def paper_map(signed: bool) -> list[float]:
    """The dynamic tree map as the paper and bitsandbytes describe it: per decade ``i`` of 7, the means of adjacent
    points of ``linspace(0.1, 1, n + 1)`` scaled by ``10**(i - 6)`` (mirrored when signed), then 0 and 1."""
    entries = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        entries += means + ([-m for m in means] if signed else [])
    return sorted(entries)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_the_papers(signed: bool) -> None:
    got = precision.dynamic_map(signed)
    want = torch.tensor(paper_map(signed), dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (256,)
    assert bool((got[1:] > got[:-1]).all())
    assert torch.allclose(got.double(), want, rtol=2**-24, atol=0)


def brute_force_codes(y: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The index of the map entry nearest to each ``y`` (compared in float64), the lower index on a tie."""
    distance = (y.double().reshape(-1, 1) - values.double().reshape(1, -1)).abs()
    nearest = distance.min(dim=1, keepdim=True).values
    index = torch.arange(values.numel()).expand_as(distance)
    return torch.where(distance == nearest, index, values.numel()).min(dim=1).values


def blockwise_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, absmax)``: each element over its block's absmax, correctly rounded to fp32 (0 in a zero block)."""
    flat = x.reshape(-1).double()
    absmax = torch.stack([flat[i : i + 256].abs().max() for i in range(0, flat.numel(), 256)])
    per_element = absmax.repeat_interleave(256)[: flat.numel()]
    y = torch.where(per_element == 0, 0.0, flat / per_element).float()
    return y, absmax.float()


def adam_like(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Moment-like values: ``exp_avg`` spread over decades, ``exp_avg_sq`` its squares plus a floor."""
    gen = torch.Generator().manual_seed(seed)
    exp_avg = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2) * 1e-3
    exp_avg_sq = exp_avg * exp_avg + 1e-12
    return exp_avg, exp_avg_sq


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_entry(signed: bool) -> None:
    qmap = precision.QuantMap.build(signed)
    exp_avg, exp_avg_sq = adam_like(700, 3)  # two whole blocks and a partial one
    x = (exp_avg if signed else exp_avg_sq).reshape(7, 100)
    x[3] = 0.0
    codes, absmax = precision.quantize_blockwise(x, qmap)
    y, want_absmax = blockwise_reference(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert torch.equal(absmax, want_absmax)
    assert torch.equal(codes.reshape(-1).long(), brute_force_codes(y, qmap.values))
    decoded = precision.dequantize_blockwise(codes, absmax, qmap)
    per_element = want_absmax.repeat_interleave(256)[:700].reshape(7, 100)
    assert torch.equal(decoded, qmap.values[codes.long()] * per_element)


def test_a_zero_block_and_a_partial_last_block() -> None:
    qmap = precision.QuantMap.build(True)
    x = torch.zeros(256 + 44)
    x[256:] = torch.linspace(-2.0, 0.5, 44)
    codes, absmax = precision.quantize_blockwise(x, qmap)
    assert absmax.tolist() == [0.0, 2.0]
    decoded = precision.dequantize_blockwise(codes, absmax, qmap)
    assert bool((decoded[:256] == 0).all())
    assert decoded[256].item() == 2.0 * qmap.values[0].item()  # -2 is -1 * absmax: the lowest entry, -0.99297
    assert precision.absmax_blocks(300) == 2 and precision.absmax_blocks(256) == 1


def test_ties_go_to_the_lower_code() -> None:
    qmap = precision.QuantMap.build(True)
    values = qmap.values.double()
    exact_mids = (values[:-1] + values[1:]) / 2
    representable = (exact_mids.float().double() == exact_mids).nonzero().reshape(-1)
    assert representable.numel() > 100
    y = exact_mids[representable].float()
    x = torch.cat([torch.ones(1), y, torch.zeros(256 - 1 - y.numel())])  # absmax 1: y is x exactly
    codes, _ = precision.quantize_blockwise(x, qmap)
    assert codes[1 : 1 + y.numel()].long().tolist() == representable.tolist()


@pytest.mark.parametrize("signed", [True, False])
def test_decimal_relative_error_bounds_on_moment_values(signed: bool) -> None:
    """Within each decade below the block's absmax the map has ``n`` equal steps of ``0.9 * 10**-k / n``: an
    element there is off by at most half a step, relatively ``4.5 / n`` (signed: n = 64, 32, ...; unsigned:
    128, 64, ...)."""
    qmap = precision.QuantMap.build(signed)
    exp_avg, exp_avg_sq = adam_like(4096, 4)
    x = exp_avg if signed else exp_avg_sq
    codes, absmax = precision.quantize_blockwise(x, qmap)
    decoded = precision.dequantize_blockwise(codes, absmax, qmap).double()
    y, _ = blockwise_reference(x)
    relative = ((decoded - x.double()).abs() / x.double().abs()).reshape(-1)
    top = 64 if signed else 128
    for k in range(4):
        in_decade = (y.abs() >= 10.0 ** -(k + 1)) & (y.abs() < 10.0**-k)
        assert int(in_decade.sum()) > 20
        bound = 4.5 / (top / 2**k) * (1 + 2**-20)
        assert relative[in_decade].max().item() <= bound, k


@pytest.mark.parametrize("signed", [True, False])
def test_a_midpoint_that_is_no_fp32_value_goes_to_the_nearer_entry(signed: bool) -> None:
    """Where the exact midpoint of two entries is not an fp32 value, the fp32 values either side of it are not
    ties: each goes to the entry it is nearer to."""
    qmap = precision.QuantMap.build(signed)
    values = qmap.values.double()
    exact_mids = (values[:-1] + values[1:]) / 2
    inexact = (exact_mids.float().double() != exact_mids).nonzero().reshape(-1)
    assert inexact.numel() > 50
    mids = exact_mids[inexact]
    nearest = mids.float()
    above = torch.where(nearest.double() > mids, nearest, torch.nextafter(nearest, torch.tensor(math.inf)))
    below = torch.where(nearest.double() < mids, nearest, torch.nextafter(nearest, torch.tensor(-math.inf)))
    for y, nearer in ((above, inexact + 1), (below, inexact)):
        x = torch.cat([torch.ones(1), y])  # absmax 1 in one block (< 256 values): y is x / absmax exactly
        codes, _ = precision.quantize_blockwise(x, qmap)
        assert codes[1:].long().tolist() == nearer.tolist()
        assert torch.equal(codes[1:].long(), brute_force_codes(y, qmap.values))
