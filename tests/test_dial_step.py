"""The master step over the precision dial's storages (``reference.adam_dial_`` / ``sgd_dial_``) against a per-element
re-implementation written here in Python floats.

Every fp32 operation of the step is a float64 operation rounded to fp32 (:func:`f32`), which is exact IEEE fp32 for
``+ - * /`` and ``sqrt`` (53 >= 2 * 24 + 2 bits). The storages are re-implemented on values: stochastic rounding
picks, between the two neighbours of ``x`` on the narrower grid, the one away from zero when the dropped random
bits ``r`` reach ``2**d * (1 - t)``, ``t`` the fraction of the gap ``x`` lies above the one toward zero (so it rounds
away with probability ``t``); the 8-bit codes are the nearest entry of the map (ties to the lower), found by
bisection. Random bits come from the spec's hash written in Python.
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass, field

import pytest
import torch

from ampinit._masters import precision, remainder
from ampinit._masters import reference as ref
from tests._dial_storages import Storages

M32 = 0xFFFFFFFF
SIZES = (260, 6)  # a whole 8-bit block and a partial one; a tensor smaller than a block
SEED = 1234


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def key_of(seed: int, step: int, stream: int) -> int:
    return mix32(mix32(mix32(stream) ^ step) ^ seed)


def grid_neighbours(x: float, dropped: int) -> tuple[float, float]:
    """``x``'s neighbours on the fp32 grid with ``dropped`` low bits zero: (toward zero, away from zero)."""
    magnitude = abs(x)
    exponent = -125 if magnitude < 2.0**-126 else math.frexp(magnitude)[1]  # subnormals: the smallest normal's
    ulp = 2.0 ** (exponent - 24 + dropped)
    low = math.floor(magnitude / ulp) * ulp
    high = low if low == magnitude else low + ulp
    return math.copysign(low, x), math.copysign(high, x)


def stochastic(x: float, dropped: int, bits: int) -> float:
    low, high = grid_neighbours(x, dropped)
    if low == high:
        return x
    t = (abs(x) - abs(low)) / (abs(high) - abs(low))
    return high if (bits & (2**dropped - 1)) >= 2**dropped * (1 - t) else low


def ties_away_bf16(x: float) -> float:
    low, high = grid_neighbours(x, 16)
    return high if high != low and abs(x - low) >= abs(high - x) else low


class Codes:
    """The 8-bit block-wise format on values: nearest map entry of ``x / absmax``, ties to the lower."""

    def __init__(self, signed: bool) -> None:
        self.qmap = precision.QuantMap.build(signed)
        self.values = self.qmap.values.tolist()

    def nearest(self, y: float) -> int:
        j = bisect.bisect_left(self.values, y)
        if j == 0:
            return 0
        if j == len(self.values):
            return j - 1
        below, above = self.values[j - 1], self.values[j]
        return j - 1 if y - below <= above - y else j

    def encode(self, xs: list[float]) -> tuple[list[int], list[float], list[float]]:
        """``(codes, absmax per block, decoded values)``."""
        codes, absmax, decoded = [], [], []
        for start in range(0, len(xs), 256):
            block = xs[start : start + 256]
            top = max(abs(v) for v in block)
            absmax.append(top)
            for v in block:
                code = self.nearest(0.0 if top == 0 else f32(v / top))
                codes.append(code)
                decoded.append(f32(self.values[code] * top))
        return codes, absmax, decoded


# -- the model state and its step, per element ----------------------------------------------------------------
@dataclass
class Expected:
    """The test's own state of one tensor: master and moment values as Python floats."""

    master: list[float]
    moments: list[list[float]] = field(default_factory=list)
    codes: list[list[int]] = field(default_factory=list)
    absmax: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Optim:
    name: str
    adam: ref.AdamSettings | None = None
    sgd: ref.SgdSettings | None = None

    @property
    def n_moments(self) -> int:
        return 2 if self.adam else 1


