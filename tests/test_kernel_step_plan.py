"""What the O2/O5 kernel step plans on: each launch's grads of one dtype, and the optimizer state ``opt.state``
holds at the step (not what it held when the step last looked)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")

BETA1 = 0.9


def _session(tensors: int) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(tensors)])
    opt = torch.optim.AdamW(params.parameters(), lr=1e-2, betas=(BETA1, 0.999), fused=True)
    amp.initialize(params, opt, opt_level="O2", verbosity=0, loss_scale=1.0)  # type: ignore[arg-type]
    return list(params), opt


def _steps(weights: list[nn.Parameter], opt: torch.optim.Optimizer, count: int, swap_at: int | None = None) -> None:
    """``count`` steps of the open session, each after a backward that sets every weight's grad to 0.5 by hand;
    ``swap_at``: before that step, one weight is given a bf16 grad by ``.data`` swaps (bf16 weight, its grad set,
    fp16 again)."""
    session = amp.current_session()
    assert session is not None
    anchor = torch.zeros((), requires_grad=True)
    for step in range(count):
        with session.scale_loss(anchor * 1.0, opt) as scaled:
            scaled.backward()
            for w in weights:
                w.grad = torch.full_like(w, 0.5)
            if step == swap_at:
                odd = weights[1]
                odd.data = odd.data.bfloat16()
                odd.grad = torch.full_like(odd, 0.5)
                odd.data = odd.data.half()
                assert (odd.dtype, odd.grad.dtype) == (torch.float16, torch.bfloat16)
        opt.step()


def _weights_after_two_steps(swap_grad_dtype: bool) -> list[torch.Tensor]:
    """Two O2 steps over three fp16 weights; with ``swap_grad_dtype``, the second with a bf16 grad among them."""
    weights, opt = _session(3)
    try:
        _steps(weights, opt, 2, swap_at=1 if swap_grad_dtype else None)
        return [w.detach().clone() for w in weights]
    finally:
        amp.deinitialize()


def test_a_weight_whose_grad_has_another_dtype_steps_as_on_torchs_path(kernels_on_cpu: ModuleType) -> None:
    # A launch reads its grads as one dtype: the kernel step must leave this step to torch's path (which widens
    # each grad by its own dtype), not launch bf16 bits as fp16 or refuse the step (on main: a ValueError from
    # the grads' table). 0.5 is exact in both halves, so torch's path gives the same weights as all-fp16 grads.
    got = _weights_after_two_steps(swap_grad_dtype=True)
    want = _weights_after_two_steps(swap_grad_dtype=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_kernel_step_reads_the_state_opt_state_holds_now(kernels_on_cpu: ModuleType) -> None:
    # The step keeps where it found each parameter's state; replacing an entry (the same keys, in the same order)
    # must be seen: the replaced parameter starts Adam again (step 1, exp_avg = (1 - beta1) * grad), the others
    # go on counting.
    weights, opt = _session(4)
    session = amp.current_session()
    assert session is not None
    anchor = torch.zeros((), requires_grad=True)
    grad = 0.25
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for w in weights:
                    w.grad = torch.full_like(w, grad)
            if step == 2:
                reset = opt.param_groups[0]["params"][2]
                opt.state[reset] = {}
            opt.step()
        masters = opt.param_groups[0]["params"]
        counts = [float(opt.state[m]["step"]) for m in masters]
        assert counts == [3.0, 3.0, 1.0, 3.0]
        first_moment = opt.state[masters[2]]["exp_avg"]
        assert torch.equal(first_moment, torch.full_like(first_moment, (1 - BETA1) * grad))
    finally:
        session.close()


def test_closing_the_session_lets_the_masters_go(kernels_on_cpu: ModuleType) -> None:
    # The step keeps the parameters it found state for (the fp32 masters); once the session gives the optimizer
    # its model parameters back, nothing of amp may keep the masters (4 B per parameter) alive.
    import gc
    import weakref

    weights, opt = _session(3)
    try:
        _steps(weights, opt, 2)
        masters = [weakref.ref(m) for m in opt.param_groups[0]["params"]]
        assert all(m() is not None and m().dtype == torch.float32 for m in masters)
    finally:
        amp.deinitialize()
    gc.collect()
    assert [m() for m in masters] == [None, None, None]
    assert all(p is w for p, w in zip(opt.param_groups[0]["params"], weights, strict=True))  # the model's, back


def test_a_master_given_other_memory_is_checked_again(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plan checks a master's dtype, device and contiguity once, and after that only that it is the same tensor
    # at the same data pointer (kernel_step._checked). A master given other memory by a .data assignment, here not
    # contiguous, must be checked again and the step left to torch's path; taken by the kernels it would reach the
    # launch tables, which refuse it (ValueError).
    from ampinit._masters import kernel_step

    weights, opt = _session(3)
    try:
        _steps(weights, opt, 2)
        master = opt.param_groups[0]["params"][1]
        strided = torch.empty(2 * master.numel())[::2]
        strided.copy_(master.detach())
        master.data = strided
        before = master.detach().clone()
        taken: list[int] = []
        run_kernels = kernel_step.run_kernels

        def spy(*args: object, **kwargs: object) -> None:
            taken.append(1)
            run_kernels(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(kernel_step, "run_kernels", spy)
        _steps(weights, opt, 1)
        assert taken == []
        assert not torch.equal(master.detach(), before)  # torch's step moved it
    finally:
        amp.deinitialize()


def _after_a_change(change: str) -> list[torch.Tensor]:
    """Weights and masters after two O2 steps, the second with ``change`` made between its scale_loss exit and its
    step, the block having handed over grads of 0.5 (of 0.25 where nothing changes, ``""``): ``replace``: new grad
    tensors of 0.25; ``grads``: each grad given other memory holding 0.25 by a ``.data`` assignment; ``masters``:
    each master given a copy of itself by one. What the exit checked stays alive (its memory still holds 0.5)."""
    weights, opt = _session(3)
    session = amp.current_session()
    assert session is not None
    anchor = torch.zeros((), requires_grad=True)
    try:
        _steps(weights, opt, 1)
        with session.scale_loss(anchor * 1.0, opt) as scaled:
            scaled.backward()
            for w in weights:
                w.grad = torch.full_like(w, 0.5 if change in ("replace", "grads") else 0.25)
        kept = [w.grad.data for w in weights if w.grad is not None]
        for w in weights:
            assert w.grad is not None
            if change == "replace":
                w.grad = torch.full_like(w, 0.25)
            elif change == "grads":
                w.grad.data = torch.full_like(w, 0.25)
        masters = opt.param_groups[0]["params"]
        for m in masters if change == "masters" else []:
            kept.append(m.data)
            m.data = m.data.clone()
        opt.step()
        assert len(kept) >= 3
        return [w.detach().clone() for w in weights] + [m.detach().clone() for m in masters]
    finally:
        amp.deinitialize()


def test_grads_replaced_after_the_exit_are_the_ones_the_step_reads(kernels_on_cpu: ModuleType) -> None:
    # The exit's finite check reads the grads' data pointers and hands them to the step's launch, which then need
    # not read them again: only while the step's plan holds the same grad tensors. Grads replaced in between are
    # planned afresh and read at their own addresses (a launch through the check's pointers would read 0.5).
    got = _after_a_change("replace")
    want = _after_a_change("")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _o2_over_three_weights(
    make_opt: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer], device_decides: bool
) -> tuple[torch.optim.Optimizer, list[nn.Parameter], Any]:
    """An O2 session over three weights of 16 elements and the optimizer ``make_opt`` makes of them; the skip
    decided on the device (``sync_free``) or on the host."""
    gen = torch.Generator().manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(3)])
    opt = make_opt(params.parameters())
    amp.initialize(params, opt, opt_level="O2", verbosity=0, sync_free=device_decides)  # type: ignore[arg-type]
    session = amp.current_session()
    assert session is not None
    return opt, list(params), session


def _refused_then_retried(refuse: bool, overflow: bool, device_decides: bool) -> list[torch.Tensor]:
    """Weights, masters, moments and counts after three O2 steps (dynamic scale) with grads of 0.5, the second's
    grads an inf when ``overflow``; with ``refuse``, that step is first attempted with bf16 first moments in
    ``opt.state`` (refused), then, the moments put back, called again."""
    opt, weights, session = _o2_over_three_weights(
        lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(BETA1, 0.999), fused=True), device_decides
    )
    anchor = torch.zeros((), requires_grad=True)
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for w in weights:
                    w.grad = torch.full_like(w, math.inf if overflow and step == 1 else 0.5)
            masters = opt.param_groups[0]["params"]
            if refuse and step == 1:
                kept = [opt.state[m]["exp_avg"] for m in masters]
                for m in masters:
                    opt.state[m]["exp_avg"] = opt.state[m]["exp_avg"].bfloat16()
                with pytest.raises(ValueError, match=r"reads every exp_avg as torch.float32, got torch.bfloat16"):
                    opt.step()
                for m, moment in zip(masters, kept):
                    opt.state[m]["exp_avg"] = moment
            opt.step()
        states = [opt.state[m] for m in masters]
        moments = [state[key] for state in states for key in ("exp_avg", "exp_avg_sq")]
        counts = [state["step"].reshape(1) for state in states]
        return [w.detach().clone() for w in weights] + [m.detach().clone() for m in masters] + moments + counts
    finally:
        amp.deinitialize()


def _retry_is_the_step(run: Callable[..., list[torch.Tensor]], *args: Any) -> list[torch.Tensor]:
    """``run(True, *args)`` (a step refused, the state put back, the step retried) against ``run(False, *args)`` (the
    same steps never refused), every tensor bit for bit; returns the refused run's tensors."""
    got, want = run(True, *args), run(False, *args)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return got


