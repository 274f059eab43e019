"""``master_weights="remainder"``: the encoding, training against a plain fp32-master re-implementation, checkpoints
in both directions, skipped steps, memory, errors, and the Triton remainder kernels against the reference.

The reference rounding used here, :func:`tie_away_bf16`, is written from values (the two bf16 neighbours of a
master, compared in float64), not from the bit arithmetic of ``ampinit._masters.remainder``.
"""

from __future__ import annotations

import copy
import gc
import io
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import reference as step_reference
from ampinit._masters import remainder as encoding
from ampinit.optimizers import FusedAdam, FusedSGD
from tests._kernels_vs_reference import SIZES, call, count_launches, run_both, same_bits

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


def all_low_halves(high: int) -> torch.Tensor:
    return fp32_from_bits(high * 65536 + torch.arange(65536, dtype=torch.int64))


# -- (a) the encoding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("high", HIGH_HALVES, ids=lambda h: f"{h:#06x}")
def test_split_join_round_trips_every_low_half(high: int) -> None:
    masters = all_low_halves(high)
    weight, remainder = encoding.split(masters)
    joined = encoding.join(weight, remainder)
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
    weight, _ = encoding.split(masters)
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
    weight, remainder = encoding.split(values)
    assert same_bits(encoding.join(weight, remainder), values)
    assert torch.equal(weight.float()[:4], values[:4]) and str(weight[1].item()) == "-0.0"
    assert weight[4].item() == float("inf")  # the largest fp32 rounds up to inf, as torch's cast does


def test_join_refuses_wrong_dtypes() -> None:
    with pytest.raises(ValueError, match=re.escape("join needs a bfloat16 weight and an int16 remainder")):
        encoding.join(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match=re.escape("remainder masters split fp32 tensors, got torch.float64")):
        encoding.split(torch.zeros(3, dtype=torch.float64))


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
                for param in module._parameters.values():
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
    net, _, session = remainder_session(net, torch.optim.AdamW(net.parameters()))
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


# -- (c) checkpoints ----------------------------------------------------------------------------------------------
def checkpoint(net: nn.Module, optimizer: torch.optim.Optimizer, session: ampinit.AmpSession) -> dict[str, Any]:
    """Saved and read back through torch.save, as a training script would."""
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "amp": session.state_dict()}, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def restore(
    net: nn.Module, optimizer: torch.optim.Optimizer, session: ampinit.AmpSession, ckpt: dict[str, Any]
) -> None:
    net.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    session.load_state_dict(ckpt["amp"])


