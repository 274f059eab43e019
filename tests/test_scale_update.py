"""A dynamic loss scale's update in one launch (``triton_kernels.update_scale_``) against torch's three ops
(``_amp_update_scale_``, ``clamp_``, ``reciprocal``: ``reference.update_scale_``), bit for bit, on the device under
test: through Triton's interpreter on CPU, compiled on CUDA (the GPU check; ``device_kernels``, tests/conftest.py)."""

from __future__ import annotations

import itertools
import math
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import kernel_step, reference
from tests._device import device_under_test

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")

SCALES = [1.0, 65536.0, 3.0, 0.1, 2.0**24, 2.0**-20, 3.0e38, 1e-45, math.nan, math.inf]
TRACKERS = [0, 1, 2, 1999]
FLAGS = [0.0, 1.0, math.nan]
# (growth, backoff, interval, min, max): Apex's defaults, a floor, factors that round, a ceiling below the floor, no
# ceiling at all (a growth to inf is then refused by the update itself, not the clamp).
CONFIGS = [
    (2.0, 0.5, 2000, None, 2.0**24),
    (2.0, 0.5, 3, 1.0, 2.0**24),
    (3.0, 0.25, 2, 0.5, 100.0),
    (1.5, 0.7, 1, None, 1e38),
    (2.0, 0.5, 2, 8.0, 4.0),
    (2.0, 0.5, 1, None, math.inf),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, any NaN equal to any NaN."""
    both_nan = bool(a.isnan().all() and b.isnan().all()) if a.is_floating_point() else False
    return both_nan or torch.equal(a.view(torch.int32), b.view(torch.int32))


# The interpreter computes in NumPy, which warns where an IEEE result is inf or NaN (3e38 grown, the reciprocal of
# a subnormal scale or of one backed off to 0, a NaN scale): the results the test checks, not errors.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_scale_update_launch_gives_torchs_bits(device_kernels: ModuleType) -> None:
    device = device_under_test()
    cases = list(itertools.product(SCALES, TRACKERS, FLAGS, CONFIGS))
    for value, count, raised, (growth, backoff, interval, low, high) in cases:
        scale = torch.tensor(value, device=device)
        tracker = torch.tensor(count, dtype=torch.int32, device=device)
        want_scale, want_tracker = scale.clone(), tracker.clone()
        flag = torch.tensor([raised], device=device)
        got = device_kernels.update_scale_(scale, tracker, flag, growth, backoff, interval, low, high)
        want = reference.update_scale_(want_scale, want_tracker, flag, growth, backoff, interval, low, high)
        case = (value, count, raised, growth, backoff, interval, low, high)
        assert _same(scale, want_scale) and torch.equal(tracker, want_tracker), case
        assert got.shape == want.shape and _same(got, want), case


def test_the_scale_update_refuses_what_it_cannot_read(device_kernels: ModuleType) -> None:
    device = device_under_test()
    scale, tracker = torch.tensor(4.0, device=device), torch.tensor(0, dtype=torch.int32, device=device)
    flag = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match=r"0-d float32 scale and a 0-d int32 tracker, got a 0-d torch.float64"):
        device_kernels.update_scale_(scale.double(), tracker, flag, 2.0, 0.5, 2, None, 8.0)
    with pytest.raises(ValueError, match=r"got a 0-d torch.float32 scale and a 1-d torch.int32 tracker"):
        device_kernels.update_scale_(scale, tracker.reshape(1), flag, 2.0, 0.5, 2, None, 8.0)
    with pytest.raises(ValueError, match=r"one-element float32 flag, got torch.float32 \(2,\)"):
        device_kernels.update_scale_(scale, tracker, torch.zeros(2, device=device), 2.0, 0.5, 2, None, 8.0)
    with pytest.raises(ValueError, match=r"on one device, got"):
        device_kernels.update_scale_(scale, tracker, flag.to("meta"), 2.0, 0.5, 2, None, 8.0)
    assert scale.item() == 4.0 and tracker.item() == 0  # nothing changed


def _o2_run(fused: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Weights and the scale's state after eight O2 steps of a small model, a scale that grows every second clean
    step and overflows planted in three backwards; its updates in one launch (``fused``) or torch's ops."""
    device = device_under_test()
    launches: list[None] = []
    with monkeypatch.context() as patch:
        if device.type == "cpu":
            patch.setattr(kernel_step, "TRITON_ON_CPU", True)
        if fused:
            one_launch = kernel_step.scale_update_for(device)
            assert one_launch is not None

            def counted(*args: Any) -> torch.Tensor:
                launches.append(None)
                return one_launch(*args)

            patch.setattr(kernel_step, "scale_update_for", lambda device: counted)
        else:
            patch.setattr(kernel_step, "scale_update_for", lambda device: None)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss_scale = ampinit.DynamicLossScale(init_scale=2.0**10, growth_interval=2, max_scale=2.0**12)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=loss_scale)
        session = amp.current_session()
        assert session is not None
        try:
            gen = torch.Generator().manual_seed(1)
            for step in range(8):
                x = torch.randn(4, 8, generator=gen).to(device, torch.float16)
                with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                    scaled.backward()
                    if step in (2, 3, 6):
                        model[0].bias.grad[0] = math.inf  # type: ignore[index]
                opt.step()
                opt.zero_grad()
            assert len(launches) == (8 if fused else 0)  # every exit's update in one launch, or none
            (scaler,) = session.scalers
            state = [torch.tensor([scaler.loss_scale(), scaler.unskipped()]), scaler.inv_scale.cpu()]
            return [p.detach().cpu().clone() for p in model.parameters()] + state
        finally:
            session.close()


def test_o2_trains_with_the_one_launch_update_as_with_torchs_ops(
    device_kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session's scale takes the kernels' update wherever the master step takes the kernels (O2's exit); the
    # weights, the scale, its clean-step count and 1/scale must be torch's ops' after growths, back-offs and a
    # ceiling (2**10 grows to the 2**12 ceiling and backs off at each planted overflow).
    fused, unfused = _o2_run(True, monkeypatch), _o2_run(False, monkeypatch)
    assert all(_same(a, b) if a.dtype != torch.float64 else torch.equal(a, b) for a, b in zip(fused, unfused))
