"""The read-only inf/NaN check (`_torch_kernels.check_finite_`) and where a master step unscales (before or after
widening).

References: ``torch.isfinite(t).all()`` per tensor for the flag, the untouched input for the values, and a plain
fp32 re-implementation of the master step for the training result.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampinit
from ampinit import DynamicLossScale, _torch_kernels, amp
from ampinit._scaler import LossScaler

# Around the size from which bf16 CPU grads are summed instead of going through the unscale kernel.
_SIZES = [1, 7, 4095, _torch_kernels._SUM_CHECK_MIN_NUMEL - 1, _torch_kernels._SUM_CHECK_MIN_NUMEL, 50_001, 1 << 17]
_BAD = [float("inf"), float("-inf"), float("nan")]


def _reference_flag(tensors: list[torch.Tensor]) -> float:
    return 0.0 if all(bool(torch.isfinite(t).all()) for t in tensors) else 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("bad", [None, *_BAD])
def test_flag_matches_isfinite_and_values_are_untouched(dtype: torch.dtype, size: int, bad: float | None) -> None:
    gen = torch.Generator().manual_seed(size)
    grads = [torch.randn(size, generator=gen).to(dtype) for _ in range(3)]
    if bad is not None:
        # At the first, the last and a middle position: vector tails and thread chunk edges included.
        for grad, where in zip(grads, (0, size - 1, size // 2)):
            grad[where] = bad
    before = [g.clone() for g in grads]
    found_inf = torch.zeros(1)
    _torch_kernels.check_finite_(grads, found_inf, torch.ones(1))
    assert found_inf.item() == _reference_flag(grads)
    for got, want in zip(grads, before):
        # Values unchanged (a NaN stays a NaN; torch's unscale kernel, used below the sum size, may rewrite its
        # payload, as it always did).
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_one_bad_value_among_many_tensors_of_mixed_sizes_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(d) for n in _SIZES for d in (torch.bfloat16, torch.float32)]
    found_inf = torch.zeros(1)
    _torch_kernels.check_finite_(grads, found_inf, torch.ones(1))
    assert found_inf.item() == 0.0
    grads[5][3] = float("nan")  # a large bf16 tensor: the summed path
    _torch_kernels.check_finite_(grads, found_inf, torch.ones(1))
    assert found_inf.item() == 1.0


def test_flag_is_only_ever_raised() -> None:
    found_inf = torch.ones(1)
    _torch_kernels.check_finite_([torch.zeros(1 << 16, dtype=torch.bfloat16)], found_inf, torch.ones(1))
    assert found_inf.item() == 1.0


def test_largest_finite_bf16_values_do_not_alarm_until_their_sum_overflows() -> None:
    big = torch.finfo(torch.bfloat16).max
    found_inf = torch.zeros(1)
    # 65536 terms of 2**100 sum to 2**116: finite, no alarm.
    _torch_kernels.check_finite_([torch.full((1 << 16,), 2.0**100, dtype=torch.bfloat16)], found_inf, torch.ones(1))
    assert found_inf.item() == 0.0
    # The documented false alarm: finite terms whose sum passes bf16's (= fp32's) largest value.
    _torch_kernels.check_finite_([torch.full((1 << 16,), big, dtype=torch.bfloat16)], found_inf, torch.ones(1))
    assert found_inf.item() == 1.0


@pytest.mark.parametrize(
    ("setting", "dtype", "device", "before"),
    [
        (1.0, torch.bfloat16, "cpu", True),  # a check only: the fast bf16 sum, on half the bytes
        (1.0, torch.float16, "cpu", True),
        (DynamicLossScale(), torch.bfloat16, "cpu", False),  # a multiply: the fp32 kernel after widening
        (DynamicLossScale(), torch.float16, "cpu", False),  # not exact in fp16
        (DynamicLossScale(), torch.bfloat16, "meta", True),  # off CPU, bf16 power-of-two unscale stays half
        (128.0, torch.bfloat16, "cpu", False),
        (3.0, torch.bfloat16, "meta", False),  # not a power of two: not exact
    ],
)
def test_where_a_master_step_unscales(
    setting: float | DynamicLossScale, dtype: torch.dtype, device: str, before: bool
) -> None:
    assert LossScaler(setting).unscales_before_widening(dtype, device) is before


def _train(level: str, loss_scale: float | str, steps: int = 6) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 256), nn.GELU(), nn.Linear(256, 8))  # 51200 and 2048 weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=loss_scale, verbosity=0)
    x, y = torch.randn(16, 200), torch.randn(16, 8)
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        if step == 2:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    session = ampinit.session_of(opt)
    assert session is not None
    skipped = session.stats().skipped_steps
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    session.close()
    return masters, skipped


def _plain_reference(steps: int = 6) -> list[torch.Tensor]:
    """O5's meaning without ampinit: a bf16 model, fp32 masters, AdamW on the masters, step 2 skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 256), nn.GELU(), nn.Linear(256, 8))
    masters = [p.detach().clone() for p in model.parameters()]
    model.bfloat16()
    opt = torch.optim.AdamW(masters, lr=1e-3)
    x, y = torch.randn(16, 200), torch.randn(16, 8)
    for step in range(steps):
        model.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        if step == 2:
            continue  # the inf loss: no update
        for master, param in zip(masters, model.parameters()):
            master.grad = param.grad.float()
        opt.step()
        with torch.no_grad():
            for master, param in zip(masters, model.parameters()):
                param.copy_(master)
    return masters


@pytest.mark.parametrize("loss_scale", [1.0, "dynamic"])
def test_o5_masters_match_a_plain_reference_with_either_check_order(loss_scale: float | str) -> None:
    """Static 1 checks the bf16 grads by sums before widening; dynamic widens, then unscales in fp32."""
    masters, skipped = _train("O5", loss_scale)
    assert skipped == 1
    for got, want in zip(masters, _plain_reference()):
        assert torch.equal(got, want)
