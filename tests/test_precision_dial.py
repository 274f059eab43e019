"""The precision dial (``master_weights`` x ``optimizer_state``): training against references written here, stochastic
rounding against a float64 run, skipped steps, bitwise resume, checkpoints across settings, and bad options.

The references re-implement what the spec fixes (the counter-based bits, stochastic rounding, nearest 8-bit code)
in plain torch here, not through ``ampinit._masters.precision``; only the 8-bit map's 256 values are taken from it
(that table is tested where it is built).
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters.dial_grads import decode_moment
from ampinit._masters.precision import dynamic_map
from ampinit.optimizers import FusedAdam, FusedSGD
from tests.test_remainder_masters import tie_away_bf16

MASK = 0xFFFFFFFF


# -- the spec's arithmetic, written again ---------------------------------------------------------------------
def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return ((x * (c & 0xFFFF)) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ (x >> 16)) & MASK
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def bits_for(seed: int, step: int, stream: int, numel: int) -> torch.Tensor:
    key = mix32(mix32(mix32(torch.tensor(stream)) ^ step) ^ (seed & MASK))
    return mix32(key ^ torch.arange(numel))


def sr_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    b = x.float().reshape(-1).view(torch.int32).long()
    return ((b + (bits & 0xFFFF)) >> 16).to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def quantize_nearest(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """``x`` through 8-bit block-wise quantization: the nearest map entry (ties to the lower one), in float64."""
    table = dynamic_map(signed).double()
    flat = x.reshape(-1).float()
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), 256):
        block = flat[start : start + 256]
        absmax = block.abs().max()
        y = (block.double() / absmax.double()).float().double() if absmax > 0 else torch.zeros_like(block.double())
        code = (y[:, None] - table[None, :]).abs().argmin(dim=1)  # argmin takes the first: the lower code
        out[start : start + 256] = table.float()[code] * absmax
    return out.reshape(x.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(view[a.dtype]), b.view(view[b.dtype]))


# -- a small model ----------------------------------------------------------------------------------------------
def make_net(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 40), nn.GELU(), nn.Linear(40, 300), nn.GELU(), nn.Linear(300, 4))
    gen = torch.Generator().manual_seed(seed + 1)
    return net, torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-2),
}


def session(net: nn.Module, opt: torch.optim.Optimizer, masters: Any, state: str, **kw: Any) -> Any:
    net, opt = amp.initialize(
        net, opt, opt_level="O5", master_weights=masters, optimizer_state=state, verbosity=0, **kw
    )
    return net, opt, ampinit.session_of(opt)


def amp_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> None:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(net(x).float(), y) * scale
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def masters_of(sess: Any, net: nn.Module) -> list[torch.Tensor]:
    return [m if (m := sess.master_for(p)) is not None else p.detach().float() for p in net.parameters()]


class MasterReference:
    """fp32 masters stepped by a torch optimizer of their own, and a bf16 copy of the model that holds the masters
    rounded: ties away from zero (as 16-bit remainders round) or to nearest-even (fp32 masters)."""

    def __init__(self, net: nn.Module, make: Callable[[Any], torch.optim.Optimizer], ties_away: bool) -> None:
        self.net = copy.deepcopy(net).bfloat16()
        self.masters = [p.detach().clone().float().requires_grad_() for p in net.parameters()]
        self.opt = make(self.masters)
        self.round: Callable[[torch.Tensor], torch.Tensor] = tie_away_bf16 if ties_away else torch.Tensor.bfloat16
        self.write()

    def write(self) -> None:
        """The masters, rounded, into the bf16 model."""
        with torch.no_grad():
            for master, p in zip(self.masters, self.net.parameters()):
                p.copy_(self.round(master))

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The bf16 model's grads of the mean squared error, widened into the masters' grads."""
        params = list(self.net.parameters())
        for p in params:
            p.grad = None
        nn.functional.mse_loss(self.net(x.bfloat16()).float(), y).backward()
        for master, p in zip(self.masters, params):
            assert p.grad is not None
            master.grad = p.grad.float()


