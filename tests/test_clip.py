"""``amp.clip_grad_norm_``: Apex's pattern, ``torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm)``,
is the reference at every level. Where O2/O5's step takes amp's kernels, the clip is folded into the kernels' grad
multiplier (``ampinit._masters.clip``): the same total norm and the same training, bit for bit, with no fp32
master grad written. Elsewhere it is that pattern."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._masters import kernel_step
from tests._device import device_under_test, on_device
from tests._kernels_vs_reference import count_launches
from tests.conftest import SmallNet

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels are tested through it")

HALF = {"O2": torch.float16, "O5": torch.bfloat16}


def momentum_sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)  # type: ignore[arg-type]


Clip = Callable[[torch.optim.Optimizer, float, float], torch.Tensor]


def apex_pattern(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm, norm_type)


def ampinit_clip(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
    return amp.clip_grad_norm_(opt, max_norm, norm_type)


def train(
    level: str,
    clip: Clip,
    max_norm: float,
    norm_type: float = 2.0,
    steps: int = 4,
    poison_step: int | None = None,
    loss_scale: float | str | None = None,
    make_opt: Callable[..., torch.optim.Optimizer] | None = None,
    options: dict[str, object] | None = None,
    micro_batches: int = 1,
    delay_unscale: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` amp steps of SmallNet (BatchNorm: fp32 parameters the optimizer updates directly at O2/O5), each
    clipped by ``clip``; the norms it returned, then the weights, the masters and the optimizer state. A step
    accumulates ``micro_batches`` batches of 32 rows in all (a ``scale_loss`` block each, all but the last with
    ``delay_unscale`` if asked)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = on_device(SmallNet())
    opt = (make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)))(model.parameters())
    settings: dict[str, object] = {"verbosity": 0, **(options or {})}
    if loss_scale is not None:
        settings["loss_scale"] = loss_scale
    model, opt = amp.initialize(model, opt, opt_level=level, **settings)
    session = amp.current_session()
    assert session is not None
    norms = []
    try:
        for step in range(steps):
            for micro in range(micro_batches):
                x = on_device(torch.randn(32 // micro_batches, 8, generator=gen))
                if level in HALF:
                    x = x.to(HALF[level])
                last = micro == micro_batches - 1
                loss = model(x).float().pow(2).mean() / micro_batches
                with amp.scale_loss(loss, opt, delay_unscale=delay_unscale and not last) as scaled:
                    scaled.backward()
                    if step == poison_step:
                        model.fc1.weight.grad[0, 0] = float("inf")
            norms.append(clip(opt, max_norm, norm_type).detach().clone())
            opt.step()
            opt.zero_grad()
        tensors = [p.detach().clone() for p in model.parameters()]
        tensors += [p.detach().clone() for p in amp.master_params(opt)]
        state = opt.state_dict()["state"]
        tensors += [v for _, per_param in sorted(state.items()) for _, v in sorted(per_param.items())]
    finally:
        session.close()
    return norms, tensors


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


# amp's kernel step on the device under test: Triton's interpreter on CPU (the module-scoped interpreter set up
# before the leak check's snapshot, as a fixture named in the signature is), compiled kernels on CUDA.
if device_under_test().type == "cpu":

    @pytest.fixture
    def kernels(kernels_on_cpu: ModuleType) -> ModuleType | None:
        return kernels_on_cpu

else:

    @pytest.fixture
    def kernels() -> ModuleType | None:
        return None


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """amp's kernel step off on every device: torch's update, chunked where the masters live in the weights."""
    monkeypatch.setattr(kernel_step, "kernels_for", lambda device: None)


def counted_launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Launch counts of amp's update kernels from now on: the fp32-master and remainder ones, and the dial's."""
    from ampinit._masters import triton_dial, triton_kernels

    return [
        count_launches(triton_kernels, monkeypatch),
        count_launches(triton_dial, monkeypatch, ("adam_dial_", "sgd_dial_")),
    ]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipping", "under-the-limit"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0], ids=["l2", "inf", "l1"])
