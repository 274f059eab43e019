"""The precision dial's two step paths in one run, and ampinit's FusedAdam/FusedSGD on the dial's one-pass kernels.

A dial step runs in ``triton_dial`` (one launch per list; Triton's interpreter on CPU here, switched per step with
``kernel_step.TRITON_ON_CPU``) where the group fits the kernels, else chunked: masters and moments decoded to fp32,
the optimizer's own fp32 update, encoded back. Every step below is checked against the plain reference
(``reference.adam_dial_``/``sgd_dial_``), run here on the same grads from the state the session held before the
step, with the random keys and the bias corrections of the step count the run must be at:

- a kernel step equals it bit for bit (masters, model weights, moments, 8-bit blocks and scales), whatever path
  the step before took: the state, the step counts and the random-bit counters carry over;
- a chunked step runs torch's (or FusedAdam's/FusedSGD's own) fp32 update, whose last bit may differ from the
  reference's order of ops. It draws the same bits, so it agrees to one unit of each stored format (plus 1e-5 of
  the tensor's scale for the fp32 update's last bits), and where a format rounds (stochastic rounding, 8-bit codes)
  at most 1% of the elements differ at all (other bits would move about a third of them);
- on both paths the state keeps one layout: its keys and dtypes, and the step counts, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import kernel_step
from ampinit._masters import reference as ref
from ampinit._masters.precision import QuantMap
from ampinit._masters.reference import AdamSettings, Masters, Moments, SgdSettings
from ampinit.optimizers import FusedAdam, FusedSGD
from tests.test_dial_kernel_step import SEED, SETTINGS, amp_step, keys, make_net
from tests.test_precision_dial import masters_of, same_bits, session


@dataclass(frozen=True)
class Case:
    """An optimizer, and its update in the reference's terms, written from its documented rule (not read from it)."""

    make: Callable[[Any], torch.optim.Optimizer]
    settings: AdamSettings | SgdSettings
    bias_correction: bool = True


CASES: dict[str, Case] = {
    "AdamW": Case(
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        AdamSettings(1e-2, 0.8, 0.99, 1e-8, 0.1, decoupled=True, maximize=False),
    ),
    "SGD": Case(
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        SgdSettings(0.05, 0.9, 0.1, nesterov=False, weight_decay=0.01, maximize=False),
    ),
    # Apex's FusedAdam: adam_w_mode=True (its default) is AdamW's decoupled decay.
    "FusedAdam": Case(
        lambda p: FusedAdam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        AdamSettings(1e-2, 0.8, 0.99, 1e-8, 0.1, decoupled=True, maximize=False),
    ),
    # adam_w_mode=False adds the decay to the grad (L2); bias_correction=False steps by lr with no corrections.
    "FusedAdam-L2-no-correction": Case(
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False, bias_correction=False),
        AdamSettings(1e-2, 0.9, 0.999, 1e-8, 0.01, decoupled=False, maximize=False),
        bias_correction=False,
    ),
    # Apex's FusedSGD: torch's momentum rule, the buffer starting at the grad, decay added to the grad.
    "FusedSGD": Case(
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        SgdSettings(0.05, 0.9, 0.1, nesterov=False, weight_decay=0.01, maximize=False),
    ),
    "FusedSGD-nesterov": Case(
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        SgdSettings(0.05, 0.9, 0.0, nesterov=True, weight_decay=0.01, maximize=False),
    ),
    "FusedSGD-no-momentum": Case(
        lambda p: FusedSGD(p, lr=0.05),
        SgdSettings(0.05, 0.0, 0.0, nesterov=False, weight_decay=0.0, maximize=False),
    ),
}
SKIPPED = 3  # the input that overflows: a step skipped between the switches


def inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=gen) for _ in range(6)]
    xs[SKIPPED][0, 0] = float("inf")
    return xs


@dataclass(frozen=True)
class Launch:
    name: str
    numel: int  # elements stepped