def test_remainder_checkpoint_loads_into_fp32_masters_and_back_exactly() -> None:
    net, x, y = make_net(2, ties=False)
    net, optimizer, session = remainder_session(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    fp32_net = make_net(3, ties=False)[0]
    fp32_net, fp32_optimizer = amp.initialize(
        fp32_net, torch.optim.AdamW(fp32_net.parameters(), lr=1e-2), opt_level="O5", verbosity=0
    )
    fp32_session = ampinit.session_of(fp32_optimizer)
    assert fp32_session is not None
    try:
        for _ in range(3):
            amp_step(net, optimizer, x, y)
        ckpt = checkpoint(net, optimizer, session)
        assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
        assert not any("remainder" in key for state in ckpt["optimizer"]["state"].values() for key in state)

        # remainder -> fp32 masters: the masters and the moments arrive bit for bit.
        restore(fp32_net, fp32_optimizer, fp32_session, ckpt)
        for got, want in zip(masters_of(fp32_session, fp32_net), masters_of(session, net)):
            assert same_bits(got, want)
        assert_optimizer_states_equal(fp32_optimizer, optimizer)

        # fp32 masters train on, then -> remainder: masters exact, weights by the tie rule, moments still fp32.
        for _ in range(2):
            amp_step(fp32_net, fp32_optimizer, x, y)
        restore(net, optimizer, session, checkpoint(fp32_net, fp32_optimizer, fp32_session))
        for got, want in zip(masters_of(session, net), masters_of(fp32_session, fp32_net)):
            assert same_bits(got, want)
        for p, master in zip(net.parameters(), masters_of(session, net)):
            if p.dtype == torch.bfloat16:
                assert same_bits(p.detach(), tie_away_bf16(master))
        for state in optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
        assert_optimizer_states_equal(optimizer, fp32_optimizer)
    finally:
        fp32_session.close()
        session.close()


@pytest.mark.parametrize("name", ["AdamW-fused", "SGD-nesterov", "FusedAdam"])
def test_resuming_a_remainder_run_is_bitwise(name: str) -> None:
    net, x, y = make_net(4, ties=False)
    resumed_net = copy.deepcopy(net)
    net, optimizer, session = remainder_session(net, OPTIMIZERS[name](net.parameters()))
    try:
        for _ in range(2):
            amp_step(net, optimizer, x, y)
        ckpt = checkpoint(net, optimizer, session)
        for _ in range(2):
            amp_step(net, optimizer, x, y)
    finally:
        session.close()
    fresh = make_net(5, ties=False)[0]  # other initial weights: everything must come from the checkpoint
    fresh.load_state_dict(resumed_net.state_dict())
    fresh, fresh_optimizer, fresh_session = remainder_session(fresh, OPTIMIZERS[name](fresh.parameters()))
    try:
        restore(fresh, fresh_optimizer, fresh_session, ckpt)
        for _ in range(2):
            amp_step(fresh, fresh_optimizer, x, y)
        assert_optimizer_states_equal(fresh_optimizer, optimizer)
    finally:
        fresh_session.close()
    for got, want in zip(fresh.parameters(), net.parameters()):
        assert same_bits(got.detach(), want.detach())  # closed sessions: both hold the fp32 masters


# -- (d) skipped steps --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync_free"])
def test_an_overflowing_step_leaves_weight_remainder_and_state_unchanged(sync_free: bool) -> None:
    net, x, y = make_net(6, ties=False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    net, optimizer, session = remainder_session(net, optimizer, sync_free=sync_free)
    try:
        for _ in range(2):
            amp_step(net, optimizer, x, y)
        weights = [p.detach().clone() for p in net.parameters()]
        masters = [m.clone() for m in masters_of(session, net)]
        state = copy.deepcopy(optimizer.state_dict())
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y) * float("inf")
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        assert amp.step_was_skipped(optimizer)
        for p, weight, master, now in zip(net.parameters(), weights, masters, masters_of(session, net)):
            assert same_bits(p.detach(), weight)
            assert same_bits(now, master)  # same weight and same master: the same remainder
        after = optimizer.state_dict()
        for index, entry in state["state"].items():
            for key, value in entry.items():
                assert same_bits(after["state"][index][key].float(), value.float()), (index, key)
    finally:
        session.close()


# -- (e) memory ---------------------------------------------------------------------------------------------------
def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    # type(), not isinstance: some module objects warn when their __class__ is read.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def stray_fp32_copies(
    net: nn.Module, optimizer: torch.optim.Optimizer, earlier: list[torch.Tensor]
) -> list[tuple[int, ...]]:
    """Shapes of fp32 tensors shaped like a bf16 weight, created since ``earlier`` (the tensors alive then:
    other tests may leave some behind), that are neither the model's nor optimizer state."""
    old = {id(t) for t in earlier}
    shapes = {tuple(p.shape) for p in net.parameters() if p.dtype == torch.bfloat16}
    known = {t.data_ptr() for t in (*net.parameters(), *net.buffers())}
    known |= {p.grad.data_ptr() for p in net.parameters() if p.grad is not None}
    known |= {t.data_ptr() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    return [
        tuple(obj.shape)
        for obj in live_tensors()
        if id(obj) not in old
        and obj.dtype == torch.float32
        and tuple(obj.shape) in shapes
        and obj.data_ptr() not in known
    ]


@pytest.mark.parametrize("master_weights", ["remainder", True])
def test_remainder_runs_hold_no_fp32_masters(master_weights: str | bool) -> None:
    earlier = live_tensors()  # held, so that no new tensor can take one of their ids
    net, x, y = make_net(7, ties=False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, optimizer = amp.initialize(net, optimizer, opt_level="O5", master_weights=master_weights, verbosity=0)
    try:
        for _ in range(2):
            amp_step(net, optimizer, x, y)
        strays = stray_fp32_copies(net, optimizer, earlier)
        if master_weights == "remainder":
            assert strays == []
            assert [p for g in optimizer.param_groups for p in g["params"]] == list(net.parameters())
            assert all(p.grad is None or p.grad.dtype == p.dtype for p in net.parameters())
        else:
            assert strays  # fp32 masters (and their grads): what the remainder run does without
    finally:
        ampinit.deinitialize()


# -- errors -------------------------------------------------------------------------------------------------------
def test_fp16_models_are_refused_with_the_reason() -> None:
    net, _, _ = make_net(8, ties=False)
    optimizer = torch.optim.AdamW(net.parameters())
    message = "master_weights='remainder' needs a bfloat16 model (opt_level='O5', or cast_model_type=torch.bfloat16)"
    with pytest.raises(ValueError, match=re.escape(message) + ".*fp16 weight has other exponent and mantissa"):
        amp.initialize(net, optimizer, opt_level="O2", master_weights="remainder")
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert ampinit.current_session() is None


def test_o2_with_a_bf16_model_takes_remainder_masters() -> None:
    net, x, y = make_net(9, ties=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, optimizer = amp.initialize(
        net, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, master_weights="remainder", verbosity=0
    )
    try:
        amp_step(net, optimizer, x, y)
        assert net.fc1.weight.dtype == torch.bfloat16 and not amp.step_was_skipped()
    finally:
        ampinit.deinitialize()


def test_unsupported_optimizers_are_named_and_nothing_is_applied() -> None:
    net, _, _ = make_net(10, ties=False)
    optimizer = torch.optim.RMSprop(net.parameters())
    params = list(optimizer.param_groups[0]["params"])
    with pytest.raises(
        ValueError,
        match=re.escape("master_weights='remainder' does not support the optimizer torch.optim.rmsprop.RMSprop")
        + ".*torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, ampinit.optimizers.FusedAdam",
    ):
        amp.initialize(net, optimizer, opt_level="O5", master_weights="remainder")
    assert optimizer.param_groups[0]["params"] == params
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert "step" not in vars(optimizer)


def test_fused_adam_with_its_own_masters_is_refused() -> None:
    net, _, _ = make_net(11, ties=False)
    optimizer = FusedAdam(net.parameters(), capturable=True, master_weights=True)
    with pytest.raises(ValueError, match=re.escape("cannot be combined with FusedAdam(master_weights=True)")):
        amp.initialize(net, optimizer, opt_level="O5", master_weights="remainder")


@pytest.mark.parametrize(
    "options",
    [{"master_weights": "remainder"}, {"master_weights": "stochastic"}, {"optimizer_state": "8bit"}],
    ids=["remainder", "stochastic", "8bit"],
)
def test_fused_adam_clipping_per_group_is_refused_not_dropped(options: dict[str, Any]) -> None:
    """``FusedAdam(max_grad_norm=...)`` clips a group by its whole gradient norm inside ``step()``; amp's master
    step runs the update chunk by chunk and used to drop the clipping without a word. Refused before anything
    changes, naming the argument and what to do instead."""
    net, _, _ = make_net(11, ties=False)
    with pytest.warns(FutureWarning, match="pre-2019-08 argument"):
        optimizer = FusedAdam(net.parameters(), lr=1e-3, max_grad_norm=1.0)
    params = list(optimizer.param_groups[0]["params"])
    with pytest.raises(ValueError, match=re.escape("FusedAdam(max_grad_norm=1.0)") + ".*clip_grad_norm_"):
        amp.initialize(net, optimizer, opt_level="O5", **options)
    assert optimizer.param_groups[0]["params"] == params
    assert all(p.dtype == torch.float32 for p in net.parameters())


class PlainMomentum(torch.optim.Optimizer):
    """SGD with momentum, written here: its own ``step``, and the same update offered to amp through the
    master-update protocol (``ampinit._masters.update.MasterUpdate``) that FusedAdam and FusedSGD implement."""

    def __init__(self, params: Any, lr: float, momentum: float, refuse: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.refuse = refuse

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], targets: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> None:
        for param, target, grad in zip(params, targets, grads):
            buffer = self.state[param].get("momentum_buffer")
            buffer = grad.clone() if buffer is None else buffer.mul_(group["momentum"]).add_(grad)
            self.state[param]["momentum_buffer"] = buffer
            target.add_(buffer, alpha=-group["lr"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            self._update(group, params, params, [p.grad for p in params])  # type: ignore[misc]

    def check_master_update(self) -> None:
        if self.refuse:
            raise ValueError("PlainMomentum(refuse=True) takes no master update")

    def update_masters(self, group: dict[str, Any], chunks: Any, found_inf: torch.Tensor | None) -> None:
        if found_inf is not None and found_inf.item() != 0:
            return
        for params, masters, grads in chunks:
            self._update(group, params, masters, grads)


def test_an_optimizer_that_declares_its_master_update_trains_on_remainder_masters() -> None:
    """amp asks for the capability, not for a class: an optimizer it has never heard of takes part, bitwise
    the same optimizer stepping plain fp32 masters."""
    net, x, y = make_net(17, ties=False)
    reference = PlainReference(net, lambda ps: PlainMomentum(ps, lr=0.05, momentum=0.9))
    net, optimizer, session = remainder_session(net, PlainMomentum(net.parameters(), lr=0.05, momentum=0.9))
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


def test_an_optimizer_refusing_its_master_update_is_refused_with_its_reason() -> None:
    net, _, _ = make_net(18, ties=False)
    optimizer = PlainMomentum(net.parameters(), lr=0.05, momentum=0.9, refuse=True)
    with pytest.raises(ValueError, match=re.escape("PlainMomentum(refuse=True) takes no master update")):
        amp.initialize(net, optimizer, opt_level="O5", master_weights="remainder")
    assert all(p.dtype == torch.float32 for p in net.parameters())


class MomentumSubclass(PlainMomentum):
    pass


class FusedAdamSubclass(FusedAdam):
    pass


class FusedSGDSubclass(FusedSGD):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: MomentumSubclass(ps, lr=0.05, momentum=0.9),
        lambda ps: FusedAdamSubclass(ps),
        lambda ps: FusedSGDSubclass(ps, lr=0.1),
    ],
    ids=["plain", "fused_adam", "fused_sgd"],
)
def test_subclasses_of_an_optimizer_with_a_master_update_are_refused(make: Callable[..., Any]) -> None:
    """A subclass inherits the update but may have changed ``step()``, which amp's remainder step never calls."""
    net, _, _ = make_net(19, ties=False)
    optimizer = make(net.parameters())
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    with pytest.raises(ValueError, match=re.escape(f"does not support the optimizer {name}") + ".*subclasses excluded"):
        amp.initialize(net, optimizer, opt_level="O5", master_weights="remainder")
    assert all(p.dtype == torch.float32 for p in net.parameters())


@pytest.mark.parametrize("value", ["Remainder", "fp32", 1])
def test_bad_master_weights_values_are_named(value: object) -> None:
    net, _, _ = make_net(12, ties=False)
    with pytest.raises(
        ValueError,
        match=re.escape("master_weights must be True, False, 'remainder', 'remainder8', 'stochastic' or None"),
    ):
        amp.initialize(net, torch.optim.AdamW(net.parameters()), opt_level="O5", master_weights=value)  # type: ignore[arg-type]


def test_closures_are_refused() -> None:
    net, _, _ = make_net(13, ties=False)
    net, optimizer, session = remainder_session(net, torch.optim.AdamW(net.parameters()))
    try:
        with pytest.raises(RuntimeError, match=re.escape("Currently, Amp does not support closure use")):
            optimizer.step(lambda: 0.0)
    finally:
        session.close()


# -- the Triton remainder kernels, on CPU through Triton's interpreter ------------------------------------------
@pytest.fixture(scope="module")
def kernels(triton_interpreter: ModuleType) -> ModuleType:
    """The shared interpreted kernels (tests/conftest.py), under the name these tests compare with the reference."""
    return triton_interpreter


def remainder_state(seed: int, grad_dtype: torch.dtype, scale: float) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    pairs = [encoding.split(torch.randn(n, generator=gen)) for n in SIZES]
    return {
        "weights": [w for w, _ in pairs],
        "remainders": [r for _, r in pairs],
        "grads": [(torch.randn(n, generator=gen) * scale).to(grad_dtype) for n in SIZES],
        "m": [torch.randn(n, generator=gen) * 0.1 for n in SIZES],
        "v": [torch.rand(n, generator=gen) * 0.01 for n in SIZES],
    }


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("weight_decay", "decoupled"), [(0.0, True), (0.05, True), (0.05, False)])
@pytest.mark.parametrize("maximize", [False, True])
def test_adam_remainder_kernel_matches_the_reference(
    kernels: ModuleType, grad_dtype: torch.dtype, weight_decay: float, decoupled: bool, maximize: bool
) -> None:
    state = remainder_state(0, grad_dtype, 256.0)
    steps = [torch.tensor(float(i % 3)) for i in range(len(SIZES))]
    for _ in range(3):
        for s in steps:
            s += 1
        run_both(
            kernels,
            "adam_",
            state,
            step_reference.adam_step_scalars(steps, 0.9, 0.999, 1e-3),
            step_reference.AdamSettings(
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=weight_decay,
                decoupled=decoupled,
                maximize=maximize,
            ),
            inv_scale=torch.full((1,), 1 / 256.0),
            found_inf=torch.zeros(1),
        )


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "weight_decay"),
    [(0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.0), (0.9, 0.1, False, 1e-4), (0.9, 0.0, True, 1e-4)],
)
def test_sgd_remainder_kernel_matches_the_reference(
    kernels: ModuleType, momentum: float, dampening: float, nesterov: bool, weight_decay: float
) -> None:
    state = remainder_state(1, torch.bfloat16, 1.0)
    state.pop("v")
    if momentum == 0:
        state["m"] = []
    for step in range(3):
        run_both(
            kernels,
            "sgd_",
            state,
            step_reference.SgdSettings(
                lr=0.1,
                momentum=momentum,
                dampening=dampening,
                nesterov=nesterov,
                weight_decay=weight_decay,
                maximize=step == 2,
            ),
            first_step=step == 0,
            inv_scale=None,
            found_inf=None,
        )


