"""What the O2/O5 kernel step plans on: each launch's grads of one dtype, and the optimizer state ``opt.state``
holds at the step (not what it held when the step last looked)."""

from __future__ import annotations

from types import ModuleType

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
