"""The precision dial's one-pass step in a session: a group that fits the kernels steps through ``triton_dial``
(Triton's interpreter on CPU here, ``kernels_on_cpu``), bit for bit a plain loop over the reference functions
(``reference.adam_dial_``/``sgd_dial_``) written here with the spec's keys; resume through a checkpoint is bitwise;
and the bytes each setting moves per parameter, read off the launches' lists, are the figures worked out by hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._masters import reference as ref
from ampinit._masters.precision import QuantMap
from ampinit._masters.reference import Masters, Moments
from tests.test_precision_dial import checkpoint, masters_of, mix32, restore, same_bits, session

SEED = 4321
SETTINGS: list[tuple[Any, str]] = [
    ("remainder", "bf16"),
    ("remainder", "8bit"),
    ("remainder8", "fp32"),
    ("remainder8", "bf16"),
    ("remainder8", "8bit"),
    ("stochastic", "fp32"),
    ("stochastic", "bf16"),
    ("stochastic", "8bit"),
    (True, "bf16"),
    (True, "8bit"),
]
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=True),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True),
}
SKIPPED = 1  # the second of three steps overflows


def _fused_adam(params: Any) -> torch.optim.Optimizer:
    """ampinit's FusedAdam: its own master update, so the dial's Adam launch counts the stochastic rounding's step."""
    from ampinit.optimizers import FusedAdam

    return FusedAdam(params, lr=1e-2, weight_decay=0.01)


def make_net() -> tuple[nn.Module, list[torch.Tensor]]:
    """Two layers of 256 and 512 weights (whole 8-bit blocks, so the byte ledger is exact) and three inputs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16, bias=False), nn.GELU(), nn.Linear(16, 32, bias=False))
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 16, generator=gen) for _ in range(3)]
    inputs[SKIPPED][0, 0] = float("inf")  # inf grads: the dynamic loss scale skips the step
    return net, inputs


# -- counting the launches --------------------------------------------------------------------------------------
@dataclass
class Launch:
    name: str
    read: int  # bytes
    written: int
    numel: int


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _master_bytes(masters: Masters) -> tuple[int, int]:
    if masters.kind == "fp32":  # the kernel reads the master, writes it and the model weight
        return _nbytes(masters.masters), _nbytes(masters.masters) + _nbytes(masters.weights)
    stored = _nbytes(masters.weights) + _nbytes(masters.remainders)
    return stored, stored


@pytest.fixture
def launches(kernels_on_cpu: ModuleType) -> Iterator[list[Launch]]:
    """Every ``triton_dial`` launch of the test, with the bytes its lists hold (restored before the interpreted
    modules are built back)."""
    from ampinit._masters import triton_dial

    seen: list[Launch] = []
    adam, sgd = triton_dial.adam_dial_, triton_dial.sgd_dial_

    def adam_dial_(grads: list[torch.Tensor], masters: Masters, m: Moments, v: Moments, *a: Any, **k: Any) -> None:
        read, written = _master_bytes(masters)
        moments = sum(_nbytes(x.values) + _nbytes(x.absmax) for x in (m, v))
        seen.append(Launch("adam", _nbytes(grads) + read + moments, written + moments, sum(g.numel() for g in grads)))
        adam(grads, masters, m, v, *a, **k)

    def sgd_dial_(grads: list[torch.Tensor], masters: Masters, buffers: Moments, *a: Any, **k: Any) -> None:
        read, written = _master_bytes(masters)
        moment = _nbytes(buffers.values) + _nbytes(buffers.absmax)
        # A first step sets the buffer from the grad: it reads none.
        moment_read = 0 if k["first_step"] else moment
        seen.append(Launch("sgd", _nbytes(grads) + read + moment_read, written + moment, sum(g.numel() for g in grads)))
        sgd(grads, masters, buffers, *a, **k)

    triton_dial.adam_dial_, triton_dial.sgd_dial_ = adam_dial_, sgd_dial_  # type: ignore[assignment]
    try:
        yield seen
    finally:
        triton_dial.adam_dial_, triton_dial.sgd_dial_ = adam, sgd  # type: ignore[assignment]


# -- the session ------------------------------------------------------------------------------------------------
def train(masters: Any, state: str, name: str) -> Any:
    """A dial session on a fresh net: (net, opt, session, the three inputs)."""
    net, inputs = make_net()
    torch.manual_seed(SEED)  # the session's stochastic-rounding seed
    make = OPTIMIZERS.get(name) or _fused_adam
    net, opt, sess = session(net, make(net.parameters()), masters, state, loss_scale="dynamic")
    return net, opt, sess, inputs


def amp_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> list[torch.Tensor] | None:
    """One step; the grads it applied (unscaled, as the step reads them), or None when it was skipped."""
    opt.zero_grad(set_to_none=True)
    loss = net(x.to(torch.bfloat16)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = [p.grad.clone() for p in params if p.grad is not None]
    overflow = not all(bool(g.isfinite().all()) for g in grads)
    opt.step()
    return None if overflow else grads


# -- the reference, driven here ---------------------------------------------------------------------------------
def key(step: int, stream: int) -> int:
    """The spec's key(seed, step, stream), on its own mix32."""
    return int(mix32(mix32(mix32(torch.tensor(stream)) ^ step) ^ SEED))