class RoundingReference(MasterReference):
    """:class:`MasterReference` with the same torch optimizer as the dial's; after each step its moments are
    replaced by what the dial stores (SR to bf16 with the spec's bits, or the nearest 8-bit code)."""

    def __init__(
        self, net: nn.Module, make: Callable[[Any], torch.optim.Optimizer], state: str, seed: int, ties_away: bool
    ) -> None:
        super().__init__(net, make, ties_away)
        self.state, self.seed, self.steps = state, seed, 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward(x, y)
        self.opt.step()
        self.steps += 1
        for t, master in enumerate(self.masters):
            entry = self.opt.state[master]
            for key, purpose in (("exp_avg", 1), ("exp_avg_sq", 2), ("momentum_buffer", 1)):
                if key not in entry:
                    continue
                value = entry[key]
                if self.state == "bf16":
                    step = int(entry["step"]) if "step" in entry else self.steps
                    entry[key] = sr_bf16(value, bits_for(self.seed, step, 4 * t + purpose, value.numel())).float()
                else:
                    entry[key] = quantize_nearest(value, signed=key != "exp_avg_sq")
        self.write()


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("masters", [True, "remainder"])
@pytest.mark.parametrize("name", ["AdamW", "AdamW-fused", "SGD"])  # fused: the flag reaches the step on the device
def test_compressed_moments_train_as_a_reference_that_rounds_them(name: str, masters: Any, state: str) -> None:
    net, x, y = make_net(0)
    reference = RoundingReference(
        net, OPTIMIZERS[name], state, seed=torch.initial_seed() & MASK, ties_away=masters == "remainder"
    )
    net, opt, sess = session(net, OPTIMIZERS[name](net.parameters()), masters, state)
    try:
        for _ in range(3):
            amp_step(net, opt, x, y)
            reference.step(x, y)
        for got, want in zip(masters_of(sess, net), reference.masters):
            # remainder masters round the weight ties-away and are exact; fp32 masters are the masters.
            assert same_bits(got, want.detach())
        stored = [opt.state[p] for g in opt.param_groups for p in g["params"]]
        for entry, master in zip(stored, reference.masters):
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in entry:
                    dtype = {"bf16": torch.bfloat16, "8bit": torch.uint8}[state]
                    assert entry[key].dtype == dtype and entry[key].shape == master.shape
                    assert (key + "_absmax" in entry) == (state == "8bit")
    finally:
        sess.close()


@pytest.mark.parametrize(
    ("masters", "grad", "ulp"),
    [("stochastic", 2.0**-12, 2.0**-7), ("remainder8", 2.0**-19, 2.0**-15)],
)
def test_stochastic_rounding_is_unbiased_where_nearest_rounding_is_stuck(masters: str, grad: float, ulp: float) -> None:
    """Updates of 1/32 of the stored precision's ulp at 1.0: round-to-nearest never moves, SR follows float64."""
    steps, numel = 128, 4096
    weight = nn.Parameter(torch.ones(numel))
    model = nn.Module()
    model.weight = weight
    expected = 1.0 - steps * grad  # the float64 run of plain SGD with lr 1
    results = {}
    for setting in (masters, False):
        torch.manual_seed(3)
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        m, opt = amp.initialize(m, opt, opt_level="O5", master_weights=setting, verbosity=0)
        try:
            for _ in range(steps):
                opt.zero_grad()
                with amp.scale_loss((m.weight.float() * grad).sum(), opt) as scaled:
                    scaled.backward()
                opt.step()
            sess = ampinit.session_of(opt)
            results[setting] = sess.master_for(m.weight) if setting else m.weight.detach().float()
        finally:
            ampinit.deinitialize()
    assert bool((results[False] == 1.0).all())  # bf16 without SR: stuck, the failure the dial prevents
    got = results[masters].double()
    # Each step moves an element by one of its two neighbours, unbiased: per element the variance is at most
    # ulp**2 / 4 per step, so the mean over numel elements has std <= ulp * sqrt(steps) / 2 / sqrt(numel).
    std = ulp * steps**0.5 / 2 / numel**0.5
    assert abs(got.mean().item() - expected) < 6 * std
    assert got.std().item() < ulp * steps**0.5  # and the spread stays SR's


