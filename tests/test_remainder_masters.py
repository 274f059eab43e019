"""``master_weights="remainder"``: the encoding, training against a plain fp32-master re-implementation, checkpoints
in both directions, skipped steps, memory, errors, and the Triton remainder kernels against the reference.

The reference rounding used here, :func:`tie_away_bf16`, is written from values (the two bf16 neighbours of a
master, compared in float64), not from the bit arithmetic of ``ampinit._remainder``.
"""

from __future__ import annotations

import copy
import gc
import importlib
import io
import os
import re
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import _fused_master, _remainder, _remainder_masters, amp
from ampinit.optimizers import FusedAdam, FusedSGD

# -- an independent reference of the tie rule ------------------------------------------------------------------
HIGH_HALVES = [
    0x0000,  # +0 and the smallest subnormals
    0x0001,
    0x007F,  # largest subnormal upper half
    0x0080,  # smallest normal
    0x3F80,  # 1.0
    0x3F81,
    0x4049,  # pi
    0x7F7E,
    0x7F7F,  # largest finite: its upper rounding goes to inf
    0x7F80,  # inf, then NaNs
    0x7FC0,
    0x7FFF,
    0x8000,  # -0
    0x8001,
    0x807F,
    0xBF80,  # -1.0
    0xC2F7,
    0xFF7F,
    0xFF80,  # -inf, then negative NaNs
    0xFFFF,
]


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns of ``x`` as non-negative int64."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def fp32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 2**15, bits - 2**16, bits)
    return signed.to(torch.int16).view(torch.bfloat16)


def tie_away_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to the nearest bf16, ties away from zero; NaN -> 0x7FC0; overflow -> +-inf.

    The two candidates are the bf16 values either side of ``x`` (toward and away from zero); the nearer one wins,
    compared exactly in float64, and a tie goes to the one away from zero.
    """
    bits = bits_of(x.reshape(-1))
    sign = bits >> 31
    magnitude = bits & 0x7FFFFFFF
    toward = magnitude >> 16  # upper half of the magnitude, truncated
    away = toward + 1
    value = x.reshape(-1).double().abs()

    def magnitude_value(upper: torch.Tensor) -> torch.Tensor:
        # bf16 magnitude pattern -> float64; 0x7F80 stands for 2**128 here (the next "power" after the maximum).
        finite = fp32_from_bits(torch.where(upper >= 0x7F80, 0, upper) << 16).double()
        return torch.where(upper >= 0x7F80, torch.full_like(finite, 2.0**128), finite)

    below, above = magnitude_value(toward), magnitude_value(away)
    upper = torch.where(value - below < above - value, toward, away)
    upper = torch.where(toward >= 0x7F80, toward, upper)  # inf stays inf (NaN is handled below)
    result = (sign << 15) | upper
    result = torch.where(x.reshape(-1).isnan(), torch.full_like(result, 0x7FC0), result)
    return bf16_from_bits(result).reshape(x.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int16: torch.int16}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


def all_low_halves(high: int) -> torch.Tensor:
    return fp32_from_bits(high * 65536 + torch.arange(65536, dtype=torch.int64))


# -- (a) the encoding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("high", HIGH_HALVES, ids=lambda h: f"{h:#06x}")
def test_split_join_round_trips_every_low_half(high: int) -> None:
    masters = all_low_halves(high)
    weight, remainder = _remainder.split(masters)
    joined = _remainder.join(weight, remainder)
    nan = masters.isnan()
    if nan.any():
        # NaN: torch's bf16 NaN, remainder 0, and the canonical fp32 NaN back.
        assert bool(nan.all()) or high in (0x7F80, 0xFF80)
        assert torch.equal(weight.view(torch.int16)[nan], torch.full((int(nan.sum()),), 0x7FC0, dtype=torch.int16))
        assert not remainder[nan].any()
        assert torch.equal(bits_of(joined[nan]), torch.full((int(nan.sum()),), 0x7FC00000, dtype=torch.int64))
    keep = ~nan
    assert torch.equal(bits_of(joined[keep]), bits_of(masters[keep]))
    assert same_bits(weight, tie_away_bf16(masters))
    # The remainder is the master minus the weight's upper half, as signed integers: the low 16 bits, signed.
    signed_master = bits_of(masters[keep]) - (bits_of(masters[keep]) >= 2**31).long() * 2**32
    signed_weight = weight.view(torch.int16)[keep].long()
    assert torch.equal(remainder[keep].long(), signed_master - signed_weight * 65536)


@pytest.mark.parametrize("high", HIGH_HALVES, ids=lambda h: f"{h:#06x}")
def test_weight_differs_from_round_to_nearest_even_only_on_even_ties(high: int) -> None:
    masters = all_low_halves(high)
    weight, _ = _remainder.split(masters)
    nearest_even = masters.to(torch.bfloat16)
    nan = masters.isnan()
    assert bool(weight[nan].isnan().all()) and bool(nearest_even[nan].isnan().all())
    # (torch's vectorised cast may keep NaN payload bits; the remainder encoding makes every NaN 0x7FC0.)
    differ = (weight.view(torch.int16) != nearest_even.view(torch.int16)) & ~nan
    low = bits_of(masters) & 0xFFFF
    even_tie = (low == 0x8000) & (high % 2 == 0) & ~nan
    assert torch.equal(differ, even_tie)
    # Where they differ, the tie rule's weight is one bf16 ulp further from zero.
    assert torch.equal(weight.view(torch.int16)[differ].long(), nearest_even.view(torch.int16)[differ].long() + 1)


def test_infinities_and_zeros_are_kept() -> None:
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4028234663852886e38, -1e-45])
    weight, remainder = _remainder.split(values)
    assert same_bits(_remainder.join(weight, remainder), values)
    assert torch.equal(weight.float()[:4], values[:4]) and str(weight[1].item()) == "-0.0"
    assert weight[4].item() == float("inf")  # the largest fp32 rounds up to inf, as torch's cast does


def test_join_refuses_wrong_dtypes() -> None:
    with pytest.raises(ValueError, match=re.escape("join needs a bfloat16 weight and an int16 remainder")):
        _remainder.join(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match=re.escape("remainder masters split fp32 tensors, got torch.float64")):
        _remainder.split(torch.zeros(3, dtype=torch.float64))


# -- (b) training against a plain re-implementation -----------------------------------------------------------
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, fused=True),
    "Adam-L2-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, foreach=True),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "SGD-dampening-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, fused=True),
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.05),
    "FusedSGD": lambda p: FusedSGD(p, lr=0.05, momentum=0.9, wd_after_momentum=True, weight_decay=1e-3),
}
STEPS = 4


class Net(nn.Module):
    """Linear -> BatchNorm (kept fp32 at O5) -> GELU -> Linear -> LayerNorm -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.fc2(nn.functional.gelu(self.bn(self.fc1(x))))))