# Every bit pattern through Triton's interpreter: about two minutes on a busy 2-core machine, over the default
# per-test timeout of scripts/gpu_check.sh.
@pytest.mark.timeout(360)
def test_the_kernels_split_and_join_every_pattern_like_the_reference(kernels: ModuleType) -> None:
    # An SGD step with lr=0 leaves every master as it is (p + -0.0 == p, NaN stays NaN): what remains is the
    # kernel's join and split, over every low half of every upper half in HIGH_HALVES.
    masters = torch.cat([all_low_halves(high) for high in HIGH_HALVES])
    weight, remainder = encoding.split(masters)
    state = {"weights": [weight], "remainders": [remainder], "grads": [torch.zeros_like(weight)], "m": []}
    expected = encoding.join(weight, remainder)
    run_both(
        kernels,
        "sgd_",
        state,
        step_reference.SgdSettings(
            lr=0.0, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False
        ),
        first_step=True,
        inv_scale=None,
        found_inf=None,
    )
    assert same_bits(encoding.join(state["weights"][0], state["remainders"][0]), expected)


def test_a_raised_flag_changes_nothing_in_the_kernels(kernels: ModuleType) -> None:
    state = remainder_state(2, torch.bfloat16, 1.0)
    before = {key: [t.clone() for t in value] for key, value in state.items()}
    call(
        kernels,
        "adam_",
        state,
        step_reference.adam_step_scalars([torch.tensor(1.0)] * len(SIZES), 0.9, 0.999, 1e-3),
        step_reference.AdamSettings(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False
        ),
        inv_scale=None,
        found_inf=torch.ones(1),
    )
    for key in state:
        for got, want in zip(state[key], before[key]):
            assert same_bits(got, want), key


