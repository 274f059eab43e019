"""The master step reading the half grads: when an O2/O5 step will take amp's kernels, ``scale_loss``'s exit only
checks the half grads and the kernels read them times ``1/scale``; no fp32 master grad is written. Whatever asks
for the master grads gets them, with the bits the exit writes when the kernels are off (today's path, the
reference here): ``amp.master_params`` (clipping), a step hook, ``zero_grad(set_to_none=False)``, another backward
before the step, closing the session between the exit and the step."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import kernel_step

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels are tested through it")

HALF = {"O2": torch.float16, "O5": torch.bfloat16}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model: nn.Module, opt: torch.optim.Optimizer, level: str, seed: int) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)).to(HALF[level])
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()


def _bits(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone() for t in tensors]


def run(
    monkeypatch: pytest.MonkeyPatch,
    kernels: bool,
    level: str,
    body: Callable[[nn.Module, torch.optim.Optimizer], list[torch.Tensor | None]],
) -> list[torch.Tensor | None]:
    """``body``'s tensors, from an O2/O5 session with the kernel step on CPU (``kernels``) or off."""
    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", kernels)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    session = amp.current_session()
    assert session is not None
    try:
        return _bits(body(model, opt))
    finally:
        session.close()


def assert_same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)), (x, y)


def _master_grads(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [p.grad for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_the_exit_writes_no_master_grad_and_the_step_gives_the_same_bits(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """Three steps reading the half grads equal three steps whose master grads were asked for (and so made)."""
    seen: list[torch.Tensor | None] = []

    def train(ask: bool) -> Callable[[nn.Module, torch.optim.Optimizer], list[torch.Tensor | None]]:
        def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
            for seed in range(3):
                _backward(model, opt, level, seed)
                if ask:
                    list(amp.master_params(opt))
                else:
                    seen.append(opt.param_groups[0]["params"][0].grad)  # the first Linear's master
                opt.step()
                opt.zero_grad()
            return [*model.parameters(), *amp.master_params(opt)]

        return body

    lazy = run(monkeypatch, True, level, train(ask=False))
    asked = run(monkeypatch, True, level, train(ask=True))
    assert seen == [None] * 3  # no fp32 master grad between the exit and the step
    assert_same(lazy, asked)


def test_the_pending_step_multiplies_by_the_scale_its_grads_were_scaled_with(kernels_on_cpu: ModuleType) -> None:
    """A scale that grows at every clean exit (growth_interval 1): the exit's update doubles it after the half grads
    were scaled by the old one, and the pending step must keep the old one's reciprocal (the new one's would move
    the weights by half the unscaled grads)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = amp.initialize(
        model,
        opt,
        opt_level="O2",
        verbosity=0,
        loss_scale=ampinit.DynamicLossScale(init_scale=2.0**4, growth_interval=1),
    )
    session = amp.current_session()
    assert session is not None
    try:
        for seed in range(3):
            (scaler,) = session.scalers
            before = scaler.loss_scale()
            _backward(model, opt, "O2", seed)
            record = session._record_of(opt)
            assert record is not None and record.grads._pending is not None
            taken = record.grads._pending.inv_scale
            assert scaler.loss_scale() == 2 * before
            assert taken is not None and float(taken) == 1 / before
            opt.step()
            opt.zero_grad()
    finally:
        session.close()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_clipping_master_params_sees_todays_master_grads(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        _backward(model, opt, level, 0)
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.01)
        return [norm, *_master_grads(opt)]

    assert_same(run(monkeypatch, True, level, body), run(monkeypatch, False, level, body))


def test_a_step_hook_sees_todays_master_grads(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        seen: list[torch.Tensor | None] = []

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            seen.extend(_bits(_master_grads(optimizer)))

        _backward(model, opt, "O2", 0)  # no hook yet: the exit leaves the master grads to the kernels
        handle = opt.register_step_pre_hook(hook)
        try:
            opt.step()
        finally:
            handle.remove()
        return seen

    hooked = run(monkeypatch, True, "O2", body)
    assert hooked and all(g is not None for g in hooked)
    assert_same(hooked, run(monkeypatch, False, "O2", body))


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_between_exit_and_step_does_what_it_does_today(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, set_to_none: bool
) -> None:
    """Kept grads are zeroed (and Adam steps on zeros); dropped ones leave nothing to step on."""

    def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        _backward(model, opt, "O2", 0)
        opt.zero_grad(set_to_none=set_to_none)
        grads = _bits(_master_grads(opt))
        opt.step()
        return [*grads, *model.parameters()]

    zeroed = run(monkeypatch, True, "O2", body)
    assert_same(zeroed, run(monkeypatch, False, "O2", body))


def test_two_backwards_before_a_step_accumulate_todays_master_grads(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        _backward(model, opt, "O2", 0)
        _backward(model, opt, "O2", 1)
        return [p.grad for p in amp.master_params(opt)]

    assert_same(run(monkeypatch, True, "O2", body), run(monkeypatch, False, "O2", body))


def test_closing_between_exit_and_step_hands_back_todays_grads(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's own grads become the unscaled master grads, as without the kernels."""
    grads: dict[bool, list[torch.Tensor | None]] = {}
    for kernels in (True, False):
        monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", kernels)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        _backward(model, opt, "O2", 0)
        amp.deinitialize()
        grads[kernels] = _bits([p.grad for p in model.parameters()])
    assert_same(grads[True], grads[False])


def _counting_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the full checks of a plan (``kernels_taking``, the per-tensor part of planning) from now on."""
    calls: list[int] = []
    check = kernel_step.kernels_taking

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(kernel_step, "kernels_taking", counted)
    return calls


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_the_step_takes_back_the_plan_made_at_the_exit(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """The exit plans the kernel step to know it may leave the master grads in the half grads; the step takes that
    plan back instead of checking every tensor again (before, it planned twice: 0.6 ms of Python per step at 150
    tensors on this project's CPU)."""

    def body(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        _backward(model, opt, level, 0)
        plans = _counting_plans(monkeypatch)
        opt.step()
        assert plans == []
        return list(model.parameters())

    run(monkeypatch, True, level, body)


@pytest.mark.parametrize("replacement", ["doubled", "non-contiguous"])
def test_a_grad_replaced_after_the_exit_is_planned_again(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, replacement: str
) -> None:
    """A weight grad replaced between the exit and the step is what the step reads: the plan made at the exit no
    longer holds and the step plans again, reading the new grad (doubled: the same bits as doubling it inside the
    block), or leaving the step to the optimizer when the new grad is beyond the kernels (a transposed view; the
    weights then match the step with the kernels off)."""

    def replace(model: nn.Module) -> None:
        weight = model[0].weight
        grad = weight.grad.detach() * 2
        if replacement == "non-contiguous":
            grad = grad.t().contiguous().t()
        weight.grad = grad

    def after_exit(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        _backward(model, opt, "O5", 0)
        replace(model)
        plans = _counting_plans(monkeypatch)
        opt.step()
        assert plans, "the step took a plan that no longer held"
        return list(model.parameters())

    def inside_block(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            replace(model)
        opt.step()
        return list(model.parameters())

    if replacement == "doubled":
        assert_same(run(monkeypatch, True, "O5", after_exit), run(monkeypatch, True, "O5", inside_block))
    else:
        ours = run(monkeypatch, True, "O5", after_exit)
        for a, b in zip(ours, run(monkeypatch, False, "O5", inside_block)):
            assert a is not None and b is not None
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("order", ["as made", "reversed"])
def test_each_group_steps_on_its_own_weights_grads(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """The exit hands the plan the weights' grads in the order the masters were made; the groups' own order
    (reversed after initialize) decides which grad each master steps on: the bits of the step with the kernels off."""

    def train(kernels: bool) -> list[torch.Tensor | None]:
        monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", kernels)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        groups = [{"params": list(model[0].parameters()), "lr": 1e-2}, {"params": list(model[2].parameters())}]
        opt = torch.optim.AdamW(groups, lr=3e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        if order == "reversed":
            opt.param_groups.reverse()
        try:
            for seed in range(3):
                opt.zero_grad()
                _backward(model, opt, "O2", seed)
                opt.step()
            return _bits(list(model.parameters()))
        finally:
            amp.deinitialize()

    assert_same(train(True), train(False))


@pytest.mark.parametrize("change", ["group added", "parameter replaced"])
def test_a_direct_parameter_new_to_the_groups_is_unscaled(kernels_on_cpu: ModuleType, change: str) -> None:
    """An fp32 parameter (stepped directly, no master) that enters the groups after steps, by a new group or in
    place of another, gets its grad unscaled at the exit: the grad of the unscaled loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    first, second = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=128.0)
    try:
        if change == "parameter replaced":
            opt.add_param_group({"params": [first]})
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).half()
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean() + first.sum(), opt) as scaled:
                scaled.backward()
            opt.step()
        if change == "group added":
            opt.add_param_group({"params": [second]})
        else:
            opt.param_groups[-1]["params"][0] = second
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean() + (second * second).sum(), opt) as scaled:
            scaled.backward()
        assert second.grad is not None
        assert torch.equal(second.grad, 2 * second.detach())
    finally:
        amp.deinitialize()