OPTIMIZERS = [
    Optim("adam", adam=ref.AdamSettings(1e-2, 0.9, 0.999, 1e-8, 0.01, decoupled=False, maximize=False)),
    Optim("adamw", adam=ref.AdamSettings(3e-3, 0.8, 0.99, 1e-6, 0.1, decoupled=True, maximize=True)),
    Optim("sgd", sgd=ref.SgdSettings(0.05, 0.9, 0.1, nesterov=False, weight_decay=0.01, maximize=False)),
    Optim("nesterov", sgd=ref.SgdSettings(0.05, 0.9, 0.0, nesterov=True, weight_decay=0.0, maximize=False)),
]
KINDS = ["fp32", "remainder", "remainder8", "stochastic"]
FORMATS = ["fp32", "bf16", "8bit"]


def encode_master(kind: str, value: float, bits: int) -> float:
    if kind == "remainder8":
        return stochastic(value, 8, bits)
    if kind == "stochastic":
        return stochastic(value, 16, bits)
    return value


def encode_moments(fmt: str, values: list[float], key: int, signed: bool, e: Expected, slot: int) -> None:
    if fmt == "bf16":
        e.moments[slot] = [stochastic(v, 16, mix32(key ^ i)) for i, v in enumerate(values)]
    elif fmt == "8bit":
        e.codes[slot], e.absmax[slot], e.moments[slot] = Codes(signed).encode(values)
    else:
        e.moments[slot] = values


def expected_step(
    optim: Optim, kind: str, fmt: str, e: Expected, grad: list[float], inv_scale: float, scalars: list[float],
    t: int, step: int, first: bool,
) -> None:  # fmt: skip
    """One step of tensor ``t`` on the test's state ``e``, element by element."""
    keys = [key_of(SEED, step, 4 * t + purpose) for purpose in range(3)]
    new_moments: list[list[float]] = [[] for _ in e.moments]
    for i, half_grad in enumerate(grad):
        g = f32(half_grad * inv_scale)
        p = e.master[i]
        if optim.adam is not None:
            s = optim.adam
            g = -g if s.maximize else g
            if s.decoupled:
                p = f32(p * f32(1 - s.lr * s.weight_decay))
            else:
                g = f32(g + f32(p * f32(s.weight_decay)))
            m = f32(f32(e.moments[0][i] * f32(s.beta1)) + f32(g * f32(1 - s.beta1)))
            v = f32(f32(e.moments[1][i] * f32(s.beta2)) + f32(f32(g * g) * f32(1 - s.beta2)))
            new_moments[0].append(m)
            new_moments[1].append(v)
            denom = f32(f32(f32(math.sqrt(v)) / scalars[1]) + f32(s.eps))
            p = f32(p - f32(f32(scalars[0] * m) / denom))
        else:
            assert optim.sgd is not None
            q = optim.sgd
            if q.weight_decay != 0:
                g = f32(g + f32(p * f32(q.weight_decay)))
            buf = g if first else f32(f32(e.moments[0][i] * f32(q.momentum)) + f32(g * f32(1 - q.dampening)))
            new_moments[0].append(buf)
            g = f32(g + f32(buf * f32(q.momentum))) if q.nesterov else buf
            p = f32(p - f32(g * f32(q.lr)))
        e.master[i] = encode_master(kind, p, mix32(keys[0] ^ i))
    for slot, values in enumerate(new_moments):
        encode_moments(fmt, values, keys[1 + slot], slot == 0, e, slot)


# -- the storages under test -------------------------------------------------------------------------------------
#: One list's storages as a session would keep them.
Stored = Storages


def start(optim: Optim, kind: str, fmt: str) -> tuple[Stored, list[Expected]]:
    """Storages for bf16 weights of :data:`SIZES` (split from fp32 masters with zero random bits), and the test's
    state holding the same values."""
    gen = torch.Generator().manual_seed(5)
    fp32 = [torch.randn(n, generator=gen) for n in SIZES]
    weights = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    masters: list[torch.Tensor] = []
    remainders: list[torch.Tensor] = []
    if kind == "fp32":
        masters = [x.clone() for x in fp32]
        for w, x in zip(weights, fp32):
            w.copy_(x)
    elif kind == "remainder":
        pairs = [remainder.split(x) for x in fp32]
        weights, remainders = [w for w, _ in pairs], [r for _, r in pairs]
    elif kind == "remainder8":
        remainders = [torch.empty(n, dtype=torch.int8) for n in SIZES]
        for x, w, r in zip(fp32, weights, remainders):
            precision.split8_(x.clone(), w, r, torch.zeros(x.shape, dtype=torch.int64))
    else:
        for w, x in zip(weights, fp32):
            w.copy_(x)
    decoded = [ref_masters(kind, weights, masters, remainders, None).master(i).tolist() for i in range(len(SIZES))]
    n = optim.n_moments
    state = [Expected(values, [[0.0] * len(values)] * n, [[]] * n, [[]] * n) for values in decoded]
    storage = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[fmt]
    moments = [[torch.zeros(k, dtype=storage) for k in SIZES] for _ in range(n)]
    absmax = [[torch.zeros(precision.absmax_blocks(k)) for k in SIZES] for _ in range(n)] if fmt == "8bit" else []
    if fmt == "8bit":  # zero moments: the codes of 0.0 (absmax 0)
        for slot, codes in enumerate(moments):
            zero_code = Codes(slot == 0).nearest(0.0)
            for c in codes:
                c.fill_(zero_code)
    return Stored(kind, fmt, masters, weights, remainders, moments, absmax), state