def test_the_fused_clip_gives_apexs_pattern_bit_for_bit(level: str, max_norm: float, norm_type: float) -> None:
    """O2: a dynamic fp16 scale (2**16, then backing off at the inf grad of step 2); O5: bf16 at scale 1. Norms,
    weights, masters and state equal Apex's pattern's bits (which makes the fp32 master grads and clips them)."""
    poison = 2 if level == "O2" else None
    norms, tensors = train(level, ampinit_clip, max_norm, norm_type, poison_step=poison)
    ref_norms, ref_tensors = train(level, apex_pattern, max_norm, norm_type, poison_step=poison)
    # Only the poisoned step overflows (its step skipped); the others clip where the limit is below their norm.
    assert [not bool(n.isfinite()) for n in ref_norms] == [step == poison for step in range(4)]
    assert all(bool(n > max_norm) == (max_norm < 1) for n in ref_norms if n.isfinite())
    assert_same(norms, ref_norms)
    assert_same(tensors, ref_tensors)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_the_fused_clip_writes_no_master_grad_and_the_kernels_take_the_step(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the clip and the step the eight masters' grads are still None (no fp32 grad is allocated); the
    two BatchNorm parameters, updated directly, hold their own fp32 grads, clipped in place; the kernels step."""
    launched: list[int] = []
    original = kernel_step.run_kernels
    monkeypatch.setattr(kernel_step, "run_kernels", lambda *a, **k: (launched.append(1), original(*a, **k))[1])
    seen: list[list[bool]] = []

    def clip_and_look(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        total = amp.clip_grad_norm_(opt, max_norm, norm_type)
        seen.append([p.grad is None for group in opt.param_groups for p in group["params"]])
        return total

    train(level, clip_and_look, 0.05, steps=2)
    assert launched, "the kernels did not take the step"
    assert [sum(step) for step in seen] == [8, 8]
    assert [len(step) for step in seen] == [10, 10]


# -- masters in the bf16 weights (the precision dial) --------------------------------------------------------------
DIAL = {
    "remainder": {"master_weights": "remainder"},
    "remainder8": {"master_weights": "remainder8"},
    "stochastic": {"master_weights": "stochastic"},
    "remainder-8bit": {"master_weights": "remainder", "optimizer_state": "8bit"},
}


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("setting", list(DIAL))
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipping", "under-the-limit"])
def test_with_masters_in_the_weights_the_clip_gives_apexs_pattern_bit_for_bit(setting: str, max_norm: float) -> None:
    """Apex's pattern makes every fp32 master (and its grad) to clip it; the fold multiplies the bf16 grads in the
    step instead. On the chunked step both run the same update on the same values: the same bits."""
    norms, tensors = train("O5", ampinit_clip, max_norm, options=DIAL[setting])
    ref_norms, ref_tensors = train("O5", apex_pattern, max_norm, options=DIAL[setting])
    assert all(bool(n > max_norm) == (max_norm < 1) for n in ref_norms)
    assert_same(norms, ref_norms)
    assert_same(tensors, ref_tensors)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("setting", list(DIAL))
def test_with_masters_in_the_weights_the_clip_keeps_the_kernel_step(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apex's pattern makes fp32 masters, which only the chunked step takes; with the fold every step stays one
    launch per list, and trains as the pattern does (torch's update there, the kernels' here: to rounding). SGD
    with momentum, whose update a clip scales (Adam's would hardly show one)."""
    launched = counted_launches(monkeypatch)
    norms, tensors = train("O5", ampinit_clip, 0.05, make_opt=momentum_sgd, options=DIAL[setting])
    assert sum(sum(counts.values()) for counts in launched) >= 4, launched
    launched = counted_launches(monkeypatch)
    ref_norms, ref_tensors = train("O5", apex_pattern, 0.05, make_opt=momentum_sgd, options=DIAL[setting])
    assert sum(sum(counts.values()) for counts in launched) == 0, launched  # the pattern's masters: chunked
    torch.testing.assert_close(norms[0], ref_norms[0], rtol=0, atol=0)  # the first step's grads are the same
    for ours, theirs in zip(norms + tensors, ref_norms + ref_tensors):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-3)


