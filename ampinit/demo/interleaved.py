"""The speed measurement of ampinit: every level trains the same steps in interleaved rounds
(:func:`train_interleaved`), each step timed, so that other processes slow every level alike; the demo runs it per
task, the doctor on the demo's small MLP.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._opt_levels import FUNCTION_CAST_LEVELS as THREAD_CAST_LEVELS  # their session casts in its whole thread
from ampinit.demo.config import MIN_STEPS, WARMUP_STEPS
from ampinit.demo.machine import relative_spread
from ampinit.demo.progress import Clock, Eta, Progress, _NoProgress
from ampinit.demo.results import RunResult
from ampinit.demo.workloads import _LEARNING_RATES, Task, initialize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_layer(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


class _LevelRun:
    """One level's model, optimizer and amp session while every level trains in interleaved blocks."""

    def __init__(self, task: Task, level: str, seed: int, device: torch.device, clock: Clock) -> None:
        self.task, self.level, self.device, self.clock = task, level, device, clock
        self.model = task.build(seed, device)
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=_LEARNING_RATES[task.name]
        )
        self.batches = task.batches(seed)
        self.per_block = level in THREAD_CAST_LEVELS
        self.session: ampinit.AmpSession | None = None
        self._state: dict[str, Any] | None = None
        self._closed_steps = self._closed_skipped = 0
        self.losses: list[float] = []
        self.times: list[float] = []
        self.compute_dtype: torch.dtype | None = None
        self._open()
        layer = _first_layer(self.model)
        self.weight_dtype = next(layer.parameters()).dtype
        self.master_dtype = next(iter(amp.master_params(self.optimizer))).dtype
        if self.per_block:
            self._close()

    def _open(self) -> None:
        self.model, self.optimizer = initialize(self.model, self.optimizer, self.level)
        self.session = ampinit.session_of(self.optimizer)
        if self.session is None:
            raise RuntimeError(f"amp.initialize(opt_level={self.level!r}) registered no session")
        if self._state is not None:
            self.session.load_state_dict(self._state)

    def _close(self) -> None:
        if self.session is None:
            return
        stats = self.session.stats()
        self._closed_steps += stats.steps
        self._closed_skipped += stats.skipped_steps
        self._state = self.session.state_dict()
        self.session.close()
        self.session = None

    @contextlib.contextmanager
    def _opened(self) -> Iterator[None]:
        if self.per_block:
            self._open()
        try:
            yield
        finally:
            if self.per_block:
                self._close()

    def block(self, steps: int) -> None:
        """Train ``steps`` steps, timing each one (garbage collection off inside the block)."""
        collecting = gc.isenabled()
        with self._opened():
            gc.disable()
            try:
                for _ in range(steps):
                    self._step()
            finally:
                if collecting:
                    gc.enable()

    def _step(self) -> None:
        inputs, target = next(self.batches)
        hook = None
        if self.compute_dtype is None:
            hook = _first_layer(self.model).register_forward_hook(self._record_compute_dtype)
        _sync(self.device)
        start = self.clock()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(self.model(inputs), target)
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        _sync(self.device)
        self.times.append(self.clock() - start)
        if hook is not None:
            hook.remove()
        self.losses.append(loss.item())

    def _record_compute_dtype(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.compute_dtype = output.dtype

    def finish(self, planned_steps: int) -> RunResult:
        """Evaluate, close the session and return the run's row."""
        with self._opened():
            accuracy, prediction = self.task.evaluate(self.model)
            steps, skipped, scale = self._closed_steps, self._closed_skipped, None
            if self.session is not None:
                stats = self.session.stats()
                steps, skipped, scale = steps + stats.steps, skipped + stats.skipped_steps, stats.loss_scales[0]
            else:
                scale = float((self._state or {})["loss_scaler0"]["loss_scale"])
        self._close()
        timed = self.times[WARMUP_STEPS:] if len(self.times) > WARMUP_STEPS + 1 else self.times[1:]
        return RunResult(
            task=self.task.name,
            level=self.level,
            compute_dtype=_dtype_name(self.compute_dtype or self.weight_dtype),
            weight_dtype=_dtype_name(self.weight_dtype),
            master_weights=self.master_dtype != self.weight_dtype,
            steps=len(self.losses),
            planned_steps=planned_steps,
            stopped_by_budget=len(self.losses) < planned_steps,
            initial_loss=self.losses[0],
            final_loss=self.losses[-1],
            accuracy=accuracy,
            ms_per_step=statistics.median(timed) * 1e3,
            step_time_spread=relative_spread(timed),
            speedup_vs_o0=None,
            peak_memory_mib=None,
            skipped_steps=skipped,
            final_loss_scale=scale,
            losses=self.losses,
            prediction=prediction,
        )

    def shutdown(self) -> None:
        self._close()


def train_interleaved(
    task: Task,
    levels: Sequence[str],
    *,
    steps: int,
    block: int,
    seconds: float | None,
    seed: int,
    device: torch.device,
    progress: Callable[[Eta], Progress] = lambda eta: _NoProgress(),
    clock: Clock = time.perf_counter,
    min_steps: int = MIN_STEPS,
) -> list[_LevelRun]:
    """Train every level for ``steps`` steps, in rounds of ``block`` steps per level with the order rotated by one
    each round, so that other processes and slow drifts slow every level alike; each step is timed with ``clock``.

    ``seconds`` (``None``: no limit) is checked between rounds only, so that every level stops at the same step:
    after ``min_steps``, a round that would end past it at the last round's pace is not started. ``progress``
    makes the bar from the run's :class:`Eta`; it moves after every level's block. This is the one speed
    measurement of ampinit: the demo runs it per task, the doctor on the demo's small MLP.
    """
    runs = [_LevelRun(task, level, seed, device, clock) for level in levels]
    eta = Eta(steps, block, seconds, min_steps, clock)
    bar = progress(eta)
    try:
        done, round_index = 0, 0
        while done < steps:
            size = min(block, steps - done)
            shift = round_index % len(runs)
            round_start = clock()
            for position, run in enumerate(runs[shift:] + runs[:shift], start=1):
                run.block(size)
                bar.update(done + size * position / len(runs), runs[0].losses[-1])
            done += size
            round_index += 1
            now = clock()
            if eta.deadline is not None and done >= min_steps and now + (now - round_start) > eta.deadline:
                break
    except BaseException:
        for run in runs:
            run.shutdown()
        raise
    finally:
        bar.close()
    return runs


def warm_up(task: Task, seed: int, device: torch.device) -> None:
    """Two plain fp32 steps, unrecorded, so that the first run does not pay (in time and memory) for the
    process's one-time set-up of torch's CPU kernels and thread pool."""
    model = task.build(seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATES[task.name])
    batches = task.batches(seed)
    for _ in range(2):
        inputs, target = next(batches)
        optimizer.zero_grad(set_to_none=True)
        task.loss(model(inputs), target).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    task.evaluate(model)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