def ref_masters(
    kind: str, weights: list[torch.Tensor], masters: list[torch.Tensor], remainders: list[torch.Tensor],
    keys: torch.Tensor | None,
) -> ref.Masters:  # fmt: skip
    if kind == "fp32":
        return ref.Masters.fp32(masters, weights)
    if kind == "remainder":
        return ref.Masters.remainder(weights, remainders)
    dummy = torch.zeros(len(weights), dtype=torch.int64)
    if kind == "remainder8":
        return ref.Masters.remainder8(weights, remainders, dummy if keys is None else keys)
    return ref.Masters.stochastic(weights, dummy if keys is None else keys)


def keys_for(step: int, purpose: int) -> torch.Tensor:
    return torch.tensor([key_of(SEED, step, 4 * t + purpose) for t in range(len(SIZES))], dtype=torch.int64)


def moments_of(stored: Stored, slot: int, step: int) -> ref.Moments:
    if stored.fmt == "bf16":
        return ref.Moments.bf16(stored.moments[slot], keys_for(step, 1 + slot))
    if stored.fmt == "8bit":
        qmap = precision.QuantMap.build(signed=slot == 0)
        return ref.Moments.eight_bit(stored.moments[slot], stored.absmax[slot], qmap)
    return ref.Moments.fp32(stored.moments[slot])


def grads_of(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=gen) * 128).to(torch.bfloat16) for n in SIZES]


INV_SCALE = 1 / 128


