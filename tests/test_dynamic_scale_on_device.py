"""A dynamic loss scale decided on the device by default wherever the host would wait for it (issue 24).

On a GPU, reading the overflow flag at every ``scale_loss`` exit made O1/O2 wait for the device once per step,
where native autocast with ``GradScaler`` and a fused optimizer never waits: the CPU could not run ahead, and O2
ran at autocast's speed instead of above it (the H100 check: 1.015x). Now ``sync_free=None`` (the default) decides
a dynamic scale's skips on the device there, as ``sync_free=True`` always did, and writes Apex's overflow line when
the flag has reached the host. On the CPU nothing waits and the host decides, as before.

Here the CPU is taken for an accelerator (``_overflow.DEVICE_DECIDES_ON_CPU``); the copy to the host lands at once
on the CPU, and :class:`ampinit._skip._PendingDecision` is held back where a test needs a copy still in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import ampinit
from ampinit import _optimizer_record, _overflow, _skip, amp
from tests._amp_loop import mse, overflowing_run
from tests._device import HostSyncCounter, requires_cuda
from tests.conftest import make_problem

OVERFLOWS = 20


@pytest.fixture
def on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_overflow, "DEVICE_DECIDES_ON_CPU", True)


@pytest.fixture
def copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Copies of device decisions that have not reached the host until the test says so (``landed[0] = True``)."""
    landed = [False]
    monkeypatch.setattr(_skip._PendingDecision, "landed", lambda self: landed[0])
    yield landed


def overflow_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]


@pytest.mark.usefixtures("on_an_accelerator")
def test_the_default_decides_a_dynamic_scale_on_the_device_where_the_host_would_wait() -> None:
    """No flag read (the host decision reads it at every exit), and the steps are still skipped. Fused AdamW takes
    the device flag into its kernel; an optimizer that cannot still reads it at its step, as with a static scale."""
    with HostSyncCounter() as counter:
        overflowing_run(3, fused=True)
    try:
        assert "aten._local_scalar_dense" not in counter.syncs
        assert amp.stats().skipped_steps == 3
    finally:
        amp.deinitialize()
    with HostSyncCounter() as counter:
        overflowing_run(3, fused=True, sync_free=False)
    amp.deinitialize()
    assert counter.syncs.count("aten._local_scalar_dense") >= 3  # the reference: one read per exit, at least


def test_on_the_cpu_the_default_decides_on_the_host() -> None:
    """Nothing waits on the CPU: the default keeps Apex's host decision (one flag read per exit)."""
    with HostSyncCounter() as counter:
        overflowing_run(3)
    amp.deinitialize()
    assert counter.syncs.count("aten._local_scalar_dense") >= 3


