"""The grads' finite check where the master step's kernels run (CUDA): its one Triton launch
(``triton_kernels.check_finite_``) for every group of contiguous plain grads, instead of inf-norms for the bf16 ones
torch's unscale kernel refuses (a reduction with an output tensor per grad, a ``stack`` of them and five small ops)
and of torch's unscale kernel by 1 for the others (which writes every grad back). Here CPU stands in for CUDA: its
unscale row is made CUDA's (bf16 refused) and the kernels run under Triton's interpreter. The flag decides skips, so
training must be bitwise what the norms route gives, with an overflowing step among the steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit
from ampinit import _torch_kernels, amp
from ampinit._masters import grads as grads_module
from benchmarks import kernel_step_host
from tests._host_work import counted_checks
from tests.conftest import make_problem


@pytest.fixture
def cuda_unscale_rule_on_cpu() -> Iterator[None]:
    """CPU's unscale kernel taken to accept what CUDA's does: no bf16."""
    with kernel_step_host.cuda_unscale_rule():
        yield


class Recorder:
    """A ``FusedCheck`` that records what it is offered (and whether the caller said the grads were checked) and
    answers ``runs``, raising the flag as the kernel would."""

    def __init__(self, runs: bool) -> None:
        self.runs = runs
        self.offered: list[list[torch.Tensor]] = []
        self.checked: list[bool] = []

    def __call__(self, grads: list[torch.Tensor], flag: torch.Tensor, checked: bool) -> bool:
        self.offered.append(grads)
        self.checked.append(checked)
        if self.runs and not all(bool(g.isfinite().all()) for g in grads):
            flag.fill_(1.0)
        return self.runs


def bf16_grads(bad: float | None = None) -> list[torch.Tensor]:
    grads = [torch.randn(5).bfloat16(), torch.randn(3, 4).bfloat16()]
    if bad is not None:
        grads[1][2, 1] = bad
    return grads


def check(grads: list[torch.Tensor], fused: Callable[..., bool] | None) -> float:
    flag = torch.zeros(1)
    _torch_kernels.check_finite_(grads, flag, torch.ones(1), None, fused)
    return flag.item()


@pytest.mark.usefixtures("cuda_unscale_rule_on_cpu")
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_a_refused_dtype_is_offered_to_the_fused_check_and_the_norms_do_not_run(
    bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    norms: list[object] = []
    monkeypatch.setattr(_torch_kernels, "_check_by_norms", lambda group, flag: norms.append(group))
    fused = Recorder(runs=True)
    grads = bf16_grads(bad)
    assert check(grads, fused) == (0.0 if bad is None else 1.0)
    assert len(fused.offered) == 1 and all(a is b for a, b in zip(fused.offered[0], grads))
    assert norms == []


@pytest.mark.usefixtures("cuda_unscale_rule_on_cpu")
@pytest.mark.parametrize("bad", [None, float("-inf")])
def test_a_fused_check_that_does_not_run_leaves_the_group_to_the_norms(bad: float | None) -> None:
    fused = Recorder(runs=False)
    assert check(bf16_grads(bad), fused) == (0.0 if bad is None else 1.0)
    assert len(fused.offered) == 1


def test_the_caller_says_whether_the_grads_were_checked() -> None:
    """Without a key the grads are offered unchecked (the fused check looks at them itself, once it knows it runs);
    with one (the kernel step's plan has checked each) they are offered as checked."""
    fused = Recorder(runs=True)
    grads = bf16_grads()
    check(grads, fused)
    _torch_kernels.check_finite_(grads, torch.zeros(1), torch.ones(1), (torch.device("cpu"), (torch.bfloat16,)), fused)
    assert fused.checked == [False, True]


@pytest.mark.usefixtures("cuda_unscale_rule_on_cpu")
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_only_groups_of_contiguous_plain_tensors_reach_the_kernel(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, bad: float | None
) -> None:
    """A strided grad or a tensor subclass in a group unchecked by the caller: the kernel check declines, no launch,
    and the norms find what is there; told the grads were checked, it does not look again."""
    launches = counted_checks(kernels_on_cpu, monkeypatch)
    strided = torch.randn(4, 6).bfloat16().t()
    marked = torch.randn(4).bfloat16().as_subclass(_Marked)
    for group in ([torch.randn(3).bfloat16(), strided], [marked]):
        if bad is not None:
            group[-1][0] = bad
        assert not grads_module._kernel_check(group, torch.zeros(1), False)
        assert check(group, grads_module._kernel_check) == (0.0 if bad is None else 1.0)
    assert launches == []
    assert grads_module._kernel_check([torch.randn(3).bfloat16()], torch.zeros(1), True) and launches == [1]


@pytest.mark.parametrize("bad", [None, float("inf")])
def test_kinds_the_unscale_kernel_takes_are_offered_too_and_it_does_not_run(
    bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 and fp32 (CUDA's unscale kernel takes them, but writes each grad back as it reads it): one offer per
    group, and where the fused check runs, torch's kernel does not."""
    unscaled: list[object] = []
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", lambda *args: unscaled.append(args))
    fused = Recorder(runs=True)
    half, single = torch.randn(4).half(), torch.randn(2)
    if bad is not None:
        single[1] = bad
    assert check([half, single], fused) == (0.0 if bad is None else 1.0)
    assert sorted(len(group) for group in fused.offered) == [1, 1]
    assert {id(t) for group in fused.offered for t in group} == {id(half), id(single)}
    assert unscaled == []
    # A fused check that does not run leaves them to torch's kernel, which finds the same.
    declining = Recorder(runs=False)
    monkeypatch.undo()
    assert check([half, single], declining) == (0.0 if bad is None else 1.0)
    assert len(declining.offered) == 2


class _Marked(torch.Tensor):
    pass


# -- inside amp: O5's check takes the kernel, bitwise the norms route's training ---------------------------------
STEPS = 4
BAD_STEP = 2  # its batch holds an inf: the check must raise the flag and the step be skipped


def train(master_weights: bool | str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(grads_module, "_kernel_check", lambda grads, flag, checked, keys=None: False)
        model, x, y = make_problem(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=master_weights, verbosity=0)
        stepped = []
        try:
            for step in range(STEPS):
                batch = x.clone()
                if step == BAD_STEP:
                    batch[0, 0] = float("inf")
                before = [p.detach().clone() for p in model.parameters()]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(batch).float(), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                stepped.append(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            session = ampinit.session_of(opt)
            assert session is not None
            masters = [m for p in model.parameters() if (m := session.master_for(p)) is not None]
            return {
                "stepped": stepped,
                "weights": [p.detach().clone() for p in model.parameters()],
                "masters": masters,
                "state": opt.state_dict()["state"],
                "amp": amp.state_dict(),
            }
        finally:
            ampinit.deinitialize()


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("cuda_unscale_rule_on_cpu")
@pytest.mark.parametrize("master_weights", [True, "remainder"], ids=["fp32-masters", "remainder"])
def test_o5_checks_bf16_grads_in_one_kernel_launch_and_trains_as_the_norms_route(
    kernels_on_cpu: ModuleType, master_weights: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches = counted_checks(kernels_on_cpu, monkeypatch)
    fused = train(master_weights, True, monkeypatch)
    # Per step: the bf16 weights' grads, then BatchNorm's fp32 ones (which O5 leaves fp32 and steps directly).
    assert launches == [len(fused["weights"]) - 2, 2] * STEPS
    assert fused["stepped"] == [step != BAD_STEP for step in range(STEPS)]  # the bad step, and only it, skipped
    normed = train(master_weights, False, monkeypatch)
    assert len(launches) == 2 * STEPS  # the norms route launched nothing
    for key in ("weights", "masters"):
        assert len(fused[key]) == len(normed[key])
        for a, b in zip(fused[key], normed[key]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
    assert fused["amp"] == normed["amp"] and fused["stepped"] == normed["stepped"]
    assert fused["state"].keys() == normed["state"].keys()
    for index, state in fused["state"].items():
        for name, value in state.items():
            other = normed["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (index, name)


@pytest.mark.usefixtures("cuda_unscale_rule_on_cpu")
def test_the_kernel_check_runs_no_norm_or_stack(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = torch.zeros(1)
    grads = bf16_grads()
    calls = _Calls()
    with calls:
        _torch_kernels.check_finite_(grads, flag, torch.ones(1), None, grads_module._kernel_check)
    assert not {"_foreach_norm", "stack", "linalg_vector_norm"} & {n.split(".")[0] for n in calls.names}
    grads[0][1] = float("nan")
    _torch_kernels.check_finite_(grads, flag, torch.ones(1), None, grads_module._kernel_check)
    assert flag.item() == 1.0


# -- the benchmark's two routes (benchmarks/kernel_step_host.py --check-routes) measure what they name -------------
@pytest.mark.parametrize("route", ["norms", "kernel"])
def test_the_host_benchmarks_check_routes_take_the_route_they_name(
    route: str, triton_interpreter: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[str] = []
    norms = _torch_kernels._check_by_norms
    monkeypatch.setattr(_torch_kernels, "_check_by_norms", lambda g, f: taken.append("norms") or norms(g, f))
    with kernel_step_host.kernel_path_without_launches(), kernel_step_host.cuda_unscale_rule():
        check = triton_interpreter.check_finite_
        monkeypatch.setattr(triton_interpreter, "check_finite_", lambda g, f: taken.append("kernel") or check(g, f))
        variant = kernel_step_host.CheckRoute(4, 64, route)
        try:
            for _ in range(2):
                variant.iteration()
        finally:
            variant.close()
    assert taken == [route, route]