def run_step(optim: Optim, stored: Stored, step: int, found_inf: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One step of the module under test at ``step`` (the count after its increment); returns the grads."""
    grads = grads_of(step)
    masters = ref_masters(stored.kind, stored.weights, stored.masters, stored.remainders, keys_for(step, 0))
    inv_scale = torch.tensor([INV_SCALE])
    if optim.adam is not None:
        s = optim.adam
        scalars = ref.adam_step_scalars([torch.tensor(float(step))] * len(SIZES), s.beta1, s.beta2, s.lr)
        m, v = moments_of(stored, 0, step), moments_of(stored, 1, step)
        ref.adam_dial_(grads, masters, m, v, scalars, s, inv_scale=inv_scale, found_inf=found_inf)
    else:
        assert optim.sgd is not None
        buffers = moments_of(stored, 0, step)
        ref.sgd_dial_(
            grads, masters, buffers, optim.sgd, first_step=step == 1, inv_scale=inv_scale, found_inf=found_inf
        )
    return grads


def check(stored: Stored, state: list[Expected]) -> None:
    masters = ref_masters(stored.kind, stored.weights, stored.masters, stored.remainders, None)
    for t, e in enumerate(state):
        assert masters.master(t).tolist() == e.master, "master"
        if stored.kind == "fp32":
            want_weight = torch.tensor(e.master).to(torch.bfloat16)  # torch's round-to-nearest-even
        else:
            want_weight = torch.tensor([ties_away_bf16(x) for x in e.master]).to(torch.bfloat16)
        assert torch.equal(stored.weights[t].view(torch.int16), want_weight.view(torch.int16)), "weight"
        for slot, values in enumerate(e.moments):
            got = moments_of(stored, slot, 1).load(t)
            assert got.tolist() == values, f"moment {slot}"
            if stored.fmt == "8bit":
                assert stored.moments[slot][t].tolist() == e.codes[slot]
                assert stored.absmax[slot][t].tolist() == e.absmax[slot]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optim", OPTIMIZERS, ids=lambda o: o.name)
def test_step_matches_the_per_element_reimplementation(optim: Optim, kind: str, fmt: str) -> None:
    stored, state = start(optim, kind, fmt)
    for step in (1, 2, 3):
        grads = run_step(optim, stored, step)
        scalars = [0.0, 0.0]
        if optim.adam is not None:
            s = optim.adam
            table = ref.adam_step_scalars([torch.tensor(float(step))], s.beta1, s.beta2, s.lr)
            scalars = table[0].tolist()
        for t, e in enumerate(state):
            grad = grads[t].tolist()
            expected_step(optim, kind, fmt, e, grad, INV_SCALE, scalars, t, step, first=step == 1)
        check(stored, state)


def snapshot(stored: Stored) -> list[torch.Tensor]:
    return [x.clone() for x in stored.tensors()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("kind", "fmt"), [("remainder8", "8bit"), ("stochastic", "bf16"), ("fp32", "bf16")])
@pytest.mark.parametrize("optim", [OPTIMIZERS[0], OPTIMIZERS[2]], ids=lambda o: o.name)
def test_a_raised_flag_writes_nothing(optim: Optim, kind: str, fmt: str) -> None:
    stored, _ = start(optim, kind, fmt)
    run_step(optim, stored, 1)
    before = snapshot(stored)
    run_step(optim, stored, 2, found_inf=torch.ones(1))
    assert same(before, snapshot(stored))


def run(optim: Optim, stored: Stored, steps: range) -> Stored:
    for step in steps:
        run_step(optim, stored, step)
    return stored


@pytest.mark.parametrize(("kind", "fmt"), [("remainder8", "8bit"), ("stochastic", "bf16")])
def test_the_same_keys_give_the_same_bits_and_resume_is_bitwise(kind: str, fmt: str) -> None:
    optim = OPTIMIZERS[1]
    once = run(optim, start(optim, kind, fmt)[0], range(1, 5))
    again = run(optim, start(optim, kind, fmt)[0], range(1, 5))
    assert same(snapshot(once), snapshot(again))
    halfway = run(optim, start(optim, kind, fmt)[0], range(1, 3))
    resumed = run(optim, halfway.clone(), range(3, 5))  # rebuilt from saved tensors, then two more steps
    assert same(snapshot(once), snapshot(resumed))


def test_other_keys_round_differently() -> None:
    optim = OPTIMIZERS[0]
    stored, _ = start(optim, "stochastic", "bf16")
    other = stored.clone()
    run_step(optim, stored, 1)
    grads = grads_of(1)
    masters = ref.Masters.stochastic(other.weights, keys_for(1, 0) ^ 1)
    s = optim.adam
    assert s is not None
    scalars = ref.adam_step_scalars([torch.tensor(1.0)] * len(SIZES), s.beta1, s.beta2, s.lr)
    m, v = ref.Moments.bf16(other.moments[0], keys_for(1, 1)), ref.Moments.bf16(other.moments[1], keys_for(1, 2))
    ref.adam_dial_(grads, masters, m, v, scalars, s, inv_scale=torch.tensor([INV_SCALE]))
    assert not torch.equal(stored.weights[0], other.weights[0])
    assert torch.equal(stored.moments[0][0], other.moments[0][0])  # only the weights' keys changed


def test_bad_keys_and_maps_are_refused() -> None:
    weights = [torch.zeros(3, dtype=torch.bfloat16)] * 2
    with pytest.raises(ValueError, match=r"stochastic masters need one int64 random key per tensor \(2\), got "):
        ref.Masters.stochastic(weights, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bf16 moments need one int64 random key per tensor \(2\), got torch.int32"):
        ref.Moments.bf16(weights, torch.zeros(2, dtype=torch.int32))
    unsigned = ref.Moments.eight_bit([], [], precision.QuantMap.build(signed=False))
    settings = OPTIMIZERS[0].adam
    assert settings is not None
    with pytest.raises(ValueError, match="8-bit exp_avg is quantized with the signed dynamic map, got the unsigned"):
        ref.adam_dial_([], ref.Masters.fp32([]), unsigned, unsigned, torch.zeros(0, 2), settings)
