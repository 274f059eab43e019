"""The stuck-weight report (``initialize(stuck_weights_every=N)``, ``amp.stats().stuck_weights``): per parameter
tensor, the fraction of elements whose nonzero update the model's dtype rounded away.

The reference is computed here from the weights before and after each step: an element is stuck when its bits did
not change while its AdamW update (no weight decay: ``-lr * m_hat / (sqrt(v_hat) + eps)``) was nonzero, that is
where ``exp_avg`` is nonzero after the step. With ``betas=(0, 0)`` the update is ``-lr * g / (|g| + eps)``: every
element with a gradient moves by ``lr``, so a tensor is healthy or stuck by its ``lr`` alone. The planted tensor
is a LayerNorm weight at 1.0 trained with ``lr=1e-4``, below half a bf16 ulp of 1.0 (2**-8); the healthy tensors
(weights below 1 in magnitude) train with ``lr=0.01``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests._device import HostSyncCounter

PLANTED = "1.weight"


def _problem() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(
        [
            {"params": model[1].parameters(), "lr": 1e-4},
            {"params": [*model[0].parameters(), *model[2].parameters()], "lr": 0.01},
        ],
        betas=(0.0, 0.0),
        weight_decay=0.0,
    )
    return model, opt, torch.randn(128, 16), torch.randn(128, 8)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, poison: bool = False) -> None:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def _exp_avg_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's ``exp_avg``, found by position: the param groups hold masters or the weights themselves."""
    order = [*model[1].parameters(), *model[0].parameters(), *model[2].parameters()]
    names = {id(p): name for name, p in model.named_parameters()}
    in_groups = [p for group in opt.param_groups for p in group["params"]]
    return {names[id(w)]: opt.state[p]["exp_avg"] for w, p in zip(order, in_groups)}


@pytest.mark.parametrize("master_weights", [False, True, "remainder", "remainder8", "stochastic"])
def test_a_planted_stuck_tensor_is_flagged_and_healthy_ones_are_not(master_weights: object) -> None:
    # "stochastic" rounds each update into the bf16 weight: the planted weights move with probability
    # lr / ulp(1.0) = 1.3% per step (the seed is fixed, so the outcome is too), the healthy ones always.
    model, opt, x, y = _problem()
    model, opt = amp.initialize(
        model, opt, opt_level="O5", master_weights=master_weights, stuck_weights_every=1, verbosity=0
    )
    try:
        for step in range(1, 4):
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            _step(model, opt, x, y)
            exp_avg = _exp_avg_by_name(model, opt)
            expected = {}
            for name, p in model.named_parameters():
                assert p.dtype == torch.bfloat16
                unchanged = p.detach().view(torch.int16) == before[name].view(torch.int16)
                expected[name] = (unchanged & (exp_avg[name] != 0)).float().mean().item()
            report = amp.stats().stuck_weights
            assert report is not None and report.step == step
            assert dict(report.fractions) == pytest.approx(expected, abs=0)
            assert report.fractions[PLANTED] >= 0.95
            assert all(f < 0.01 for name, f in report.fractions.items() if name != PLANTED), report
            assert report.stuck() == {PLANTED: report.fractions[PLANTED]}
    finally:
        amp.deinitialize()


def test_the_parameters_of_several_models_are_told_apart_by_position() -> None:
    """Two models whose parameter names repeat (both ``nn.Sequential``): the planted tensor of the first is
    reported under ``0.``, the same name in the healthy second under ``1.``; neither hides the other."""
    planted, opt_planted, x, y = _problem()
    healthy, opt_healthy, _, _ = _problem()
    for group in opt_healthy.param_groups:
        group["lr"] = 0.01
    models, opts = amp.initialize(
        [planted, healthy], [opt_planted, opt_healthy], opt_level="O5", stuck_weights_every=1, verbosity=0
    )
    try:
        for model, opt in zip(models, opts):
            _step(model, opt, x, y)
        report = amp.stats().stuck_weights
        assert report is not None
        assert set(report.fractions) == {f"{k}.{name}" for k in (0, 1) for name, _ in planted.named_parameters()}
        assert report.fractions["0." + PLANTED] >= 0.95
        assert report.fractions["1." + PLANTED] < 0.01
    finally:
        amp.deinitialize()