@pytest.mark.usefixtures("on_an_accelerator")
def test_device_decisions_write_apexs_lines_thinned_as_the_host_ones(caplog: pytest.LogCaptureFixture) -> None:
    """The same words, scales and thinning (the first 8, then every power of two) as the host decision's."""
    lines = []
    for sync_free in (None, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ampinit"):
            overflowing_run(OVERFLOWS, sync_free=sync_free)
            amp.deinitialize()
        lines.append(overflow_lines(caplog))
    device, host = lines
    assert host[0] == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 536870912.0"
    assert len(host) == 8 + 1 and "16 overflows so far" in host[-1]
    assert device == host


@pytest.mark.usefixtures("on_an_accelerator")
def test_a_line_waits_for_its_flag_and_stats_write_the_rest(
    caplog: pytest.LogCaptureFixture, copies_in_flight: list[bool]
) -> None:
    """While the copies are in flight no line is written and nothing waits; ``stats()``, which waits for the
    device anyway, writes them all, in order; lines whose copies landed are written at the next decision."""
    with caplog.at_level(logging.INFO, logger="ampinit"):
        model, opt = overflowing_run(3)
        try:
            assert overflow_lines(caplog) == []
            assert amp.stats().skipped_steps == 3
            scales = [line.rsplit(" ", 1)[1] for line in overflow_lines(caplog)]
            assert scales == [str(2.0**29), str(2.0**28), str(2.0**27)]
            copies_in_flight[0] = True
            x, y = make_problem()[1:]
            opt.zero_grad()
            with amp.scale_loss(mse(model(x), y), opt) as scaled:
                scaled.backward()
                model.fc1.bias.grad[0] = float("inf")  # type: ignore[index]
            assert len(overflow_lines(caplog)) == 4  # the exit's own decision, landed at once now
        finally:
            amp.deinitialize()


@pytest.mark.usefixtures("on_an_accelerator")
def test_closing_the_session_writes_the_lines_still_in_flight(
    caplog: pytest.LogCaptureFixture, copies_in_flight: list[bool]
) -> None:
    with caplog.at_level(logging.INFO, logger="ampinit"):
        overflowing_run(2)
        assert overflow_lines(caplog) == []
        amp.deinitialize()
    assert len(overflow_lines(caplog)) == 2


@pytest.mark.usefixtures("on_an_accelerator")
def test_nothing_is_copied_for_lines_nobody_reads(
    copies_in_flight: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """verbosity=0, or the logger not at INFO (Python's default): no copy of the decision, no queue."""
    queued: list[object] = []
    monkeypatch.setattr(_skip._PendingDecision, "copy", classmethod(lambda cls, *a: queued.append(a)))
    overflowing_run(2)
    amp.deinitialize()
    assert queued == []


# torch says once per process that the mode is a prototype; under filterwarnings=error that notice would raise with
# the mode already switched on.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@requires_cuda("torch.cuda.set_sync_debug_mode, pinned memory and CUDA events")
def test_on_cuda_overflow_lines_reach_the_host_without_a_sync(caplog: pytest.LogCaptureFixture) -> None:
    """The real path: the decision's copy to pinned memory and its event make no sync (CUDA's own verdict), and
    the lines come out with the host decision's words once they have landed."""
    model, x, y = (t.cuda() for t in make_problem())
    opt = torch.optim.AdamW(model.parameters(), 1e-2, fused=True)
    # A scale the clean first step does not overflow in fp16 (the H100 check's first try started at 2**24, where it
    # did: three skips, not two).
    amp.initialize(model, opt, opt_level="O2", loss_scale=ampinit.DynamicLossScale(init_scale=2.0**10), verbosity=1)
    try:
        with caplog.at_level(logging.INFO, logger="ampinit"):
            for overflow in (False, True, True):  # the first step creates the optimizer's state: outside the check
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error" if overflow else previous)
                try:
                    opt.zero_grad()
                    with amp.scale_loss(mse(model(x), y), opt) as scaled:
                        scaled.backward()
                        if overflow:
                            model.fc1.bias.grad[0].fill_(float("inf"))  # type: ignore[index]
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            assert amp.stats().skipped_steps == 2
        assert overflow_lines(caplog) == [
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0",
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 256.0",
        ]
    finally:
        amp.deinitialize()


@pytest.mark.usefixtures("on_an_accelerator")
def test_a_failing_flush_still_closes_the_session(
    caplog: pytest.LogCaptureFixture, copies_in_flight: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lines are written before the session's changes are undone; if waiting for them fails (a device error),
    the error propagates and the model and optimizer are restored all the same."""

    def broken(self: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(_skip._PendingDecision, "wait", broken)
    with caplog.at_level(logging.INFO, logger="ampinit"):
        model, opt = overflowing_run(1)
        with pytest.raises(RuntimeError, match="device lost"):
            amp.deinitialize()
    assert amp.current_session() is None
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the O2 model cast back
    assert "step" not in vars(opt)  # amp's step wrapper removed


@pytest.mark.usefixtures("on_an_accelerator")
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_device_skips_are_counted_across_the_counts_folds(level: str) -> None:
    """The session sums its device-decided skips every ``StepCounts.FOLD`` steps, not at each step: overflows on
    both sides of a fold (the first step, the last before one, the first after, one in the next window) are each
    counted once, read at any step, against the plain count of the overflows planted."""
    fold = _optimizer_record.StepCounts.FOLD
    planted = {0, fold - 1, fold, fold + 1, 2 * fold + 5}
    model, x, y = make_problem()
    opt = torch.optim.AdamW(model.parameters(), 1e-2, fused=True)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        for step in range(2 * fold + 7):
            opt.zero_grad()
            with amp.scale_loss(mse(model(x), y), opt) as scaled:
                scaled.backward()
                if step in planted:
                    model.fc1.bias.grad[0] = float("inf")  # type: ignore[index]
            opt.step()
            if step in (fold - 2, fold - 1, fold, 2 * fold, 2 * fold + 6):
                assert amp.stats().skipped_steps == sum(1 for s in planted if s <= step), step
        assert amp.stats().steps == 2 * fold + 7
    finally:
        amp.deinitialize()
