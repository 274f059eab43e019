"""Apex's two scaler APIs (``apex.amp.scaler.LossScaler``, ``apex.fp16_utils`` loss scalers) against Apex's rules
written out here from Apex's source, and their private fields that public code touches (``_scale_seq_len``,
``_overflow_buf``, ``_has_overflow``, ``update_scale()``). Both run on ampinit's one engine scaler, and the
fp16_utils overflow check reads the device once, however many gradients it checks."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ampinit.compat.apex.amp.scaler import LossScaler
from ampinit.compat.apex.fp16_utils import DynamicLossScaler
from ampinit.compat.apex.fp16_utils import LossScaler as StaticFp16Scaler
from tests._device import HostSyncCounter


@dataclass
class ApexAmpScaler:
    """apex/amp/scaler.py (e13873de) ``update_scale``, written out: the reference."""

    dynamic: bool
    scale: float
    window: int
    min_scale: float | None
    max_scale: float
    unskipped: int = 0

    def update(self, overflow: bool) -> bool:
        if overflow and self.dynamic:
            should_skip = True
            self.scale = max(self.min_scale, self.scale / 2.0) if self.min_scale else self.scale / 2.0
            self.unskipped = 0
        else:
            should_skip = False
            self.unskipped += 1
        if self.unskipped == self.window and self.dynamic:
            self.scale = min(self.max_scale, self.scale * 2.0)
            self.unskipped = 0
        return should_skip


@dataclass
class ApexFp16Scaler:
    """apex/fp16_utils/loss_scaler.py ``DynamicLossScaler.update_scale``, written out: the reference."""

    scale: float
    factor: float
    window: int
    cur_iter: int = 0
    last_overflow_iter: int = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / self.factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.scale *= self.factor
        self.cur_iter += 1


def grads_with(overflow: bool, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Scaled fp16 model grads (one inf if ``overflow``) and fp32 master grads to unscale them into."""
    model = [
        torch.full((5,), min(0.25 * scale, 2.0**15), dtype=torch.float16),
        torch.full((3, 2), -0.5, dtype=torch.float16),
    ]
    if overflow:
        model[1][1, 0] = float("inf")
    return model, [torch.zeros(5), torch.zeros(3, 2)]


@pytest.mark.parametrize(
    ("window", "min_scale", "max_scale", "init_scale"),
    [(2000, None, 2.0**24, 2.0**16), (3, None, 2.0**18, 2.0**16), (2, 2.0**12, 2.0**24, 2.0**14), (1, None, 4.0, 8.0)],
)
def test_amp_scaler_follows_apexs_update_rule(
    window: int, min_scale: float | None, max_scale: float, init_scale: float
) -> None:
    rng = random.Random(window)
    ours = LossScaler("dynamic", init_scale=init_scale, scale_window=window, min_loss_scale=min_scale,
                      max_loss_scale=max_scale)  # fmt: skip
    apex = ApexAmpScaler(True, min(init_scale, max_scale), window, min_scale, max_scale)
    for _ in range(60):
        overflow = rng.random() < 0.3
        ours.clear_overflow_state()
        model, master = grads_with(overflow, ours.loss_scale())
        ours.unscale(model, master, ours.loss_scale())
        assert ours._has_overflow is overflow
        assert ours.update_scale() is apex.update(overflow)
        assert (ours.loss_scale(), ours._unskipped) == (apex.scale, apex.unskipped)


def test_unscale_writes_master_grads_and_checks_only_model_grads() -> None:
    scaler = LossScaler("dynamic", init_scale=8.0)
    model, master = grads_with(False, 8.0)
    scaler.unscale(model, master, 8.0)
    torch.testing.assert_close(master, [m.float() / 8.0 for m in model], rtol=0, atol=0)
    stashed = [torch.full((5,), 1.5), torch.full((3, 2), float("nan"))]
    out = [torch.zeros(5), torch.zeros(3, 2)]
    scaler.unscale_with_stashed(model, stashed, out)
    torch.testing.assert_close(out[0], model[0].float() / 8.0 + 1.5, rtol=0, atol=0)
    assert not scaler._has_overflow  # Apex checks only the incoming model grads (arg_to_check=0)
    model[0][0] = float("nan")
    scaler.unscale_with_stashed(model, stashed, out)
    assert scaler._has_overflow and scaler._overflow_buf.item() == 1


def test_scale_seq_len_is_the_settable_growth_interval() -> None:
    scaler = LossScaler("dynamic")
    assert scaler._scale_seq_len == 2000
    scaler._scale_seq_len = 10
    scales = []
    for _ in range(10):
        scaler.clear_overflow_state()
        scaler.unscale(*grads_with(False, scaler.loss_scale()), scaler.loss_scale())
        scaler.update_scale()
        scales.append(scaler.loss_scale())
    assert scales == [2.0**16] * 9 + [2.0**17]  # Apex: doubles when _unskipped reaches _scale_seq_len
    with pytest.raises(ValueError, match=re.escape("growth_interval must be an int >= 1, got 0")):
        scaler._scale_seq_len = 0