def test_a_master_that_is_the_widened_weight_counts_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting that keeps no master beside the weight (stochastic rounding into the bf16 weight) may still answer
    ``master_for`` with the weight widened; it changes exactly when the weight does, so it cannot tell an update
    that was rounded away. The report must then read the update as it does without masters."""
    reports = []
    for widened in (False, True):
        model, opt, x, y = _problem()
        model, opt = amp.initialize(
            model, opt, opt_level="O5", master_weights=False, stuck_weights_every=1, verbosity=0
        )
        session = ampinit.current_session()
        assert session is not None
        if widened:
            monkeypatch.setattr(session, "master_for", lambda param: param.detach().float())
        try:
            _step(model, opt, x, y)
            reports.append(amp.stats().stuck_weights)
        finally:
            amp.deinitialize()
    without, with_widened = reports
    assert without is not None and with_widened is not None
    assert dict(with_widened.fractions) == dict(without.fractions)
    assert with_widened.fractions[PLANTED] >= 0.95


def test_only_every_nth_step_of_an_optimizer_is_measured() -> None:
    model, opt, x, y = _problem()
    model, opt = amp.initialize(model, opt, opt_level="O5", stuck_weights_every=3, verbosity=0)
    try:
        seen = []
        for _ in range(7):
            _step(model, opt, x, y)
            report = amp.stats().stuck_weights
            seen.append(None if report is None else report.step)
        assert seen == [None, None, 3, 3, 3, 6, 6]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("sync_free", [False, True], ids=["skip on the host", "skip on the device"])
def test_a_skipped_step_measures_nothing_and_the_last_report_stays(
    sync_free: bool, caplog: pytest.LogCaptureFixture
) -> None:
    model, _, x, y = _problem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O5", stuck_weights_every=1, sync_free=sync_free)
    try:
        _step(model, opt, x, y)
        first = amp.stats().stuck_weights
        assert first is not None and first.step == 1
        weights = [p.detach().clone() for p in model.parameters()]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ampinit"):
            _step(model, opt, x, y, poison=True)
        stats = amp.stats()
        assert stats.skipped_steps == 1 and stats.steps == 2
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # skipped, weights unchanged
        assert stats.stuck_weights is first  # not a measurement of 100% stuck
        assert not [r for r in caplog.records if "stuck weights" in r.getMessage()]
    finally:
        amp.deinitialize()


def test_measuring_steps_read_the_host_once_and_other_steps_never() -> None:
    model, _, x, y = _problem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O5", stuck_weights_every=2, sync_free=True, verbosity=0)
    try:
        syncs = []
        for _ in range(4):
            with HostSyncCounter() as counter:
                _step(model, opt, x, y)
            syncs.append(counter.syncs)
        assert syncs == [[], ["Tensor.tolist"], [], ["Tensor.tolist"]]
        report = amp.stats().stuck_weights
        assert report is not None and report.step == 4
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("verbosity", [0, 1])
def test_each_measurement_logs_the_tensors_that_stopped_learning(
    verbosity: int, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, x, y = _problem()
    model, opt = amp.initialize(model, opt, opt_level="O5", stuck_weights_every=2, verbosity=verbosity)
    try:
        with caplog.at_level(logging.INFO, logger="ampinit"):
            for _ in range(4):
                _step(model, opt, x, y)
        lines = [r.getMessage() for r in caplog.records if "stuck weights" in r.getMessage()]
        if verbosity == 0:
            assert lines == []
        else:
            assert lines == [
                f"stuck weights at step {step}: 1 of 6 tensors had >= 50% of their updates rounded away: "
                f"{PLANTED} 100.0%"
                for step in (2, 4)
            ]
    finally:
        amp.deinitialize()


def test_the_report_is_off_by_default() -> None:
    model, opt, x, y = _problem()
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    try:
        _step(model, opt, x, y)
        assert amp.stats().stuck_weights is None
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-5, ValueError), (2.0, TypeError), ("100", TypeError), (True, TypeError)],
)
def test_a_bad_interval_is_refused_before_anything_changes(value: Any, error: type[Exception]) -> None:
    model, opt, _, _ = _problem()
    message = f"stuck_weights_every must be an int >= 1 (every N-th step) or None (off), got {value!r}"
    with pytest.raises(error, match=re.escape(message)):
        amp.initialize(model, opt, opt_level="O5", stuck_weights_every=value)
    assert ampinit.current_session() is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
