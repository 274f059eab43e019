"""Adam's step-scalars launches against the reference, bit for bit, on the device under test: through Triton's
interpreter on CPU, compiled on CUDA (the GPU check).

Kept apart from the tests that run the kernels on CPU: the interpreter fixture is module-scoped, and once a test of a
module has asked for it the kernels stay built for the interpreter until the module's last test, where a CUDA test
would run them interpreted on copies of its tensors. Until the seventeenth session these lived in
test_kernel_step_host_work.py, whose earlier tests ask for it: its GPU checks compared interpreted kernels, and the
powers-in-launch test failed there (libdevice's ``pow`` has no interpreter implementation). Each CUDA test now also
asserts the kernels it calls are compiled.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._masters import kernel_step, reference
from tests import _triton
from tests._device import device_under_test, requires_cuda

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")

SETTINGS = [(0.9, 0.999, 1e-3), (0.8, 0.95, 3e-4), (0.0, 0.5, 1.0), (0.99, 0.9999, 1 / 3)]


def _counts(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every count up to 20,000 and 5,000 spread to 10**7 (float32 counts are exact up to 2**24)."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.randint(1, 10**7, (5000,), generator=gen, dtype=dtype)
    return torch.cat([torch.arange(0, 20000, dtype=dtype), spread]).to(device)


@pytest.mark.parametrize(("beta1", "beta2", "lr"), SETTINGS)
def test_the_step_scalars_launch_gives_the_references_bits(
    beta1: float, beta2: float, lr: float, device_kernels: ModuleType
) -> None:
    # The launch that takes the last four ops' place after torch's pow (``kernel_step._scalars``). lr = 1/3 is not
    # an fp32 value: rounded to one first, as an unannotated float argument would be, step sizes move.
    device = device_under_test()
    kernels = device_kernels if device.type == "cpu" else _triton.compiled_kernels()
    counts = _counts(torch.float32, device)[1:]
    powers = torch.pow(torch.tensor([[beta1], [beta2]], dtype=torch.float64, device=device), counts)
    want = reference.adam_step_scalars(counts, beta1, beta2, lr)
    got = kernels.step_scalars_(powers, lr)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int32), want.view(torch.int32))
    # With a flag, the counts are taken back by it (as ``sub_`` would) and the scalars are those of the powers read.
    for raised in (0.0, 1.0):
        steps = counts + 1
        flagged = kernels.step_scalars_(powers, lr, steps, torch.full((1,), raised, device=device))
        assert torch.equal(flagged.view(torch.int32), want.view(torch.int32))
        assert torch.equal(steps, counts + 1 - raised)


@requires_cuda("the counts' powers by libdevice's pow, which Triton's interpreter lacks")
@pytest.mark.parametrize(("beta1", "beta2", "lr"), SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_advancing_step_scalars_launch_gives_the_references_bits(
    beta1: float, beta2: float, lr: float, dtype: torch.dtype
) -> None:
    # What kernel_step.POWERS_IN_LAUNCH waits for: the counts' add_, torch's pow and the step scalars as one launch,
    # the powers libdevice's __nv_pow where torch's pow kernel calls the CUDA math library's pow, the same bits at
    # every count, float32 counts (fused and capturable groups) and float64 ones (a float64 default dtype), with
    # and without a flag.
    kernels = _triton.compiled_kernels()
    counts = _counts(dtype, torch.device("cuda"))
    betas = torch.tensor([[beta1], [beta2]], dtype=torch.float64, device="cuda")
    for flag in (None, 0.0, 1.0):
        found_inf = None if flag is None else torch.full((1,), flag, device="cuda")
        want_steps, got_steps = counts.clone(), counts.clone()
        want = reference.advance_step_scalars_(want_steps, betas, lr, found_inf)
        got = kernels.advance_step_scalars_(got_steps, betas, lr, found_inf)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), flag
        assert got_steps.dtype == dtype and torch.equal(got_steps, want_steps), flag


def _trained(level: str, powers_in_launch: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Weights, masters, moments and counts after five O2/O5 steps of a small model with torch's AdamW, one of them
    skipped by an inf."""
    monkeypatch.setattr(kernel_step, "POWERS_IN_LAUNCH", powers_in_launch)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the layers' initial weights
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        for step in range(5):
            x = torch.randn(32, 64, generator=gen).cuda()
            loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
            if step == 2:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        state = [opt.state[m] for group in opt.param_groups for m in group["params"]]
        masters = [m.detach().clone() for group in opt.param_groups for m in group["params"]]
        moments = [s[k].clone() for s in state for k in ("exp_avg", "exp_avg_sq", "step")]
        return [p.detach().clone() for p in model.parameters()] + masters + moments
    finally:
        amp.deinitialize()


@requires_cuda("the counts' powers by libdevice's pow, which Triton's interpreter lacks")
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_powers_in_the_launch_train_as_torchs_pow(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The step with POWERS_IN_LAUNCH on and off from the same start: every weight, master, moment and count the same
    # bits (the skipped step's counts taken back in both). Run by the GPU check whatever the flag's default.
    _triton.compiled_kernels()
    with monkeypatch.context() as patch:
        want = _trained(level, False, patch)
    with monkeypatch.context() as patch:
        got = _trained(level, True, patch)
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and torch.equal(g, w), index