@pytest.mark.parametrize(
    ("overflow", "device_decides"),
    # An overflow decided on the host skips the step before anything reads the moments: nothing to refuse.
    [(False, False), (False, True), (True, True)],
    ids=["clean-host-decides", "clean-device-decides", "overflow-device-decides"],
)
def test_a_refused_step_changes_nothing_and_its_retry_is_the_step(
    kernels_on_cpu: ModuleType, overflow: bool, device_decides: bool
) -> None:
    # The kernels read an optimizer state's moments through raw pointers as fp32: bf16 moments put in opt.state
    # were written past their end until the eighteenth session (the heap corrupted, the process aborted). They are
    # refused when the launch's tables are built, after the step counts advanced: the counts must go back (a count
    # one ahead moves every later bias correction), and the step's skip decision must wait for the retried step
    # (taken as clean, an inf grad reaches every master). The retry, the moments put back, must then be the step
    # that was never refused, in every bit.
    got = _retry_is_the_step(_refused_then_retried, overflow, device_decides)
    if overflow:
        assert all(torch.isfinite(t).all() for t in got)


def _sgd_refused_then_retried(refuse: bool) -> list[torch.Tensor]:
    """Three O2 steps of SGD with momentum and dampening over three weights, the host deciding; the third weight
    has no grad at the first step, so the second starts its momentum buffer while the others' go on. With
    ``refuse``, that second step is first attempted with the first two weights' buffers in bf16 (refused), then,
    the buffers put back, called again."""
    opt, weights, session = _o2_over_three_weights(
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5), False
    )
    anchor = torch.zeros((), requires_grad=True)
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for i, w in enumerate(weights):
                    if step > 0 or i < 2:
                        w.grad = torch.full_like(w, 0.5 + i + step)
            masters = opt.param_groups[0]["params"]
            if refuse and step == 1:
                kept = [opt.state[m]["momentum_buffer"] for m in masters[:2]]
                for m, buffer in zip(masters, kept):
                    opt.state[m]["momentum_buffer"] = buffer.bfloat16()
                with pytest.raises(ValueError, match=r"reads every momentum_buffer as torch.float32, got torch.bf"):
                    opt.step()
                # Nothing of the refused step stands: the third weight's buffer not started (and no weight moved:
                # the comparison below).
                assert "momentum_buffer" not in opt.state[masters[2]]
                for m, buffer in zip(masters, kept):
                    opt.state[m]["momentum_buffer"] = buffer
            opt.step()
        buffers = [opt.state[m]["momentum_buffer"] for m in masters]
        return [w.detach().clone() for w in weights] + [m.detach().clone() for m in masters] + buffers
    finally:
        amp.deinitialize()