def test_overflow_buf_written_by_other_code_skips_the_step() -> None:
    """Apex's own FusedAdam path (and code copied from it) raises the scaler's flag with ``_overflow_buf.fill_(1.)``."""
    scaler = LossScaler("dynamic", init_scale=1024.0)
    scaler.clear_overflow_state()
    assert scaler._overflow_buf.item() == 0 and not scaler._has_overflow
    scaler._overflow_buf.fill_(1.0)
    assert scaler._has_overflow
    assert scaler.update_scale() is True and scaler.loss_scale() == 512.0 and scaler._unskipped == 0
    scaler.clear_overflow_state()
    assert scaler._overflow_buf.item() == 0
    scaler._has_overflow = True
    assert scaler.update_scale() is True and scaler.loss_scale() == 256.0


def test_static_scale_never_skips_and_counts_every_update() -> None:
    scaler = LossScaler(128.0)
    apex = ApexAmpScaler(False, 128.0, 2000, None, 2.0**24)
    for overflow in (False, True, True, False):
        scaler.clear_overflow_state()
        model, master = grads_with(overflow, 128.0)
        scaler.unscale(model, master, 128.0)
        assert scaler.update_scale() is apex.update(overflow) is False
        assert (scaler.loss_scale(), scaler._unskipped) == (apex.scale, apex.unskipped)
    assert scaler._scale_seq_len == 2000 and scaler._max_loss_scale == 2.0**24 and not scaler.dynamic


def test_apex_private_fields_read_back() -> None:
    scaler = LossScaler("dynamic", init_scale=2.0**30, min_loss_scale=4.0, max_loss_scale=2.0**20)
    assert (scaler._loss_scale, scaler._max_loss_scale, scaler._min_loss_scale) == (2.0**20, 2.0**20, 4.0)
    scaler._loss_scale = 64.0
    scaler._unskipped = 5
    assert (scaler.loss_scale(), scaler._unskipped) == (64.0, 5)
    with pytest.raises(ValueError, match=re.escape("loss_scale must be a number or 'dynamic', got 'dynamik'")):
        LossScaler("dynamik")


@pytest.mark.parametrize(("factor", "window", "init"), [(2.0, 1000, 2.0**32), (2.0, 3, 16.0), (4.0, 2, 64.0)])
def test_fp16_utils_dynamic_scaler_follows_apexs_rule(factor: float, window: int, init: float) -> None:
    rng = random.Random(window)
    ours = DynamicLossScaler(init_scale=init, scale_factor=factor, scale_window=window)
    apex = ApexFp16Scaler(init, factor, window)
    for _ in range(80):
        overflow = rng.random() < 0.25
        params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
        params[0].grad = torch.ones(4, dtype=torch.float16)
        if overflow:
            params[0].grad[2] = float("nan")
        found = ours.has_overflow(params)
        assert found is overflow
        ours.update_scale(found)
        apex.update(overflow)
        assert ours.cur_scale == apex.scale  # powers of the factor from a power of two: exact in float32
        assert (ours.cur_iter, ours.last_overflow_iter) == (apex.cur_iter, apex.last_overflow_iter)


def test_fp16_utils_scalers_fields_and_errors() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=2)
    scaler.scale_window = 1
    scaler.update_scale(False)
    assert scaler.cur_scale == 16.0 and scaler.loss_scale == 16.0 and scaler.scale_factor == 2.0
    scaler.cur_scale = 1.0
    scaler.update_scale(True)
    assert scaler.cur_scale == 1.0  # Apex's floor
    with pytest.raises(ValueError, match=re.escape("scale_factor must be a number > 1, got 1.0")):
        DynamicLossScaler(scale_factor=1.0)
    static = StaticFp16Scaler(4)
    assert static.loss_scale == 4.0 and static.has_overflow([]) is False
    static.update_scale(True)
    assert static.cur_scale == 4.0


def make_grads(n: int, bad: float | None) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(5, dtype=torch.float16)) for _ in range(n)]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    if bad is not None:
        assert params[-1].grad is not None
        params[-1].grad[2] = bad
    return params


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan"), 65504.0])
def test_fp16_utils_overflow_check_reads_the_host_once(bad: float | None) -> None:
    """``fp16_utils.DynamicLossScaler.has_overflow`` reads the device once, not once per gradient as Apex's loop did.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    params = make_grads(20, bad)
    expected = any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)
    with HostSyncCounter() as counter:
        found = DynamicLossScaler().has_overflow(params)
    assert found == expected
    assert len(counter.syncs) == 1, counter.syncs  # Apex's loop: one per grad tensor (20)