# -- where nothing is folded: Apex's pattern itself ------------------------------------------------------------
@pytest.mark.parametrize(
    ("level", "options", "norm_type", "kernels_on"),
    [
        ("O0", {}, 2.0, True),
        ("O1", {}, 2.0, True),
        ("O4", {}, 2.0, True),
        ("O3", {}, 2.0, True),
        ("O2", {"loss_scale": 1000.0}, 2.0, True),  # 1/1000 times a widened grad rounds: not foldable exactly
        ("O5", {}, 3.0, True),  # an order whose norm a power-of-two factor does not scale exactly
        ("O2", {}, 2.0, False),  # no kernel step pending: the exit wrote the master grads
        ("O5", {"master_weights": "remainder"}, 0.5, True),
    ],
    ids=["O0", "O1", "O4", "O3", "O2-odd-scale", "O5-order-3", "O2-no-kernels", "remainder-order-half"],
)
def test_where_the_fold_does_not_apply_the_clip_is_apexs_pattern(
    level: str, options: dict[str, object], norm_type: float, kernels_on: bool, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue("kernels" if kernels_on else "no_kernels")
    opt_options = {k: v for k, v in options.items() if k != "loss_scale"}
    scale = options.get("loss_scale")
    assert scale is None or isinstance(scale, float)
    make = momentum_sgd if level == "O3" else None  # fp16 Adam diverges at O3 (docs/faq.md)
    norms, tensors = train(level, ampinit_clip, 0.05, norm_type, loss_scale=scale, make_opt=make, options=opt_options)
    ref_norms, ref_tensors = train(
        level, apex_pattern, 0.05, norm_type, loss_scale=scale, make_opt=make, options=opt_options
    )
    assert all(bool(n > 0.05) for n in ref_norms)
    assert_same(norms, ref_norms)
    assert_same(tensors, ref_tensors)


def test_an_optimizer_amp_does_not_know_is_clipped_as_torch_clips_its_parameters() -> None:
    grads = [torch.randn(3, 4), torch.randn(5)]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    twins = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    total = amp.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert torch.equal(total, expected)
    assert all(torch.equal(p.grad, t.grad) for p, t in zip(params, twins))


# -- the clip's contract -------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
    ("max_norm", "norm_type", "message"),
    [
        (-1.0, 2.0, "max_norm must be a number >= 0 .* Received -1.0"),
        (float("nan"), 2.0, "max_norm must be a number >= 0 .* Received nan"),
        ("x", 2.0, "max_norm must be a number. Received 'x'"),
        (1.0, None, "norm_type must be a number. Received None"),
    ],
)
def test_bad_input_is_refused_by_name_and_changes_nothing(max_norm: object, norm_type: object, message: str) -> None:
    """Refused before anything is read or written: the step that follows is the unclipped one."""

    def refused_then_unclipped(opt: torch.optim.Optimizer, _: float, __: float) -> torch.Tensor:
        with pytest.raises(ValueError, match=message):
            amp.clip_grad_norm_(opt, max_norm, norm_type)  # type: ignore[arg-type]
        return torch.zeros(())

    _, tensors = train("O2", refused_then_unclipped, 0.05)
    _, ref_tensors = train("O2", lambda opt, m, n: torch.zeros(()), 0.05)
    assert_same(tensors, ref_tensors)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("clip", [ampinit_clip, apex_pattern], ids=["fold", "apex-pattern"])
def test_error_if_nonfinite_raises_torchs_error_at_an_overflow(clip: Clip) -> None:
    raised: list[str] = []

    def strict(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        masters = amp.master_params(opt) if clip is apex_pattern else None
        try:
            if masters is None:
                return amp.clip_grad_norm_(opt, max_norm, norm_type, error_if_nonfinite=True)
            return torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type, error_if_nonfinite=True)
        except RuntimeError as error:
            raised.append(str(error))
            return torch.full((), float("inf"))

    train("O2", strict, 0.05, poison_step=1, steps=3)
    assert len(raised) == 1 and "is non-finite, so it cannot be clipped" in raised[0]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(("level", "options"), [("O2", {}), ("O5", {}), ("O5", {"master_weights": "remainder"})])
def test_a_second_clip_sees_the_first_and_master_params_sees_both(level: str, options: dict[str, object]) -> None:
    """Clipped to 0.05, the grads' norm is 0.05 (what a second clip reports, and Apex's pattern leaves); the fp32
    master grads made after two folds hold both clips (torch's second coefficient, 0.05 / (0.05 + 1e-6), shrinks
    them a little more)."""
    seen: list[torch.Tensor] = []

    def twice_then_look(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        first = amp.clip_grad_norm_(opt, max_norm)
        seen.append(amp.clip_grad_norm_(opt, max_norm))
        seen.append(torch.nn.utils.get_total_norm([p.grad for p in amp.master_params(opt) if p.grad is not None]))
        return first

    def pattern_then_look(opt: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        first = apex_pattern(opt, max_norm, norm_type)
        seen.append(torch.nn.utils.get_total_norm([p.grad for p in amp.master_params(opt) if p.grad is not None]))
        return first

    norms, _ = train(level, twice_then_look, 0.05, steps=2, options=options)
    ours, seen[:] = list(seen), []
    ref_norms, _ = train(level, pattern_then_look, 0.05, steps=2, options=options)
    assert_same(norms, ref_norms)
    for second, materialised, reference in zip(ours[0::2], ours[1::2], seen):
        torch.testing.assert_close(second, reference, rtol=1e-5, atol=0)
        torch.testing.assert_close(materialised, reference * 0.05 / (reference + 1e-6), rtol=1e-6, atol=0)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("delay_unscale", [False, True], ids=["accumulate", "delay_unscale"])
def test_accumulated_micro_batches_clip_as_apexs_pattern(level: str, delay_unscale: bool) -> None:
    """Two ``scale_loss`` blocks per step, the clip after the second: the fold (where the second exit leaves a step
    pending) or Apex's line itself, with Apex's line's bits either way."""
    for_both = {"steps": 3, "micro_batches": 2, "delay_unscale": delay_unscale}
    norms, tensors = train(level, ampinit_clip, 0.05, **for_both)
    ref_norms, ref_tensors = train(level, apex_pattern, 0.05, **for_both)
    assert_same(norms, ref_norms)
    assert_same(tensors, ref_tensors)