def test_a_refused_sgd_step_starts_no_momentum_buffer_and_its_retry_is_the_step(kernels_on_cpu: ModuleType) -> None:
    # An SGD step launches the buffers found in opt.state and the buffers it starts apart (a first momentum step
    # takes the grad as the buffer). The refusable launch, over buffers found in opt.state, goes first: a refusal
    # once came after the starting launch, whose weights had stepped and whose buffers stayed, so the retry stepped
    # them twice and took the started buffer as a later one (momentum * buffer + (1 - dampening) * grad).
    _retry_is_the_step(_sgd_refused_then_retried)


def _two_groups_refused_then_retried(refuse: bool, optimizer: str, device_decides: bool) -> list[torch.Tensor]:
    """Three O2 steps over three weights in two param groups (one weight, then two), each launched apart; with
    ``refuse``, the second step is first attempted with the second group's state in bf16 (refused), then, the state
    put back, called again."""

    def make_opt(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        first, *rest = params
        groups = [{"params": [first]}, {"params": rest, "weight_decay": 0.0}]
        if optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=1e-2, betas=(BETA1, 0.999), fused=True)
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.5)

    opt, weights, session = _o2_over_three_weights(make_opt, device_decides)
    key = "exp_avg" if optimizer == "adamw" else "momentum_buffer"
    anchor = torch.zeros((), requires_grad=True)
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for i, w in enumerate(weights):
                    w.grad = torch.full_like(w, 0.5 + i + step)
            masters = [m for group in opt.param_groups for m in group["params"]]
            if refuse and step == 1:
                later = opt.param_groups[1]["params"]
                kept = [opt.state[m][key] for m in later]
                for m, state in zip(later, kept):
                    opt.state[m][key] = state.bfloat16()
                with pytest.raises(ValueError, match=rf"reads every {key} as torch.float32, got torch.bfloat16"):
                    opt.step()
                for m, state in zip(later, kept):
                    opt.state[m][key] = state
            opt.step()
        states = [opt.state[m][k] for m in masters for k in sorted(opt.state[m])]
        return [w.detach().clone() for w in weights] + [m.detach().clone() for m in masters] + states
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("device_decides", [False, True], ids=["host-decides", "device-decides"])
def test_a_step_of_several_launches_refused_at_a_later_one_changes_nothing(
    kernels_on_cpu: ModuleType, optimizer: str, device_decides: bool
) -> None:
    # Each param group is a launch of its own. The second group's state is refused when its tables are made, which
    # happened at its own launch, after the first group's had stepped its weights (and advanced its counts): the
    # retry stepped them twice. A step of several launches now makes every launch's tables before the first.
    _retry_is_the_step(_two_groups_refused_then_retried, optimizer, device_decides)


def test_an_optimizer_state_of_other_sizes_is_refused(kernels_on_cpu: ModuleType) -> None:
    # The kernels read every list with the masters' sizes: a moment of another size (an optimizer state_dict of
    # another model loaded) would be read and written out of its bounds. torch's own fused step refuses it too.
    weights, opt = _session(3)
    try:
        _steps(weights, opt, 1)
        master = opt.param_groups[0]["params"][0]
        opt.state[master]["exp_avg"] = torch.zeros(8)
        with pytest.raises(ValueError, match=r"same sizes in every list .* got \[8, 16, 16\] and \[16, 16, 16\]"):
            _steps(weights, opt, 1)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("move", ["grads", "masters"])
def test_memory_moved_between_the_exit_and_the_step_is_where_the_step_reads_and_writes(
    kernels_on_cpu: ModuleType, move: str
) -> None:
    # The exit hands the grads' and masters' pointers to the step (no second read of their sizes), but the step reads
    # the pointers again: a tensor given other memory in between (p.grad.data = ..., as gradient processing after
    # the block may do) is read and written at its new address, never through the one the exit saw.
    got = _after_a_change(move)
    want = _after_a_change("")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