class ReferenceAdamW(torch.optim.Optimizer):
    """AdamW in the fp32-master reference math of the fused path (``ampinit._masters.reference.adam_``), one
    tensor at a time."""

    def __init__(self, params: Any, lr: float, weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                step_reference.adam_(
                    [p.grad],
                    step_reference.Masters.fp32([p]),
                    [state["exp_avg"]],
                    [state["exp_avg_sq"]],
                    step_reference.adam_step_scalars([state["step"]], 0.9, 0.999, group["lr"]),
                    step_reference.AdamSettings(
                        lr=group["lr"],
                        beta1=0.9,
                        beta2=0.999,
                        eps=1e-8,
                        weight_decay=group["weight_decay"],
                        decoupled=True,
                        maximize=False,
                    ),
                    inv_scale=None,
                    found_inf=None,
                )


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_training_through_the_kernels_is_bitwise_the_reference(kernels_on_cpu: ModuleType, ties: bool) -> None:
    net, x, y = make_net(14, ties)
    reference = PlainReference(net, lambda p: ReferenceAdamW(p, lr=1e-2, weight_decay=0.05))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    net, optimizer, session = remainder_session(net, optimizer)
    try:
        for step in range(3):
            assert same_bits(amp_step(net, optimizer, x, y), reference.step(x, y)), step
        for got, want in zip(masters_of(session, net), reference.masters):
            assert same_bits(got, want.detach())
        for got, want in zip(net.parameters(), reference.net.parameters()):
            assert same_bits(got.detach(), want.detach())
    finally:
        session.close()


def test_fused_adam_takes_the_remainder_kernels_bitwise_the_reference(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ampinit's FusedAdam (AdamW mode) on remainder masters steps in the kernels, as torch's AdamW does, with its
    own state layout (the group's step count). It used to take the chunked path whatever the device."""
    calls = count_launches(kernels_on_cpu, monkeypatch)
    net, x, y = make_net(16, ties=False)
    reference = PlainReference(net, lambda p: ReferenceAdamW(p, lr=1e-2, weight_decay=0.05))
    net, optimizer, session = remainder_session(net, FusedAdam(net.parameters(), lr=1e-2, weight_decay=0.05))
    try:
        for step in range(3):
            assert same_bits(amp_step(net, optimizer, x, y), reference.step(x, y)), step
        for got, want in zip(masters_of(session, net), reference.masters):
            assert same_bits(got, want.detach())
        assert calls["adam_"] >= 3
        assert int(optimizer.param_groups[0]["step"]) == 3  # counted once per step, not once per launch
    finally:
        session.close()


def test_fused_sgd_takes_the_remainder_kernels_as_torchs_sgd_does(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FusedSGD with torch's SGD rule (momentum, Nesterov, decay before momentum) on remainder masters: the same
    kernel steps as torch's SGD with the same settings, bit for bit, buffers in torch's layout."""
    calls = count_launches(kernels_on_cpu, monkeypatch)
    runs = []
    for make in (
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ):
        net, x, y = make_net(17, ties=False)
        net, optimizer, session = remainder_session(net, make(net.parameters()))
        try:
            losses = [amp_step(net, optimizer, x, y) for _ in range(3)]
            runs.append((losses, masters_of(session, net), optimizer))
        finally:
            session.close()
        if not runs[1:]:
            assert calls["sgd_"] >= 3, "FusedSGD did not take the kernels"
    (fused_losses, fused_masters, fused_opt), (torch_losses, torch_masters, torch_opt) = runs
    assert all(same_bits(a, b) for a, b in zip(fused_losses, torch_losses))
    assert all(same_bits(a, b) for a, b in zip(fused_masters, torch_masters))
    assert_optimizer_states_equal(fused_opt, torch_opt)


def test_master_params_are_fp32_masters_with_the_unscaled_grads_widened() -> None:
    net, x, y = make_net(15, ties=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    net, optimizer = amp.initialize(
        net, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, master_weights="remainder", verbosity=0
    )
    try:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:  # dynamic scale: 2**16 at first
            scaled.backward()
        session = ampinit.session_of(optimizer)
        params = list(net.parameters())
        masters = list(amp.master_params(optimizer))
        for p, master in zip(params, masters):
            joined = session.master_for(p)  # None: a parameter without remainder (fp32) is its own master
            assert master is p if joined is None else same_bits(master.detach(), joined)
        # The same forward at scale 1, differentiated without touching .grad.
        grads_at_scale_one = torch.autograd.grad(nn.functional.mse_loss(net(x), y), params)
        for master, want in zip(masters, grads_at_scale_one):
            assert master.grad is not None and same_bits(master.grad, want.float())  # unscaled by 2**16, exactly
        assert any(master.dtype != p.dtype for master, p in zip(masters, params))
    finally:
        ampinit.deinitialize()


def test_a_param_group_added_later_gets_remainders() -> None:
    net, x, y = make_net(16, ties=False)
    optimizer = torch.optim.AdamW([net.fc1.weight], lr=1e-2)
    net, optimizer, session = remainder_session(net, optimizer)
    try:
        optimizer.add_param_group({"params": [net.head.weight]})
        before = session.master_for(net.head.weight)
        assert before is not None and same_bits(before, net.head.weight.detach().float())
        amp_step(net, optimizer, x, y)
        after = session.master_for(net.head.weight)
        assert after is not None and not same_bits(after, before)
        assert same_bits(net.head.weight.detach(), tie_away_bf16(after))
    finally:
        session.close()