def make_net(seed: int, ties: bool) -> tuple[Net, torch.Tensor, torch.Tensor]:
    """A model, inputs and targets; ``ties``: every initial weight is an exact tie with an even upper half."""
    torch.manual_seed(seed)
    net = Net()
    if ties:
        with torch.no_grad():
            for p in net.parameters():
                bits = p.view(torch.int32)
                bits.copy_((bits & ~0x1FFFF) | 0x8000)
    gen = torch.Generator().manual_seed(seed + 100)
    return net, torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen)


class PlainReference:
    """fp32 masters stepped by the same optimizer, the model's bf16 weights rounded from them ties-away.

    The model is cast as O5 casts it (BatchNorm stays fp32), inputs to bf16 and outputs back to fp32.
    """

    def __init__(self, net: Net, make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        self.net = copy.deepcopy(net)
        self.masters = [p.detach().clone().requires_grad_() for p in self.net.parameters()]
        self.optimizer = make_optimizer(self.masters)
        with torch.no_grad():
            for module in self.net.modules():
                if isinstance(module, nn.BatchNorm1d):
                    continue
                for name, param in module._parameters.items():
                    if param is not None:
                        param.data = tie_away_bf16(param.data)
                for name, buffer in module._buffers.items():
                    if buffer is not None and buffer.is_floating_point():
                        module._buffers[name] = buffer.bfloat16()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = list(self.net.parameters())
        for p in params:
            p.grad = None
        loss = nn.functional.mse_loss(self.net(x.bfloat16()).float(), y)
        loss.backward()
        for master, p in zip(self.masters, params):
            assert p.grad is not None
            master.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, params):
                p.copy_(tie_away_bf16(master) if p.dtype == torch.bfloat16 else master)
        return loss.detach()


def amp_step(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(net(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return loss.detach()


def masters_of(session: ampinit.AmpSession, net: nn.Module) -> list[torch.Tensor]:
    """The fp32 master of every parameter (the parameter itself where it has none)."""
    return [m if (m := session.master_for(p)) is not None else p.detach() for p in net.parameters()]


def assert_optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    state_a, state_b = a.state_dict()["state"], b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys(), index
        for key, value in state_a[index].items():
            other = state_b[index][key]
            if isinstance(value, torch.Tensor):
                assert same_bits(value.float(), other.float()), (index, key)
            else:
                assert value == other, (index, key)


def remainder_session(
    net: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
) -> tuple[nn.Module, torch.optim.Optimizer, ampinit.AmpSession]:
    net, optimizer = amp.initialize(net, optimizer, opt_level="O5", master_weights="remainder", verbosity=0, **kwargs)
    session = ampinit.session_of(optimizer)
    assert session is not None
    return net, optimizer, session


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_is_bitwise_the_plain_fp32_master_reference(name: str, ties: bool) -> None:
    net, x, y = make_net(0, ties)
    reference = PlainReference(net, OPTIMIZERS[name])
    net, optimizer, session = remainder_session(net, OPTIMIZERS[name](net.parameters()))
    try:
        for step in range(STEPS):
            assert same_bits(amp_step(net, optimizer, x, y), reference.step(x, y)), step
        for got, want in zip(net.parameters(), reference.net.parameters()):
            assert same_bits(got.detach(), want.detach())
        for got, want in zip(masters_of(session, net), reference.masters):
            assert same_bits(got, want.detach())
        assert_optimizer_states_equal(optimizer, reference.optimizer)
    finally:
        session.close()


def test_initial_weights_take_the_tie_rule_and_masters_start_exact() -> None:
    net, _, _ = make_net(1, ties=True)
    originals = [p.detach().clone() for p in net.parameters()]
    net, optimizer, session = remainder_session(net, torch.optim.AdamW(net.parameters()))
    try:
        for p, original in zip(net.parameters(), originals):
            assert same_bits(session.master_for(p) if p.dtype == torch.bfloat16 else p.detach(), original)
            if p.dtype == torch.bfloat16:
                assert same_bits(p.detach(), tie_away_bf16(original))
                # Every weight is an even tie here: torch's round-to-nearest-even would be one ulp lower.
                assert not same_bits(p.detach(), original.to(torch.bfloat16))
    finally:
        session.close()
    for p, original in zip(net.parameters(), originals):
        assert same_bits(p.detach(), original)  # close() gives the exact fp32 values back