def keys(step: int, count: int, purpose: int) -> torch.Tensor:
    return torch.tensor([key(step, 4 * t + purpose) for t in range(count)], dtype=torch.int64)


class Reference:
    """The setting's storages, stepped by the reference functions: masters from the fp32 initial weights (split
    with step 0's bits), zero moments in the stored format."""

    def __init__(self, masters: Any, state: str, initial: list[torch.Tensor]) -> None:
        self.kind = "fp32" if masters is True else masters
        self.format = state
        self.count = 0
        self.first = True
        n = len(initial)
        if self.kind == "fp32":
            self.masters = Masters.fp32([w.clone() for w in initial], [w.to(torch.bfloat16) for w in initial])
        else:
            weights = [torch.empty_like(w, dtype=torch.bfloat16) for w in initial]
            rem_dtype = {"remainder": torch.int16, "remainder8": torch.int8}.get(self.kind)
            remainders = [torch.empty_like(w, dtype=rem_dtype) for w in initial] if rem_dtype else []
            self.masters = self._view(weights, remainders, keys(0, n, 0))
            for i, w in enumerate(initial):
                self.masters.store(i, w.clone())
        self.moments = {purpose: self._zeros(initial, purpose) for purpose in (1, 2)}

    def _view(self, weights: list[torch.Tensor], remainders: list[torch.Tensor], k: torch.Tensor) -> Masters:
        if self.kind == "fp32":
            return self.masters
        if self.kind == "remainder":
            return Masters.remainder(weights, remainders)
        if self.kind == "remainder8":
            return Masters.remainder8(weights, remainders, k)
        return Masters.stochastic(weights, k)

    def _zeros(self, like: list[torch.Tensor], purpose: int) -> dict[str, list[torch.Tensor]]:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[self.format]
        absmax = [torch.zeros(w.numel() // 256) for w in like] if self.format == "8bit" else []
        return {"values": [torch.zeros_like(w, dtype=dtype) for w in like], "absmax": absmax}

    def moment(self, purpose: int, signed: bool) -> Moments:
        stored = self.moments[purpose]
        if self.format == "bf16":
            return Moments.bf16(stored["values"], keys(self.count, len(stored["values"]), purpose))
        if self.format == "8bit":
            return Moments.eight_bit(stored["values"], stored["absmax"], QuantMap.build(signed))
        return Moments.fp32(stored["values"])

    def step(self, name: str, opt: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
        self.count += 1
        m = self.masters
        masters = self._view(m.weights, m.remainders, keys(self.count, len(grads), 0))
        group = opt.param_groups[0]
        if name == "SGD":
            settings = ref.SgdSettings.of(group)
            ref.sgd_dial_(grads, masters, self.moment(1, True), settings, first_step=self.first)
        else:
            settings = ref.AdamSettings.of(opt, group)
            counts = [torch.tensor(float(self.count))] * len(grads)
            scalars = ref.adam_step_scalars(counts, settings.beta1, settings.beta2, settings.lr)
            ref.adam_dial_(grads, masters, self.moment(1, True), self.moment(2, False), scalars, settings)
        self.first = False


def moment_entries(reference: Reference, i: int, name: str) -> dict[str, torch.Tensor]:
    names = {1: "momentum_buffer"} if name == "SGD" else {1: "exp_avg", 2: "exp_avg_sq"}
    entries = {}
    for purpose, key_name in names.items():
        stored = reference.moments[purpose]
        entries[key_name] = stored["values"][i]
        if reference.format == "8bit":
            entries[key_name + "_absmax"] = stored["absmax"][i]
    return entries


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (torch.float32, torch.bfloat16):
        return same_bits(a, b)
    return a.dtype == b.dtype and torch.equal(a, b)


# Bytes per parameter element of one steady step (read, written), worked out by hand from what each list holds:
# grads bf16 (2) on the bf16-weight settings, fp32 (4) for fp32 masters' grads; masters "remainder" 2 + 2,
# "remainder8" 2 + 1, "stochastic" 2 (read and written), fp32 4 read, 4 + the bf16 weight's 2 written; a moment
# fp32 4, bf16 2, 8-bit 1 + an fp32 absmax per 256 (4 / 256), read and written. Adam has two moments, SGD one.
EIGHT = 1 + 4 / 256
LEDGER = {
    ("remainder", "bf16"): {"adam": (2 + 4 + 2 * 2, 4 + 2 * 2), "sgd": (2 + 4 + 2, 4 + 2)},
    ("remainder", "8bit"): {"adam": (2 + 4 + 2 * EIGHT, 4 + 2 * EIGHT), "sgd": (2 + 4 + EIGHT, 4 + EIGHT)},
    ("remainder8", "fp32"): {"adam": (2 + 3 + 2 * 4, 3 + 2 * 4), "sgd": (2 + 3 + 4, 3 + 4)},
    ("remainder8", "bf16"): {"adam": (2 + 3 + 2 * 2, 3 + 2 * 2), "sgd": (2 + 3 + 2, 3 + 2)},
    ("remainder8", "8bit"): {"adam": (2 + 3 + 2 * EIGHT, 3 + 2 * EIGHT), "sgd": (2 + 3 + EIGHT, 3 + EIGHT)},
    ("stochastic", "fp32"): {"adam": (2 + 2 + 2 * 4, 2 + 2 * 4), "sgd": (2 + 2 + 4, 2 + 4)},
    ("stochastic", "bf16"): {"adam": (2 + 2 + 2 * 2, 2 + 2 * 2), "sgd": (2 + 2 + 2, 2 + 2)},
    ("stochastic", "8bit"): {"adam": (2 + 2 + 2 * EIGHT, 2 + 2 * EIGHT), "sgd": (2 + 2 + EIGHT, 2 + EIGHT)},
    (True, "bf16"): {"adam": (4 + 4 + 2 * 2, 6 + 2 * 2), "sgd": (4 + 4 + 2, 6 + 2)},
    (True, "8bit"): {"adam": (4 + 4 + 2 * EIGHT, 6 + 2 * EIGHT), "sgd": (4 + 4 + EIGHT, 6 + EIGHT)},
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(("masters", "state"), SETTINGS)
def test_a_group_that_fits_the_kernels_steps_as_the_reference(
    masters: Any, state: str, name: str, launches: list[Launch]
) -> None:
    fresh, _ = make_net()
    initial = [p.detach().clone() for p in fresh.parameters()]
    reference = Reference(masters, state, initial)
    net, opt, sess, inputs = train(masters, state, name)
    try:
        for step, x in enumerate(inputs):
            grads = amp_step(net, opt, x)
            assert (grads is None) == (step == SKIPPED)
            if grads is not None:
                reference.step(name, opt, grads)
        # One launch per step taken (both weights in one list), none for the skipped one.
        update = "sgd" if name == "SGD" else "adam"
        assert [launch.name for launch in launches] == [update] * 2
        # The bytes of a steady step (SGD's first one reads no buffer).
        last = launches[-1]
        assert (last.read / last.numel, last.written / last.numel) == LEDGER[(masters, state)][update]
        model_weights = list(net.parameters())
        for i, (got, param) in enumerate(zip(masters_of(sess, net), model_weights)):
            assert same_bits(got, reference.masters.master(i)), ("master", i)
            want_weight = reference.masters.weights[i]
            assert same_bits(param.detach(), want_weight), ("weight", i)
        saved = opt.state_dict()["state"]
        for i, entry in saved.items():
            for key_name, want in moment_entries(reference, i, name).items():
                assert same_tensor(entry[key_name], want), (i, key_name)
            count = entry["step"] if "step" in entry else entry["sr_step"]
            assert int(count) == reference.count
    finally:
        sess.close()


@pytest.mark.parametrize(("masters", "state", "name"), [("remainder8", "8bit", "AdamW"), ("stochastic", "bf16", "SGD")])
def test_resume_through_a_checkpoint_is_bitwise_in_the_kernels(
    masters: Any, state: str, name: str, launches: list[Launch]
) -> None:
    net, opt, sess, inputs = train(masters, state, name)
    try:
        amp_step(net, opt, inputs[0])
        ckpt = checkpoint(net, opt, sess)
        amp_step(net, opt, inputs[2])
        final = [m.clone() for m in masters_of(sess, net)]
        final_state = opt.state_dict()["state"]
    finally:
        sess.close()
    torch.manual_seed(99)
    resumed, _ = make_net()
    resumed, resumed_opt, resumed_sess = session(
        resumed, OPTIMIZERS[name](resumed.parameters()), masters, state, loss_scale="dynamic"
    )
    try:
        restore(resumed, resumed_opt, resumed_sess, ckpt)
        amp_step(resumed, resumed_opt, inputs[2])
        for got, want in zip(masters_of(resumed_sess, resumed), final):
            assert same_bits(got, want)
        for index, entry in resumed_opt.state_dict()["state"].items():
            for key_name, value in entry.items():
                assert same_tensor(value, final_state[index][key_name]), (index, key_name)
        assert len(launches) == 3
    finally:
        resumed_sess.close()


@pytest.mark.parametrize("kind", ["remainder8", "stochastic"])
def test_the_fp32_and_remainder_kernels_refuse_the_dials_masters(kind: str, kernels_on_cpu: ModuleType) -> None:
    """``triton_kernels`` would read an int8 remainder as int16 and a bare bf16 weight as an fp32 master."""
    weights = [torch.ones(300, dtype=torch.bfloat16)]
    grads = [torch.full((300,), 0.5, dtype=torch.bfloat16)]
    no_keys = torch.zeros(1, dtype=torch.int64)
    if kind == "remainder8":
        masters = Masters.remainder8(weights, [torch.zeros(300, dtype=torch.int8)], no_keys)
    else:
        masters = Masters.stochastic(weights, no_keys)
    adam = ref.AdamSettings(1e-2, 0.9, 0.999, 1e-8, 0.0, decoupled=False, maximize=False)
    scalars = ref.adam_step_scalars([torch.tensor(1.0)], 0.9, 0.999, 1e-2)
    message = f"the fused master step takes masters of kind 'fp32' or 'remainder', got {kind!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels_on_cpu.adam_(grads, masters, [torch.zeros(300)], [torch.zeros(300)], scalars, adam)
    sgd = ref.SgdSettings(0.1, 0.0, 0.0, nesterov=False, weight_decay=0.0, maximize=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels_on_cpu.sgd_(grads, masters, [], sgd, first_step=True)
    assert same_bits(weights[0], torch.ones(300, dtype=torch.bfloat16))


#: (masters, state, optimizer, state key, what it is replaced by, the refusal): each a state the dial's kernels
#: would read and write past its end or in the wrong format, put in opt.state by hand.
REFUSED = [
    ("remainder8", "fp32", "AdamW", "exp_avg", lambda t: t.bfloat16(), r"every exp_avg as torch.float32, got torch.bf"),
    ("stochastic", "8bit", "Adam", "exp_avg_sq", lambda t: t.bfloat16(), r"every exp_avg_sq code as torch.uint8"),
    ("remainder", "8bit", "AdamW", "exp_avg_absmax", lambda t: t.repeat(2), r"elements in its exp_avg absmax list"),
    ("remainder8", "bf16", "SGD", "momentum_buffer", lambda t: t.half(), r"as torch.bfloat16, got torch.float16"),
    ("stochastic", "fp32", "FusedAdam", "exp_avg", lambda t: t[:-1].clone(), r"elements in its exp_avg list"),
]


def _three_steps(masters: Any, state: str, name: str, refused: tuple[str, Any, str] | None) -> list[torch.Tensor]:
    """Weights and every state tensor after three dial steps (the second skipped); with ``refused``, the third is
    first attempted with one state entry replaced (refused), then, the entry put back, called again."""
    net, opt, sess, inputs = train(masters, state, name)
    try:
        for x in inputs[:2]:
            amp_step(net, opt, x)
        opt.zero_grad(set_to_none=True)
        with amp.scale_loss(net(inputs[2].to(torch.bfloat16)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        if refused is not None:
            entry, replace, message = refused
            params = [p for group in opt.param_groups for p in group["params"]]
            kept = [opt.state[p][entry] for p in params]
            for p in params:
                opt.state[p][entry] = replace(opt.state[p][entry])
            with pytest.raises(ValueError, match=message):
                opt.step()
            for p, value in zip(params, kept):
                opt.state[p][entry] = value
        opt.step()
        states = [opt.state[p] for group in opt.param_groups for p in group["params"]]
        tensors = [v.reshape(-1) for s in states for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)]
        return [p.detach().clone() for p in net.parameters()] + [t.clone() for t in tensors]
    finally:
        sess.close()


@pytest.mark.parametrize(("masters", "state", "name", "entry", "replace", "message"), REFUSED)
def test_a_dial_state_the_kernels_cannot_read_is_refused_and_nothing_is_applied(
    masters: Any, state: str, name: str, entry: str, replace: Any, message: str, kernels_on_cpu: ModuleType
) -> None:
    # Before the eighteenth session's check a bf16 moment put where the kernels read fp32 ones was written twice
    # its bytes (the process aborted: "malloc(): unaligned tcache chunk detected"). The refusal comes after the
    # step counts (Adam's and the stochastic rounding's) advanced: they are taken back, and the retried step, the
    # entry put back, is the step that was never refused, in every weight and state tensor.
    got = _three_steps(masters, state, name, (entry, replace, message))
    want = _three_steps(masters, state, name, None)
    assert len(got) == len(want) and all(same_tensor(g, w) for g, w in zip(got, want))