@pytest.fixture
def launches(kernels_on_cpu: Any, monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every ``triton_dial`` launch of the test."""
    from ampinit._masters import triton_dial

    seen: list[Launch] = []

    def counting(name: str) -> Callable[..., None]:
        run = getattr(triton_dial, name)

        def counted(grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
            seen.append(Launch(name, sum(g.numel() for g in grads)))
            run(grads, *args, **kwargs)

        return counted

    for name in ("adam_dial_", "sgd_dial_"):
        monkeypatch.setattr(triton_dial, name, counting(name))
    return seen


# -- the state a session holds, and the reference's step from it ------------------------------------------------
@dataclass
class Held:
    """What a session stores between steps: joined fp32 masters, the bf16 model weights, each parameter's state."""

    masters: list[torch.Tensor]
    weights: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]
    group_step: torch.Tensor | None


def held(sess: Any, net: nn.Module, opt: torch.optim.Optimizer) -> Held:
    params = [p for group in opt.param_groups for p in group["params"]]
    step = opt.param_groups[0].get("step")
    return Held(
        [m.detach().clone() for m in masters_of(sess, net)],
        [p.detach().clone() for p in net.parameters()],
        [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
        step.clone() if isinstance(step, torch.Tensor) else None,
    )


KIND = {True: "fp32", "remainder": "remainder", "remainder8": "remainder8", "stochastic": "stochastic"}
MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def reference_step(
    masters: Any, state: str, case: Case, before: Held, grads: list[torch.Tensor], count: int, first: bool
) -> Held:
    """The reference's step from ``before``: step ``count`` (after this step), ``first`` for SGD's first step."""
    kind, n = KIND[masters], len(grads)
    weights = [w.clone() for w in before.weights]
    step_keys = keys(count, n, 0)
    if kind == "fp32":
        view = Masters.fp32([m.clone() for m in before.masters], weights)
    else:
        storage = {"remainder": torch.int16, "remainder8": torch.int8}.get(kind)
        remainders = [torch.empty_like(w, dtype=storage) for w in weights] if storage else []
        view = {
            "remainder": lambda: Masters.remainder(weights, remainders),
            "remainder8": lambda: Masters.remainder8(weights, remainders, step_keys),
            "stochastic": lambda: Masters.stochastic(weights, step_keys),
        }[kind]()
        for i, m in enumerate(before.masters):
            view.store(i, m.clone())  # exact: a joined master is a value of its storage
    update = "adam" if isinstance(case.settings, AdamSettings) else "sgd"
    states = [{k: v.clone() for k, v in s.items()} for s in before.states]
    moments = [
        moment_view(state, states, name, purpose, count, before.weights)
        for purpose, name in enumerate(MOMENTS[update], 1)
    ]
    if isinstance(case.settings, AdamSettings):
        corrected = ref.adam_step_scalars(
            [torch.tensor(float(count))] * n, case.settings.beta1, case.settings.beta2, case.settings.lr
        )
        # Without bias correction the step size is lr and sqrt(1 - beta2**t) is 1.
        scalars = corrected if case.bias_correction else torch.tensor([[case.settings.lr, 1.0]] * n)
        ref.adam_dial_(grads, view, moments[0], moments[1], scalars, case.settings)
    else:
        buffers = moments[0] if case.settings.momentum != 0 else Moments.fp32([])
        ref.sgd_dial_(grads, view, buffers, case.settings, first_step=first)
    after_masters = [view.master(i).clone() for i in range(n)]
    return Held(after_masters, weights, states, None)


def moment_view(
    state: str, states: list[dict[str, torch.Tensor]], name: str, purpose: int, count: int, like: list[torch.Tensor]
) -> Moments:
    """Moment ``name`` of every parameter in ``state``'s format, the tensors of ``states`` (zeros where absent)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[state]
    for s, w in zip(states, like):
        if name not in s:
            s[name] = torch.zeros_like(w, dtype=dtype)
            if state == "8bit":
                s[name + "_absmax"] = torch.zeros(-(-w.numel() // 256))
    values = [s[name] for s in states]
    if state == "bf16":
        return Moments.bf16(values, keys(count, len(values), purpose))
    if state == "8bit":
        return Moments.eight_bit(values, [s[name + "_absmax"] for s in states], QuantMap.build(name != "exp_avg_sq"))
    return Moments.fp32(values)


# -- agreement ----------------------------------------------------------------------------------------------------
MANTISSA = {"fp32": 23, "remainder": 23, "remainder8": 15, "stochastic": 7, "bf16": 7}
ROUNDS = {"remainder8", "stochastic", "bf16"}


def unit(x: torch.Tensor, bits: int) -> torch.Tensor:
    """One unit in the last place of ``x`` with ``bits`` stored mantissa bits (0 at 0)."""
    _, exponent = torch.frexp(x.float())
    return torch.where(
        x == 0,
        torch.zeros_like(x, dtype=torch.float32),
        torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 1 - bits),
    )


def agree_in_format(got: torch.Tensor, want: torch.Tensor, fmt: str, what: object) -> None:
    """A chunked step's value against the reference's: one unit of ``fmt``, plus the fp32 update's last bits."""
    got, want = got.float(), want.float()
    tolerance = unit(torch.maximum(got.abs(), want.abs()), MANTISSA[fmt]) + 1e-5 * want.abs().max()
    assert bool(((got - want).abs() <= tolerance).all()), (what, (got - want).abs().max())
    if fmt in ROUNDS:
        assert (got != want).float().mean().item() <= 0.01, (what, "rounded otherwise")


def agree_8bit(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str, what: object) -> None:
    codes, want_codes = got[name].long(), want[name].long()
    assert bool(((codes - want_codes).abs() <= 1).all()), (what, name)
    assert (codes != want_codes).float().mean().item() <= 0.01, (what, name, "rounded otherwise")
    absmax, want_absmax = got[name + "_absmax"], want[name + "_absmax"]
    assert torch.allclose(absmax, want_absmax, rtol=1e-5, atol=0), (what, name + "_absmax")


def expected_layout(update: str, name: str, state: str, masters: Any) -> dict[str, torch.dtype]:
    """Each parameter's state as the optimizer keeps it under the dial: its own moments in the dial's format, torch
    Adam's per-parameter ``step``, amp's ``sr_step`` where the optimizer has none (FusedAdam counts per group)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[state]
    layout = {key: dtype for key in MOMENTS[update]}
    if state == "8bit":
        layout.update({key + "_absmax": torch.float32 for key in MOMENTS[update]})
    if name == "AdamW":
        layout["step"] = torch.float32
    else:
        layout["sr_step"] = torch.int64
    if update == "sgd" and CASES[name].settings.momentum == 0:  # type: ignore[union-attr]
        layout = {k: v for k, v in layout.items() if k == "sr_step"}
    return layout


def check_step(
    masters: Any, state: str, name: str, got: Held, want: Held, count: int, in_kernels: bool, what: object
) -> None:
    case = CASES[name]
    update = "adam" if isinstance(case.settings, AdamSettings) else "sgd"
    layout = expected_layout(update, name, state, masters)
    for i, entry in enumerate(got.states):
        assert {k: v.dtype for k, v in entry.items()} == layout, (what, i)
        counter = entry["step"] if name == "AdamW" else entry["sr_step"]
        assert int(counter) == count, (what, i, "count")
    if name.startswith("FusedAdam"):
        assert got.group_step is not None and int(got.group_step) == count, (what, "group step")
    kind = KIND[masters]
    for i in range(len(got.masters)):
        if in_kernels:
            assert same_bits(got.masters[i], want.masters[i]), (what, "master", i)
            assert same_bits(got.weights[i], want.weights[i]), (what, "weight", i)
        else:
            agree_in_format(got.masters[i], want.masters[i], kind, (what, "master", i))
            agree_in_format(got.weights[i], want.weights[i], "bf16", (what, "weight", i))
        for key in MOMENTS[update]:
            if key not in want.states[i] or key not in layout:
                continue
            g, w = got.states[i], want.states[i]
            if in_kernels:
                for k in (key, key + "_absmax"):
                    if k in w:
                        assert torch.equal(g[k], w[k]) and g[k].dtype == w[k].dtype, (what, k, i)
            elif state == "8bit":
                agree_8bit(g, w, key, (what, i))
            else:
                agree_in_format(g[key], w[key], state, (what, key, i))


def run(
    masters: Any, state: str, name: str, paths: str, launches: list[Launch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Train on ``paths`` ("K": the kernels, "C": chunked; one letter per input), checking every step."""
    net, _ = make_net()
    torch.manual_seed(SEED)  # the session's stochastic-rounding seed, which the reference's keys use
    net, opt, sess = session(net, CASES[name].make(net.parameters()), masters, state, loss_scale="dynamic")
    update = "adam" if isinstance(CASES[name].settings, AdamSettings) else "sgd"
    count = 0
    try:
        for index, (path, x) in enumerate(zip(paths, inputs())):
            monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", path == "K")
            before = held(sess, net, opt)
            launched = len(launches)
            grads = amp_step(net, opt, x)
            after = held(sess, net, opt)
            if grads is None:  # skipped: nothing changes, nothing is launched
                assert index == SKIPPED and len(launches) == launched
                for a, b in zip(after.masters + after.weights, before.masters + before.weights):
                    assert same_bits(a, b)
                continue
            assert [launch.name for launch in launches[launched:]] == ([f"{update}_dial_"] if path == "K" else []), (
                index
            )
            count += 1
            want = reference_step(masters, state, CASES[name], before, grads, count, first=count == 1)
            check_step(masters, state, name, after, want, count, path == "K", (index, path))
    finally:
        sess.close()


# -- the tests ----------------------------------------------------------------------------------------------------
# Each setting with one Adam and one SGD optimizer, torch's and ampinit's alternating, so that every master kind and
# every moment format meets all four optimizers (half the runs of every pairing, at the same coverage).
MOVES = [
    (masters, state, name)
    for i, (masters, state) in enumerate(SETTINGS)
    for name in (("AdamW", "FusedSGD") if i % 2 == 0 else ("FusedAdam", "SGD"))
]


@pytest.mark.parametrize(("masters", "state", "name"), MOVES)
def test_a_run_moves_between_the_chunked_and_kernel_paths(
    masters: Any, state: str, name: str, launches: list[Launch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked -> kernels -> chunked -> kernels -> (a skipped step) -> chunked: both directions, twice."""
    run(masters, state, name, "CKCKKC", launches, monkeypatch)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("Fused")])
@pytest.mark.parametrize(("masters", "state"), [("remainder8", "8bit"), (True, "bf16"), ("stochastic", "fp32")])
def test_fused_optimizers_step_in_the_dials_kernels(
    masters: Any, state: str, name: str, launches: list[Launch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step of FusedAdam/FusedSGD, with each option the kernels map, in one launch, bitwise the reference."""
    run(masters, state, name, "KKKKK", launches, monkeypatch)


def two_layers() -> tuple[nn.Module, list[torch.Tensor]]:
    net, _ = make_net()
    return net, list(net.parameters())


# FusedAdam's per-group max_grad_norm is no such option: the chunked step cannot apply it either, so initialize
# refuses it (tests/test_remainder_masters.py::test_fused_adam_clipping_per_group_is_refused_not_dropped).
@pytest.mark.parametrize("option", ["wd_after_momentum", "capturable"])
def test_options_the_kernels_lack_keep_the_chunked_step(option: str, launches: list[Launch]) -> None:
    """A group (or optimizer) with an option the kernels lack takes the chunked step, beside one that takes the
    kernels in the same step: the launches hold the first layer's elements only, and the second layer still trains."""
    net, (first, second) = two_layers()
    torch.manual_seed(SEED)
    optimizers: list[torch.optim.Optimizer]
    if option == "wd_after_momentum":  # refused only where there is weight decay to add after momentum
        groups = [{"params": [first]}, {"params": [second], "weight_decay": 0.01}]
        optimizers = [FusedSGD(groups, lr=0.05, momentum=0.9, wd_after_momentum=True)]
    else:  # a tensor lr, for CUDA graphs
        optimizers = [FusedAdam([first], lr=1e-2), FusedAdam([second], lr=1e-2, capturable=True)]
    net, optimizers = amp.initialize(
        net,
        optimizers,
        opt_level="O5",
        master_weights="remainder8",
        optimizer_state="8bit",
        loss_scale="dynamic",  # a skip decided on the host: SGD's first momentum step may take the kernels
        verbosity=0,
    )
    sess = ampinit.session_of(optimizers[0])
    try:
        start = sess.master_for(second).clone()
        for x in inputs()[:2]:
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = net(x.to(torch.bfloat16)).float().pow(2).mean()
            with amp.scale_loss(loss, optimizers) as scaled:
                scaled.backward()
            for opt in optimizers:
                opt.step()
        assert [launch.numel for launch in launches] == [first.numel()] * 2
        moved = sess.master_for(second) - start
        assert bool(moved.isfinite().all()) and bool((moved != 0).any())
    finally:
        sess.close()
