"""``ampinit demo``: train two small tasks at every opt level, measured here, and say which level to use.

The tasks (built in :mod:`ampinit.demo.tasks`, no downloads):

* ``checkerboard``: a CNN of 1x1 convolutions with BatchNorm learns to draw an 8 x 8 checkerboard from pixel
  coordinates; the figure shows the target beside each level's drawing.
* ``mlp``: an MLP classifier on a synthetic dataset (Gaussian points labelled by a random teacher network),
  with a held-out split for accuracy.

Every level starts from the same seed, so from the same weights and batches, and every level runs the same
steps. The levels train interleaved, in rounds of ``block`` steps per level with the order rotated each round
(as the benchmarks time them), so that other processes slow every level alike; a time budget is checked between
rounds only, so it stops every level at the same step. Reported per run: the compute and weight dtypes seen in the
model, steps, final loss, accuracy, median ms/step and its spread, speedup vs O0, peak memory (measured one level
at a time), skipped steps and the final loss scale. The load average and the spread of step times decide whether
the machine was too busy for the timings to be trusted (said loudly), and a verdict names the level to use here,
from the table (:mod:`ampinit.demo.verdict`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._opt_levels import FUNCTION_CAST_LEVELS as THREAD_CAST_LEVELS  # their session casts in its whole thread
from ampinit._types import OPT_LEVELS as _OPT_LEVELS
from ampinit._types import OptLevel
from ampinit.demo._names import TASKS
from ampinit.demo.machine import (
    NOISY_SPREAD,
    busy_reasons,
    cpu_flags,
    cpu_model,
    load_average,
    load_reasons,
    relative_spread,
)
from ampinit.demo.tasks import checkerboard, coordinate_grid, make_checkerboard, make_classifier
from ampinit.demo.verdict import LevelOutcome, choose_level

OPT_LEVELS: tuple[str, ...] = _OPT_LEVELS
DEVICES: tuple[str, ...] = ("cpu", "cuda")
FP16_LEVELS: tuple[str, ...] = ("O1", "O2", "O3")
#: Steps at the start of a run left out of the ms/step median (first-call allocations, kernel selection).
WARMUP_STEPS = 3
#: A run always takes at least this many steps, whatever the time budget says.
MIN_STEPS = 3
JSON_NAME, MARKDOWN_NAME, PNG_NAME = "results.json", "results.md", "demo.png"


# -- configuration ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoConfig:
    """What to run: ``steps`` per level (the same for every level), trained in interleaved rounds of ``block``
    steps. ``time_budget_s`` (``None``: none) may stop all levels early, at the same step."""

    levels: tuple[str, ...] = OPT_LEVELS
    tasks: tuple[str, ...] = TASKS
    device: str = "cpu"
    steps: int = 300
    block: int = 10
    time_budget_s: float | None = 240.0
    quick: bool = False
    seed: int = 0
    threads: int | None = None
    out: Path = Path("ampinit-demo")
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        check_levels(self.levels)
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
        if not self.tasks:
            raise ValueError(f"no task chosen; allowed: {', '.join(TASKS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.steps < MIN_STEPS:
            raise ValueError(f"steps must be >= {MIN_STEPS}, got {self.steps!r}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0 or None, got {self.time_budget_s!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")


def quick_config(**overrides: Any) -> DemoConfig:
    """The ``--quick`` preset: small tasks, 60 steps per level in blocks of 5, a 60-second training budget."""
    settings: dict[str, Any] = {"quick": True, "steps": 60, "block": 5, "time_budget_s": 60.0}
    settings.update(overrides)
    return DemoConfig(**settings)


def check_levels(levels: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the first unknown opt level and listing the allowed ones."""
    if not levels:
        raise ValueError(f"no opt level chosen; allowed: {', '.join(OPT_LEVELS)}")
    for level in levels:
        if level not in OPT_LEVELS:
            hint = " (the prefix is the letter O, not the number zero)" if level[:1] == "0" else ""
            raise ValueError(f"unknown opt level {level!r}{hint}; allowed: {', '.join(OPT_LEVELS)}")


def opt_level(level: str) -> OptLevel:
    """``level`` as the :data:`OptLevel` literal ``initialize`` is typed with; ``ValueError`` for an unknown one."""
    check_levels([level])
    return _OPT_LEVELS[_OPT_LEVELS.index(level)]