SETTINGS = [(m, s) for m in (True, "remainder", "remainder8", "stochastic") for s in ("fp32", "bf16", "8bit")]


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync_free"])
@pytest.mark.parametrize(("masters", "state"), [s for s in SETTINGS if s != (True, "fp32")], ids=str)
def test_an_overflowing_step_changes_nothing(masters: Any, state: str, sync_free: bool) -> None:
    net, x, y = make_net(1)
    net, opt, sess = session(net, OPTIMIZERS["AdamW-fused"](net.parameters()), masters, state, sync_free=sync_free)
    try:
        amp_step(net, opt, x, y)
        weights = [p.detach().clone() for p in net.parameters()]
        masters_before = [m.clone() for m in masters_of(sess, net)]
        saved = copy.deepcopy(opt.state_dict())
        amp_step(net, opt, x, y, scale=float("inf"))
        assert amp.step_was_skipped(opt)
        for p, w, m, now in zip(net.parameters(), weights, masters_before, masters_of(sess, net)):
            assert same_bits(p.detach(), w) and same_bits(now, m)
        after = opt.state_dict()["state"]
        for index, entry in saved["state"].items():
            assert entry.keys() == after[index].keys()
            for key, value in entry.items():
                assert torch.equal(after[index][key], value), (index, key)
    finally:
        sess.close()


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("masters", [True, "remainder", "stochastic"])
def test_a_skipped_first_step_stores_zero_moments_in_the_dials_format(masters: Any, state: str) -> None:
    """The first step creates the moments; skipped, it leaves none (fp32 masters: the step is not taken) or zeros
    stored as the setting stores them (not the fp32 zeros the update started from); the next step trains."""
    net, x, y = make_net(2)
    net, opt, sess = session(net, OPTIMIZERS["AdamW-fused"](net.parameters()), masters, state)
    dtype = {"bf16": torch.bfloat16, "8bit": torch.uint8}[state]
    try:
        amp_step(net, opt, x, y, scale=float("inf"))
        assert amp.step_was_skipped(opt)
        for entry in (opt.state[p] for g in opt.param_groups for p in g["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert key not in entry or entry[key].dtype == dtype
                assert (key + "_absmax" in entry) == (state == "8bit" and key in entry)
        for moments in decoded_moments(opt):
            assert all(not value.any() for value in moments.values())
        amp_step(net, opt, x, y)
        for entry in (opt.state[p] for g in opt.param_groups for p in g["params"]):
            assert entry["exp_avg"].dtype == dtype and entry["exp_avg_sq"].dtype == dtype
        assert any(value.any() for moments in decoded_moments(opt) for value in moments.values())
    finally:
        sess.close()


def checkpoint(net: nn.Module, opt: torch.optim.Optimizer, sess: Any) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "amp": sess.state_dict()}, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def restore(net: nn.Module, opt: torch.optim.Optimizer, sess: Any, ckpt: dict[str, Any]) -> None:
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sess.load_state_dict(ckpt["amp"])


@pytest.mark.parametrize(
    ("masters", "state", "name"),
    [("stochastic", "8bit", "AdamW"), ("remainder8", "bf16", "SGD"), (True, "bf16", "FusedAdam")],
)
def test_resume_is_bitwise(masters: Any, state: str, name: str) -> None:
    net, x, y = make_net(2)
    start = copy.deepcopy(net)
    torch.manual_seed(11)
    net, opt, sess = session(net, OPTIMIZERS[name](net.parameters()), masters, state)
    try:
        for _ in range(2):
            amp_step(net, opt, x, y)
        ckpt = checkpoint(net, opt, sess)
        for _ in range(2):
            amp_step(net, opt, x, y)
        final = [m.clone() for m in masters_of(sess, net)]
        final_state = opt.state_dict()["state"]
    finally:
        sess.close()
    torch.manual_seed(12)  # another session seed: the checkpoint must bring the first one back
    fresh = start
    fresh, fresh_opt, fresh_sess = session(fresh, OPTIMIZERS[name](fresh.parameters()), masters, state)
    try:
        restore(fresh, fresh_opt, fresh_sess, ckpt)
        for _ in range(2):
            amp_step(fresh, fresh_opt, x, y)
        for got, want in zip(masters_of(fresh_sess, fresh), final):
            assert same_bits(got, want)
        for index, entry in fresh_opt.state_dict()["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, final_state[index][key]), (index, key)
    finally:
        fresh_sess.close()


FUSED_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-2),
    "FusedSGD": lambda p: FusedSGD(p, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(FUSED_OPTIMIZERS))
@pytest.mark.parametrize(("masters", "state"), [(True, "bf16"), ("remainder", "8bit"), ("stochastic", "bf16")], ids=str)
def test_ampinit_optimizers_hold_loaded_moments_in_the_dials_format(masters: Any, state: str, name: str) -> None:
    # FusedOptimizer.load_state_dict widens loaded state to fp32 after torch's load, whose post hooks (the dial's
    # re-encoding among them) had already run: the state stayed fp32 until the next step, and a state_dict taken
    # then saved fp32 moments, unlike torch's AdamW/SGD in the same session.
    net, x, y = make_small_net(6)
    net, opt, sess = session(net, FUSED_OPTIMIZERS[name](net.parameters()), masters, state)
    try:
        amp_step(net, opt, x, y)
        saved = checkpoint(net, opt, sess)
        stored = copy.deepcopy(opt.state_dict()["state"])
        finer = copy.deepcopy(saved["optimizer"])
        for entry in finer["state"].values():  # the same moments in fp32, another setting's checkpoint
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                value = decode_moment(key, entry)
                if value is not None:
                    entry.pop(key + "_absmax", None)
                    entry[key] = value * (1 + 2.0**-12)
        for ckpt, same in ((saved["optimizer"], True), (finer, False)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.load_state_dict(ckpt)
            now = opt.state_dict()["state"]
            for index, entry in stored.items():
                for key, value in entry.items():
                    assert now[index][key].dtype == value.dtype, (index, key)
                    if same:
                        assert torch.equal(now[index][key], value), (index, key)
        amp_step(net, opt, x, y)
    finally:
        sess.close()


def decoded_moments(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    from ampinit._masters.dial_grads import decode_moment

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            entry = opt.state[p]
            out.append({k: v for k in ("exp_avg", "exp_avg_sq") if (v := decode_moment(k, entry)) is not None})
    return out


def make_small_net(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Two 8-bit blocks and a partial one in the second weight (640 elements), small enough for 144 loads."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 40))
    gen = torch.Generator().manual_seed(seed + 1)
    return net, torch.randn(8, 8, generator=gen), torch.randn(8, 40, generator=gen)


@pytest.mark.parametrize(("source_masters", "source_state"), SETTINGS, ids=str)
def test_every_setting_loads_into_every_other(source_masters: Any, source_state: str) -> None:
    net, x, y = make_small_net(3)
    net, opt, sess = session(net, torch.optim.AdamW(net.parameters(), lr=1e-2), source_masters, source_state)
    try:
        amp_step(net, opt, x, y)
        ckpt = checkpoint(net, opt, sess)
        source = masters_of(sess, net)
        moments = decoded_moments(opt)
    finally:
        sess.close()
    for masters, state in SETTINGS:
        target, _, _ = make_small_net(4)
        target, target_opt, target_sess = session(target, torch.optim.AdamW(target.parameters()), masters, state)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                restore(target, target_opt, target_sess, ckpt)
            rounded = {str(w.message).split(" rounded")[0] for w in caught}
            assert all(issubclass(w.category, UserWarning) for w in caught)
            loaded = masters_of(target_sess, target)
            if masters in (True, "remainder"):  # exact masters: the source's, bit for bit
                assert all(same_bits(a, b) for a, b in zip(loaded, source))
            else:
                # within the target's precision of the source's masters, and said so when rounded
                ulp = 2.0**-15 if masters == "remainder8" else 2.0**-7
                assert all(torch.allclose(a, b, rtol=ulp, atol=0) for a, b in zip(loaded, source))
                if source_masters in (True, "remainder") or (source_masters, masters) == ("remainder8", "stochastic"):
                    assert f"master_weights={masters!r}" in rounded
            got = decoded_moments(target_opt)
            finer = {"fp32": 2, "bf16": 1, "8bit": 0}
            for a, b in zip(got, moments):
                for key in b:
                    if state == "fp32" or state == source_state:
                        assert torch.equal(a[key], b[key]), (masters, state, key)
            if finer[source_state] > finer[state]:
                assert f"optimizer_state={state!r}" in rounded
            if state == source_state or state == "fp32":
                assert not any(r.startswith("optimizer_state") for r in rounded)
            amp_step(target, target_opt, x, y)  # and it trains on
        finally:
            target_sess.close()


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_plain_torch_adamw_state_loads_into_the_dial(state: str) -> None:
    net, x, y = make_net(5)
    plain = copy.deepcopy(net)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for _ in range(2):
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    net, opt, sess = session(net, torch.optim.AdamW(net.parameters(), lr=1e-2), "remainder", state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if state != "fp32" else "error")
            net.load_state_dict(plain.state_dict())
            opt.load_state_dict(plain_opt.state_dict())
        for got, want in zip(masters_of(sess, net), plain.parameters()):
            assert same_bits(got, want.detach())
        for got, p in zip(decoded_moments(opt), plain.parameters()):
            want = plain_opt.state[p]["exp_avg"]
            if state == "fp32":
                assert torch.equal(got["exp_avg"], want)
            else:
                assert torch.allclose(got["exp_avg"], want, rtol=0.1, atol=want.abs().max().item() * 0.01)
        amp_step(net, opt, x, y)
    finally:
        sess.close()


def clip_sgd(params: Any) -> torch.optim.Optimizer:
    # A large lr: the clipped and unclipped runs must lie further apart than bf16 stochastic rounding's noise.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


class ClipReference(MasterReference):
    """:class:`MasterReference` with torch SGD, the widened grads clipped in fp32 to ``max_norm`` with
    ``clip_grad_norm_`` before each step."""

    def __init__(self, net: nn.Module, max_norm: float, ties_away: bool) -> None:
        super().__init__(net, clip_sgd, ties_away)
        self.max_norm = max_norm

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward(x, y)
        nn.utils.clip_grad_norm_(self.masters, self.max_norm)
        self.opt.step()
        self.write()


@pytest.mark.parametrize("masters", ["remainder", "remainder8", "stochastic"])
def test_clipping_master_params_clips_the_fp32_grads_the_step_applies(masters: str) -> None:
    max_norm, steps = 0.05, 3
    net, x, y = make_net(9)
    clipped = ClipReference(net, max_norm, ties_away=masters == "remainder")
    unclipped = ClipReference(net, float("inf"), ties_away=masters == "remainder")
    net, opt, sess = session(net, clip_sgd(net.parameters()), masters, "fp32")
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(net(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            params = list(amp.master_params(opt))
            assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == p.dtype for p in params)
            norm = nn.utils.clip_grad_norm_(params, max_norm)
            assert norm > 4 * max_norm  # the clipping bites
            opt.step()
            clipped.step(x, y)
            unclipped.step(x, y)
        got = masters_of(sess, net)
    finally:
        sess.close()
    if masters == "remainder":  # exact masters: the reference's, bit for bit
        assert all(same_bits(a, b.detach()) for a, b in zip(got, clipped.masters))
        return
    # Lossy masters: each step rounds every master stochastically to its neighbours one ulp apart (ulp at 24 or
    # 8 significant bits), an unbiased error of variance <= ulp**2 / 4, so after the steps the distance to the
    # fp32 run is about sqrt(steps * sum(ulp**2) / 4); four times that bounds it (the bf16 forward adds less, the
    # grads being clipped to a fixed norm), and the unclipped run lies beyond.
    flat = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in (got, clipped.masters, unclipped.masters)]
    ulp = torch.ldexp(torch.ones_like(flat[1]), torch.frexp(flat[1]).exponent - (16 if masters == "remainder8" else 8))
    bound = 4 * (steps * ulp.square().sum() / 4).sqrt()
    assert (flat[0] - flat[1]).norm() < bound < (flat[0] - flat[2]).norm()


@pytest.mark.parametrize(
    ("masters", "state", "name"),
    [("stochastic", "bf16", "AdamW"), ("remainder8", "8bit", "SGD"), ("remainder", "bf16", "SGD")],
)
def test_delay_unscale_accumulates_as_two_unscaled_backwards(masters: Any, state: str, name: str) -> None:
    """Two backward passes per step, the first with ``delay_unscale=True``, against the same two without: the
    masters live in the bf16 weights, whose bf16 grads accumulate both ways, and the scale is a power of two, so
    the grads (and the steps) agree bit for bit. (fp32 masters accumulate a delayed backward in the bf16 model
    grads, as Apex does, and an unscaled one in the fp32 master grads: no bitwise reference there.)"""
    results = []
    for delay in (True, False):
        net, x, y = make_net(10)
        torch.manual_seed(13)
        net, opt, sess = session(net, OPTIMIZERS[name](net.parameters()), masters, state, loss_scale=1024.0)
        try:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                for half, delay_unscale in ((slice(0, 16), delay), (slice(16, 32), False)):
                    loss = nn.functional.mse_loss(net(x[half]).float(), y[half])
                    with amp.scale_loss(loss, opt, delay_unscale=delay_unscale) as scaled:
                        scaled.backward()
                opt.step()
            results.append((masters_of(sess, net), copy.deepcopy(opt.state_dict()["state"])))
        finally:
            sess.close()
    (masters_delayed, state_delayed), (masters_plain, state_plain) = results
    assert all(same_bits(a, b) for a, b in zip(masters_delayed, masters_plain))
    for index, entry in state_plain.items():
        for key, value in entry.items():
            assert torch.equal(state_delayed[index][key], value), (index, key)


ALLOWED = "optimizer_state must be one of ['fp32', 'bf16', '8bit']"


# -- options ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"master_weights": "remainder_8"}, ValueError, "master_weights='remainder_8'. Did you mean 'remainder8'?"),
        ({"master_weights": "stochastc"}, ValueError, "Did you mean 'stochastic'?"),
        ({"optimizer_state": "8-bit"}, ValueError, f"{ALLOWED}, got '8-bit'. Did you mean '8bit'?"),
        ({"optimizer_state": "int4"}, ValueError, f"{ALLOWED}, got 'int4'"),
        ({"optimizer_state": "bf16", "master_weights": False}, ValueError, "optimizer_state='bf16' needs master"),
        ({"opt_level": "O2", "master_weights": "remainder8"}, ValueError, "master_weights='remainder8' needs a bf"),
        ({"opt_level": "O2", "master_weights": "stochastic"}, ValueError, "master_weights='stochastic' needs a bf"),
    ],
)
def test_bad_options_are_named_with_what_is_allowed(kwargs: dict[str, Any], error: type, message: str) -> None:
    net, _, _ = make_net(6)
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(error, match=re.escape(message)):
        amp.initialize(net, opt, **{"opt_level": "O5", "verbosity": 0, **kwargs})
    assert ampinit.current_session() is None and all(p.dtype == torch.float32 for p in net.parameters())


def test_unsupported_optimizers_are_refused_for_compressed_state() -> None:
    net, _, _ = make_net(7)
    with pytest.raises(ValueError, match=re.escape("master_weights=True, optimizer_state='8bit' does not support")):
        amp.initialize(net, torch.optim.RMSprop(net.parameters()), opt_level="O2", optimizer_state="8bit")
    assert ampinit.current_session() is None


def test_o2_fp32_masters_take_compressed_state_and_the_apex_api_takes_the_keywords() -> None:
    from ampinit.compat.apex import amp as apex_amp

    net, x, y = make_net(8)
    net, opt = apex_amp.initialize(
        net,
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        opt_level="O2",
        optimizer_state="bf16",
        verbosity=0,
    )
    try:
        amp_step(net, opt, x, y)
        assert all(s["momentum_buffer"].dtype == torch.bfloat16 for s in opt.state.values())
    finally:
        ampinit.deinitialize()