# -- results ---------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One task trained at one opt level. Times in ms, memory in MiB, ``None`` where not measured."""

    task: str
    level: str
    compute_dtype: str
    weight_dtype: str
    master_weights: bool
    steps: int
    planned_steps: int
    stopped_by_budget: bool
    initial_loss: float
    final_loss: float
    accuracy: float
    ms_per_step: float
    step_time_spread: float
    speedup_vs_o0: float | None
    peak_memory_mib: float | None
    skipped_steps: int
    final_loss_scale: float
    losses: list[float] = field(repr=False)
    prediction: list[list[float]] | None = field(default=None, repr=False)


@dataclass
class TaskReport:
    name: str
    description: str
    accuracy_name: str
    runs: list[RunResult]
    target: list[list[float]] | None = None


@dataclass
class DemoReport:
    environment: dict[str, Any]
    config: dict[str, Any]
    memory_method: str
    tasks: list[TaskReport]
    wall_seconds: float = 0.0
    files: dict[str, str] = field(default_factory=dict)
    load_average: dict[str, float | None] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: everything but the checkerboard images (those are in the PNG)."""
        data = asdict(self)
        for task in data["tasks"]:
            task.pop("target")
            for run in task["runs"]:
                run.pop("prediction")
        return data


# -- the tasks -------------------------------------------------------------------------------------------------
class Task(Protocol):
    name: str
    description: str
    accuracy_name: str

    def build(self, seed: int, device: torch.device) -> nn.Module: ...

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]: ...

    def target_image(self) -> list[list[float]] | None: ...


class CheckerboardTask:
    """Pixel coordinates -> an 8 x 8 checkerboard; one fixed batch of jittered coordinates."""

    name = "checkerboard"
    accuracy_name = "pixel accuracy"

    def __init__(self, quick: bool, device: torch.device) -> None:
        self.batch_size, self.grid, self.width, self.depth = (4, 16, 32, 3) if quick else (8, 32, 64, 4)
        self.device = device
        self.description = (
            f"coordinates ({self.batch_size} x 2 x {self.grid} x {self.grid}) -> 8 x 8 checkerboard; "
            f"{self.depth} x (1x1 Conv2d({self.width}) + BatchNorm2d + ReLU), BCE-with-logits, AdamW lr 3e-3"
        )
        grid = coordinate_grid(self.grid, self.grid).unsqueeze(0)
        self.clean_coords = grid.to(device)
        self.clean_target = checkerboard(grid, 8).to(device)

    def build(self, seed: int, device: torch.device) -> nn.Module:
        model, inputs, target, _ = make_checkerboard(
            seed, batch_size=self.batch_size, grid=self.grid, width=self.width, depth=self.depth
        )
        self._batch = (inputs.to(device), target.to(device))
        return model.to(device)

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self._batch

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(output, target)

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]:
        model.eval()
        with torch.no_grad():
            drawn = torch.sigmoid(model(self.clean_coords).float())
        model.train()
        accuracy = ((drawn > 0.5).float() == self.clean_target).float().mean().item()
        return accuracy, drawn[0, 0].cpu().tolist()

    def target_image(self) -> list[list[float]] | None:
        return list(self.clean_target[0, 0].cpu().tolist())


class MlpTask:
    """An MLP classifier on a synthetic dataset, trained on random minibatches, scored on the held-out split."""

    name = "mlp"
    accuracy_name = "test accuracy"

    def __init__(self, quick: bool, device: torch.device) -> None:
        self.sizes = (
            {"train_size": 2048, "test_size": 512, "hidden": 128, "depth": 2}
            if quick
            else {"train_size": 8192, "test_size": 2048, "hidden": 512, "depth": 3}
        )
        self.batch_size = 128 if quick else 256
        self.device = device
        s = self.sizes
        self.description = (
            f"10-class synthetic dataset ({s['train_size']} train / {s['test_size']} test points in 16-d), "
            f"MLP {s['depth']} x (Linear({s['hidden']}) + LayerNorm + GELU), batch {self.batch_size}, "
            "cross-entropy, AdamW lr 1e-3"
        )

    def build(self, seed: int, device: torch.device) -> nn.Module:
        data = make_classifier(seed, **self.sizes)
        self._train = (data.train_inputs.to(device), data.train_target.to(device))
        self._test = (data.test_inputs.to(device), data.test_target.to(device))
        return data.model.to(device)

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, target = self._train
        generator = torch.Generator().manual_seed(seed)
        while True:
            index = torch.randint(0, inputs.shape[0], (self.batch_size,), generator=generator).to(inputs.device)
            yield inputs[index], target[index]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]:
        inputs, target = self._test
        model.eval()
        with torch.no_grad():
            predicted = model(inputs).argmax(dim=1)
        model.train()
        return (predicted == target).float().mean().item(), None

    def target_image(self) -> list[list[float]] | None:
        return None


def _make_task(name: str, quick: bool, device: torch.device) -> Task:
    return CheckerboardTask(quick, device) if name == "checkerboard" else MlpTask(quick, device)


_LEARNING_RATES = {"checkerboard": 3e-3, "mlp": 1e-3}


# -- measuring -------------------------------------------------------------------------------------------------
class _PeakMemory:
    """Peak memory growth over a run: CUDA's allocator counters, or on CPU the process RSS sampled every 2 ms.

    On CPU, freed heap memory is handed back to the OS first (glibc ``malloc_trim``) so that memory cached from
    earlier runs does not hide this run's growth.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._peak = 0

    @staticmethod
    def method(device: torch.device) -> str:
        if device.type == "cuda":
            return "CUDA: torch.cuda.max_memory_allocated() minus the allocation before the model was built"
        if _rss_bytes() is not None:
            return (
                "CPU: growth of the process RSS (/proc/self/statm, sampled every 2 ms) over the run, from just before "
                "the model was built; freed heap memory is returned to the OS (malloc_trim) before each run"
            )
        return "not measured: no CUDA device and no /proc/self/statm on this OS"

    def __enter__(self) -> _PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        _malloc_trim()
        rss = _rss_bytes()
        if rss is not None:
            self._baseline = self._peak = rss
            self._thread = threading.Thread(target=self._sample, name="ampinit-demo-rss", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _rss_bytes() or 0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._peak = max(self._peak, _rss_bytes() or 0)

    def peak_mib(self) -> float | None:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self._baseline) / 2**20
        if self._thread is None:
            return None
        return (self._peak - self._baseline) / 2**20


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _malloc_trim() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_layer(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


# -- progress --------------------------------------------------------------------------------------------------
Clock = Callable[[], float]


class Eta:
    """How long the rest of an interleaved run takes, at the pace so far, stopping where the run will stop.

    ``done`` counts steps every level has taken, a round in progress as a fraction (after 2 of 6 levels ran a
    block of 10 steps, 3.33 more steps are done). The run ends at ``total`` steps, or earlier when the time budget
    (``seconds``) stops it: :func:`train_interleaved` does not start a round that would end past the budget, so
    the estimate never counts a step the budget will not let run.
    """

    def __init__(self, total: int, block: int, seconds: float | None, min_steps: int, clock: Clock) -> None:
        self.total, self.block, self.min_steps, self.clock = total, block, min_steps, clock
        self.start = clock()
        self.deadline = None if seconds is None else self.start + seconds

    def end_step(self, done: float) -> int:
        """The step count the run will stop at, as far as the pace so far tells."""
        if self.deadline is None or done <= 0:
            return self.total
        now = self.clock()
        per_step = (now - self.start) / done
        # The round in progress always finishes, and the run takes its minimum steps whatever the budget.
        floor = max(math.ceil(done / self.block) * self.block, math.ceil(self.min_steps / self.block) * self.block)
        fits = done + max(0.0, self.deadline - now) / per_step if per_step > 0 else float(self.total)
        return min(self.total, max(floor, int(fits // self.block) * self.block))

    def remaining_s(self, done: float) -> float | None:
        """Seconds left, or ``None`` before the first block gives a pace."""
        if done <= 0:
            return None
        per_step = (self.clock() - self.start) / done
        return max(0.0, self.end_step(done) - done) * per_step

    def text(self, done: float) -> str:
        remaining = self.remaining_s(done)
        if remaining is None:
            return "time left: measuring"
        end = self.end_step(done)
        until = f" (the time budget stops it at step {end})" if end < self.total else ""
        return f"about {_clock_time(remaining)} left{until}"


def _clock_time(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"


class Progress(Protocol):
    def update(self, done: float, loss: float) -> None: ...

    def close(self) -> None: ...


class _LineProgress:
    """The fallback without tqdm: one line at 0%, 25%, 50%, 75% and 100% of the run."""

    def __init__(self, label: str, total: int, stream: TextIO, eta: Eta | None) -> None:
        self.label, self.total, self.stream, self.eta = label, total, stream, eta
        self._marks = sorted({max(1, math.ceil(total * q / 4)) for q in range(1, 5)} | {1})

    def update(self, done: float, loss: float) -> None:
        reached = [mark for mark in self._marks if mark <= done]
        if not reached:
            return
        del self._marks[: len(reached)]
        left = f"  {self.eta.text(done)}" if self.eta is not None else ""
        self.stream.write(f"{self.label}: step {int(done)}/{self.total}  loss {loss:.4f}{left}\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class _TqdmProgress:
    """A tqdm bar that moves after every level's block and shows :class:`Eta`'s estimate, not tqdm's own (which
    knows nothing of the time budget)."""

    def __init__(self, label: str, total: int, stream: TextIO, eta: Eta | None) -> None:
        from tqdm import tqdm

        self.total, self.eta = total, eta
        bar_format = "{desc}: {percentage:3.0f}%|{bar}|{postfix}"
        self._bar = tqdm(
            total=total, desc=label, file=stream, leave=True, dynamic_ncols=True, mininterval=0.2, bar_format=bar_format
        )

    def update(self, done: float, loss: float) -> None:
        if self.eta is not None:  # the bar fills up to where the run will stop, the budget counted
            self._bar.total = self.eta.end_step(done)
        self._bar.update(done - self._bar.n)
        left = f", {self.eta.text(done)}" if self.eta is not None else ""
        self._bar.set_postfix_str(f"step {int(done)}/{self.total}, loss {loss:.4f}{left}")

    def close(self) -> None:
        self._bar.close()


class _NoProgress:
    def update(self, done: float, loss: float) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(enabled: bool, label: str, total: int, stream: TextIO, eta: Eta | None = None) -> Progress:
    """A tqdm bar when tqdm is installed, else plain lines; nothing when ``enabled`` is false. With ``eta``, each
    update says how long the rest will take."""
    if not enabled:
        return _NoProgress()
    try:
        return _TqdmProgress(label, total, stream, eta)
    except ImportError:
        return _LineProgress(label, total, stream, eta)


# -- training, interleaved -------------------------------------------------------------------------------------
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
        self.model, self.optimizer = amp.initialize(
            self.model, self.optimizer, opt_level=opt_level(self.level), verbosity=0
        )
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


def measure_memory(task: Task, level: str, seed: int, device: torch.device, steps: int = 2) -> float | None:
    """Peak memory growth of building ``task`` at ``level`` and training ``steps`` steps, one level at a time
    (interleaved training keeps every level's model alive, so its memory cannot be told apart)."""
    with _PeakMemory(device) as memory:
        model = task.build(seed, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATES[task.name])
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level(level), verbosity=0)
        session = ampinit.session_of(optimizer)
        try:
            batches = task.batches(seed)
            for _ in range(steps):
                inputs, target = next(batches)
                optimizer.zero_grad(set_to_none=True)
                with amp.scale_loss(task.loss(model(inputs), target), optimizer) as scaled_loss:
                    scaled_loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
        finally:
            if session is not None:
                session.close()
    return memory.peak_mib()


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


# -- the whole demo --------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model() or platform.processor() or platform.machine()
    return {
        "ampinit": ampinit.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": name,
        "cpus": os.cpu_count() or 1,
        "threads": torch.get_num_threads(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpu_flags": cpu_flags() if device.type == "cpu" else {},
    }


def _run_task(
    config: DemoConfig,
    name: str,
    device: torch.device,
    budget_end: float | None,
    tasks_left: int,
    progress_stream: TextIO,
) -> TaskReport:
    """One task at every level, interleaved (in its share of the time left, if there is a budget), then each
    level's peak memory."""
    task = _make_task(name, config.quick, device)
    warm_up(task, config.seed, device)
    seconds = None if budget_end is None else max(1.0, (budget_end - time.perf_counter()) / tasks_left)
    label = f"{name} {','.join(config.levels)}"
    runs = train_interleaved(
        task,
        config.levels,
        steps=config.steps,
        block=config.block,
        seconds=seconds,
        seed=config.seed,
        device=device,
        progress=lambda eta: make_progress(config.progress, label, config.steps, progress_stream, eta),
    )
    try:
        results = [run.finish(config.steps) for run in runs]
    finally:
        for run in runs:
            run.shutdown()
    del runs  # free every level's model before measuring memory one level at a time
    for result in results:
        result.peak_memory_mib = measure_memory(task, result.level, config.seed, device)
    _fill_speedups(results)
    return TaskReport(name, task.description, task.accuracy_name, results, task.target_image())


def run_demo(config: DemoConfig, stream: TextIO | None = None, progress_stream: TextIO | None = None) -> DemoReport:
    """Run every task at every level, print the tables and the verdict to ``stream`` (stdout) and the progress
    bars to ``progress_stream`` (stderr), and write JSON, Markdown and PNG into ``config.out``."""
    stream = sys.stdout if stream is None else stream
    progress_stream = sys.stderr if progress_stream is None else progress_stream
    started = time.perf_counter()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda, but CUDA is not available to this torch build ({torch.__version__})")
    _prepare_out(config.out)
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        env = environment(device)
        report = DemoReport(env, _config_dict(config), _PeakMemory.method(device), [])
        report.load_average["before"] = load_average()
        stream.write(_header(report) + "\n\n")
        budget_end = None if config.time_budget_s is None else time.perf_counter() + config.time_budget_s
        for index, name in enumerate(config.tasks):
            tasks_left = len(config.tasks) - index
            report.tasks.append(_run_task(config, name, device, budget_end, tasks_left, progress_stream))
            stream.write(format_table(report.tasks[-1]) + "\n\n")
            stream.flush()
        report.load_average["after"] = load_average()
    finally:
        torch.set_num_threads(previous_threads)
    judge(report)
    stream.write(format_verdict(report) + "\n\n")
    report.wall_seconds = time.perf_counter() - started
    write_outputs(report, config.out, config.plot, stream)
    return report


def _prepare_out(out: Path) -> None:
    """Create the output directory before training, so that a path that cannot be one fails in a second, with
    ``ValueError`` naming it, not after every level has trained."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {str(out)!r} cannot be created as a directory: {error.strerror or error}") from None


def judge(report: DemoReport) -> None:
    """Fill ``report.busy`` (why the timings may be untrustworthy) and ``report.verdict`` from the tables: tentative
    on a loaded machine, none where the noise check rejected a figure it would rest on (as the doctor decides)."""
    env = report.environment
    spreads = {f"{task.name} {run.level}": run.step_time_spread for task in report.tasks for run in task.runs}
    before, after = report.load_average.get("before"), report.load_average.get("after")
    report.busy = busy_reasons(before, after, env["cpus"], env["threads"], spreads)
    outcomes = [
        LevelOutcome(task.name, run.level, run.losses[common_steps(task) - 1], run.accuracy, run.speedup_vs_o0)
        for task in report.tasks
        for run in task.runs
    ]
    loaded = load_reasons(before, after, env["cpus"], env["threads"])
    noisy = {
        (task.name, run.level) for task in report.tasks for run in task.runs if run.step_time_spread > NOISY_SPREAD
    }
    verdict = choose_level(outcomes, busy=bool(loaded), noisy=noisy)
    report.verdict = {"level": verdict.level, "reason": verdict.reason, "tentative": verdict.tentative}


def _config_dict(config: DemoConfig) -> dict[str, Any]:
    data = asdict(config)
    data.update(out=str(config.out), levels=list(config.levels), tasks=list(config.tasks))
    return data


def _fill_speedups(runs: list[RunResult]) -> None:
    base = next((run.ms_per_step for run in runs if run.level == "O0"), None)
    for run in runs:
        run.speedup_vs_o0 = None if base is None else base / run.ms_per_step


# -- output ----------------------------------------------------------------------------------------------------
COLUMNS = (
    "level",
    "compute",
    "weights",
    "steps",
    "final loss",
    "accuracy",
    "ms/step",
    "spread",
    "vs O0",
    "peak MiB",
    "skipped",
    "loss scale",
)


def _header(report: DemoReport) -> str:
    env = report.environment
    lines = [
        f"ampinit {env['ampinit']} demo | torch {env['torch']} | device {env['device']}: {env['device_name']} "
        f"| {env['threads']} threads of {env['cpus']} CPUs",
    ]
    if env["cpu_flags"]:
        flags = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in env["cpu_flags"].items())
        lines.append(f"CPU flags for bf16/fp16 speed: {flags}")
    lines.append(f"peak memory: {report.memory_method}")
    return "\n".join(lines)


def common_steps(task: TaskReport) -> int:
    """The step count every run of ``task`` reached (all of them, unless a run failed)."""
    return min(run.steps for run in task.runs)


def _row(run: RunResult) -> list[str]:
    steps = f"{run.steps}" + (f" of {run.planned_steps}" if run.stopped_by_budget else "")
    return [
        run.level,
        run.compute_dtype,
        run.weight_dtype + (" + fp32 masters" if run.master_weights else ""),
        steps,
        f"{run.final_loss:.4f}",
        f"{run.accuracy:.1%}",
        f"{run.ms_per_step:.1f}",
        f"{run.step_time_spread:.0%}" if math.isfinite(run.step_time_spread) else "n/a",
        "-" if run.speedup_vs_o0 is None else f"{run.speedup_vs_o0:.2f}x",
        "-" if run.peak_memory_mib is None else f"{run.peak_memory_mib:.1f}",
        f"{run.skipped_steps}",
        f"{run.final_loss_scale:g}",
    ]


def _notes(task: TaskReport) -> list[str]:
    notes = [
        f"every level ran the same {common_steps(task)} steps from the same weights and batches; "
        f"accuracy: {task.accuracy_name}",
        f"ms/step: median over the steps after each level's first {WARMUP_STEPS}, levels interleaved in rounds; "
        "spread: interquartile range of the step times / median",
    ]
    if any(run.stopped_by_budget for run in task.runs):
        notes.append("the time budget stopped every level at the same step (--time-budget, or --steps fewer)")
    diverged = [run.level for run in task.runs if not math.isfinite(run.final_loss)]
    if diverged:
        notes.append(f"non-finite final loss (diverged): {', '.join(diverged)}")
    return notes


def format_table(task: TaskReport) -> str:
    """The task's runs as an aligned text table, with a title line and notes."""
    rows = [list(COLUMNS), *(_row(run) for run in task.runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [f"{task.name}: {task.description}"]
    for index, row in enumerate(rows):
        cells = [cell.ljust(width) if i < 3 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += [f"  {note}" for note in _notes(task)]
    return "\n".join(lines)


def format_verdict(report: DemoReport) -> str:
    """The busy-machine warning (when there is one) and the verdict: the lines a person acts on."""
    lines = []
    if report.busy:
        bar = "!" * 100
        lines += [bar, "!! THIS MACHINE WAS BUSY: the ms/step and speedups above are not trustworthy."]
        lines += [f"!!   - {reason}" for reason in report.busy]
        lines += ["!! The losses and accuracies are unaffected. Rerun when the machine is idle to compare speed.", bar]
    verdict = report.verdict
    head = f"Verdict: use {verdict['level']} on this machine" if verdict.get("level") else "Verdict: no recommendation"
    if verdict.get("tentative") and verdict.get("level"):
        head += " (TENTATIVE: measured on a busy machine)"
    lines += [head, f"  why: {verdict.get('reason', '')}"]
    return "\n".join(lines)


def format_markdown(report: DemoReport) -> str:
    lines = ["# ampinit demo results", "", *(f"- {line}" for line in _header(report).splitlines())]
    lines.append(f"- wall time: {report.wall_seconds:.0f} s")
    for task in report.tasks:
        lines += ["", f"## {task.name}", "", task.description, ""]
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
        lines += ["| " + " | ".join(_row(run)) + " |" for run in task.runs]
        lines += ["", *(f"- {note}" for note in _notes(task))]
    lines += ["", "## verdict", "", *format_verdict(report).splitlines()]
    return "\n".join(lines) + "\n"


def write_outputs(report: DemoReport, out: Path, plot: bool, stream: TextIO) -> None:
    """Write ``results.json``, ``results.md`` and (with matplotlib) ``demo.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    report.files = {"json": str(out / JSON_NAME), "markdown": str(out / MARKDOWN_NAME)}
    if plot:
        try:
            write_png(report, out / PNG_NAME)
            report.files["png"] = str(out / PNG_NAME)
        except ImportError:
            stream.write("matplotlib is not installed: no PNG (pip install 'ampinit[demo]' to get one)\n")
    (out / MARKDOWN_NAME).write_text(format_markdown(report), encoding="utf-8")
    (out / JSON_NAME).write_text(json.dumps(report.as_dict(), indent=1, allow_nan=True) + "\n", encoding="utf-8")
    for kind, path in report.files.items():
        stream.write(f"wrote {kind:8s} {path}\n")
    stream.write(f"total wall time {report.wall_seconds:.1f} s\n")


def _drawn_title(run: RunResult) -> str:
    if not math.isfinite(run.final_loss):
        return "NaN"
    return f"{run.accuracy:.0%} ({run.steps} steps)"


def _loss_axis_scale(losses: Sequence[float]) -> str:
    """Log where the losses span a decade or more, else linear. A log axis over less than a decade labels its
    minor ticks, and with every level at a similar loss those labels can crowd the axes to nothing (matplotlib's
    constrained layout then gives up); with no positive finite loss (every level diverged) log has nothing to show.
    Time is on a linear axis for the same reason: levels often run at similar speeds."""
    positive = [loss for loss in losses if math.isfinite(loss) and loss > 0]
    return "log" if positive and max(positive) >= 10 * min(positive) else "linear"


def write_png(report: DemoReport, path: Path) -> None:
    """Per task: training loss against step, and against time (step x the level's median ms/step), so that a
    level that learns as well but slower shows as a curve stretched to the right; below them the checkerboard
    target beside each level's drawing."""
    from matplotlib.figure import Figure

    boards = next((task for task in report.tasks if task.target is not None), None)
    columns = max(len(report.tasks), 1 + (len(boards.runs) if boards else 0))
    rows = 3 if boards else 2
    figure = Figure(figsize=(max(10.0, 2.2 * columns), 3.6 * rows), layout="constrained")
    grid = figure.add_gridspec(rows, columns * len(report.tasks))
    for index, task in enumerate(report.tasks):
        span = slice(index * columns, (index + 1) * columns)
        by_step, by_time = figure.add_subplot(grid[0, span]), figure.add_subplot(grid[1, span])
        for run in task.runs:
            style = "-" if run.level == "O0" else "--" if run.level in FP16_LEVELS else ":"
            steps = range(1, len(run.losses) + 1)
            by_step.plot(steps, run.losses, style, label=f"{run.level} {run.compute_dtype}", linewidth=1.4)
            seconds = [step * run.ms_per_step / 1e3 for step in steps]
            label = f"{run.level} {run.ms_per_step:.1f} ms/step"
            by_time.plot(seconds, run.losses, style, label=label, linewidth=1.4)
        scale = _loss_axis_scale([loss for run in task.runs for loss in run.losses])
        for axes, what in ((by_step, "step"), (by_time, "seconds (step x median ms/step)")):
            axes.set_yscale(scale)
            axes.set_xlabel(what)
            axes.set_ylabel("training loss")
        by_step.set_title(f"{task.name}: loss per step ({common_steps(task)} steps each)")
        by_time.set_title(f"{task.name}: loss against time")
        by_step.legend(fontsize="x-small")
        by_time.legend(fontsize="x-small")
    if boards is not None:
        images: list[tuple[str, list[list[float]]]] = [("target", boards.target or [])]
        images += [(f"{run.level}: {_drawn_title(run)}", run.prediction or []) for run in boards.runs]
        span_width = len(report.tasks)
        for index, (title, image) in enumerate(images):
            axes = figure.add_subplot(grid[2, index * span_width : (index + 1) * span_width])
            axes.imshow(image, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            axes.set_title(title, fontsize="small")
            axes.set_axis_off()
    env = report.environment
    title = f"ampinit demo on {env['device']} ({env['device_name']}), torch {env['torch']}"
    if report.busy:
        title += "  [BUSY MACHINE: timings not trustworthy]"
    figure.suptitle(title, fontsize="medium")
    figure.savefig(path, dpi=110)
