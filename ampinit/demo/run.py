"""``ampinit demo``: train two small tasks once per opt level and report what each level did, measured here.

The tasks (built in :mod:`ampinit.demo.tasks`, no downloads):

* ``checkerboard``: a CNN of 1x1 convolutions with BatchNorm learns to draw an 8 x 8 checkerboard from pixel
  coordinates; the figure shows the target beside each level's drawing.
* ``mlp``: an MLP classifier on a synthetic dataset (Gaussian points labelled by a random teacher network),
  with a held-out split for accuracy.

Every level starts from the same seed, so from the same weights and batches. Reported per run: the compute and
weight dtypes actually seen in the model, steps, final loss, accuracy, median ms/step, speedup vs O0, peak
memory, skipped steps and the final loss scale. On a CPU without fp16 arithmetic (emulated fp16 matmuls run
tens of times slower than fp32) the fp16 levels O1-O3 run fewer steps, measured by a probe at start-up; a
training-time budget bounds the whole run; the table shows the steps each run actually took.
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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit.demo.tasks import checkerboard, coordinate_grid, make_checkerboard, make_classifier

OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3", "O4", "O5")
TASKS: tuple[str, ...] = ("checkerboard", "mlp")
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
    """What to run. ``steps`` is per run; ``fp16_steps`` (``None``: decided by the probe) for O1-O3."""

    levels: tuple[str, ...] = OPT_LEVELS
    tasks: tuple[str, ...] = TASKS
    device: str = "cpu"
    steps: int = 300
    fp16_steps: int | None = None
    time_budget_s: float = 140.0
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
        if self.fp16_steps is not None and self.fp16_steps < MIN_STEPS:
            raise ValueError(f"fp16_steps must be >= {MIN_STEPS}, got {self.fp16_steps!r}")
        if not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")


def quick_config(**overrides: Any) -> DemoConfig:
    """The ``--quick`` preset: small tasks, 100 steps, a 12-second training budget."""
    settings: dict[str, Any] = {"quick": True, "steps": 100, "time_budget_s": 12.0}
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


def fp16_matmul_slowdown(device: torch.device) -> float:
    """How many times slower a 256 x 256 fp16 matmul is than fp32 here, on one thread (1.0 on CUDA).

    One thread and the fastest of a few tries, so that other processes on a busy machine slow neither side: the
    probe asks whether the CPU has fp16 arithmetic, not how loaded it is. Takes about 0.1 s.
    """
    if device.type == "cuda":
        return 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        fastest: dict[torch.dtype, float] = {}
        for dtype, tries in ((torch.float32, 7), (torch.float16, 3)):
            operand = a.to(dtype)
            operand @ operand
            samples = []
            for _ in range(tries):
                start = time.perf_counter()
                operand @ operand
                samples.append(time.perf_counter() - start)
            fastest[dtype] = min(samples)
    finally:
        torch.set_num_threads(threads)
    return fastest[torch.float16] / fastest[torch.float32]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_layer(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


# -- progress --------------------------------------------------------------------------------------------------
class Progress(Protocol):
    def update(self, step: int, loss: float) -> None: ...

    def close(self) -> None: ...


class _LineProgress:
    """The fallback without tqdm: one line at 0%, 25%, 50%, 75% and 100% of the run."""

    def __init__(self, label: str, total: int, stream: TextIO) -> None:
        self.label, self.total, self.stream = label, total, stream
        self._marks = {max(1, math.ceil(total * q / 4)) for q in range(1, 5)} | {1}

    def update(self, step: int, loss: float) -> None:
        if step in self._marks:
            self.stream.write(f"{self.label}: step {step}/{self.total}  loss {loss:.4f}\n")
            self.stream.flush()

    def close(self) -> None:
        pass


class _TqdmProgress:
    def __init__(self, label: str, total: int, stream: TextIO) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=label, file=stream, leave=True, dynamic_ncols=True, mininterval=0.2)

    def update(self, step: int, loss: float) -> None:
        self._bar.update(step - self._bar.n)
        if step % 10 == 0 or step == self._bar.total:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        self._bar.close()


class _NoProgress:
    def update(self, step: int, loss: float) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(enabled: bool, label: str, total: int, stream: TextIO) -> Progress:
    """A tqdm bar when tqdm is installed, else plain lines; nothing when ``enabled`` is false."""
    if not enabled:
        return _NoProgress()
    try:
        return _TqdmProgress(label, total, stream)
    except ImportError:
        return _LineProgress(label, total, stream)


# -- one run ---------------------------------------------------------------------------------------------------
def train_one(
    task: Task,
    level: str,
    *,
    steps: int,
    seconds: float,
    seed: int,
    device: torch.device,
    progress: Progress,
) -> RunResult:
    """Train ``task`` at ``level`` for ``steps`` steps, or fewer if ``seconds`` of training run out first."""
    with _PeakMemory(device) as memory:
        model = task.build(seed, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATES[task.name])
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
        try:
            seen: dict[str, torch.dtype] = {}
            layer = _first_layer(model)
            hook = layer.register_forward_hook(lambda _m, _i, out: seen.update(compute=out.dtype))
            weight_dtype = next(layer.parameters()).dtype
            master_dtype = next(iter(amp.master_params(optimizer))).dtype
            losses, times = [], []
            deadline = time.perf_counter() + seconds
            batches = task.batches(seed)
            for step in range(1, steps + 1):
                inputs, target = next(batches)
                _sync(device)
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = task.loss(model(inputs), target)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                _sync(device)
                times.append(time.perf_counter() - start)
                if step == 1:
                    hook.remove()
                losses.append(loss.item())
                progress.update(step, losses[-1])
                if step >= MIN_STEPS and time.perf_counter() > deadline:
                    break
            stats = amp.stats()
            accuracy, prediction = task.evaluate(model)
        finally:
            progress.close()
            amp.deinitialize()
    timed = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS + 1 else times[1:]
    return RunResult(
        task=task.name,
        level=level,
        compute_dtype=_dtype_name(seen["compute"]),
        weight_dtype=_dtype_name(weight_dtype),
        master_weights=master_dtype != weight_dtype,
        steps=len(losses),
        planned_steps=steps,
        stopped_by_budget=len(losses) < steps,
        initial_loss=losses[0],
        final_loss=losses[-1],
        accuracy=accuracy,
        ms_per_step=statistics.median(timed) * 1e3,
        speedup_vs_o0=None,
        peak_memory_mib=memory.peak_mib(),
        skipped_steps=stats.skipped_steps,
        final_loss_scale=stats.loss_scales[0],
        losses=losses,
        prediction=prediction,
    )


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
def environment(device: torch.device, slowdown: float) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_model() or platform.processor() or platform.machine()
    return {
        "ampinit": ampinit.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": name,
        "threads": torch.get_num_threads(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "fp16_matmul_slowdown_vs_fp32": round(slowdown, 2),
        "fp16_emulated": slowdown > 2.0,
    }


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def plan_steps(config: DemoConfig, level: str, fp16_emulated: bool) -> int:
    """Steps for one run: ``config.steps``, or for O1-O3 on emulated fp16 ``fp16_steps`` (default steps / 10)."""
    if level not in FP16_LEVELS:
        return config.steps
    if config.fp16_steps is not None:
        return config.fp16_steps
    return max(MIN_STEPS + 2, config.steps // 10) if fp16_emulated else config.steps


def run_demo(config: DemoConfig, stream: TextIO | None = None, progress_stream: TextIO | None = None) -> DemoReport:
    """Run every task at every level, print the tables to ``stream`` (stdout) and the progress bars to
    ``progress_stream`` (stderr), and write JSON, Markdown and PNG into ``config.out``."""
    stream = sys.stdout if stream is None else stream
    progress_stream = sys.stderr if progress_stream is None else progress_stream
    started = time.perf_counter()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda, but CUDA is not available to this torch build ({torch.__version__})")
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        slowdown = fp16_matmul_slowdown(device)
        env = environment(device, slowdown)
        report = DemoReport(env, _config_dict(config), _PeakMemory.method(device), [])
        stream.write(_header(report) + "\n\n")
        runs_left = len(config.tasks) * len(config.levels)
        budget_end = time.perf_counter() + config.time_budget_s
        for name in config.tasks:
            task = _make_task(name, config.quick, device)
            warm_up(task, config.seed, device)
            runs = []
            for level in config.levels:
                share = max(0.5, (budget_end - time.perf_counter()) / runs_left)
                steps = plan_steps(config, level, env["fp16_emulated"])
                bar = make_progress(config.progress, f"{name} {level}", steps, progress_stream)
                runs.append(
                    train_one(task, level, steps=steps, seconds=share, seed=config.seed, device=device, progress=bar)
                )
                runs_left -= 1
            _fill_speedups(runs)
            report.tasks.append(TaskReport(name, task.description, task.accuracy_name, runs, task.target_image()))
            stream.write(format_table(report.tasks[-1]) + "\n\n")
            stream.flush()
    finally:
        torch.set_num_threads(previous_threads)
    report.wall_seconds = time.perf_counter() - started
    write_outputs(report, config.out, config.plot, stream)
    return report


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
    "loss @ {n}",
    "accuracy",
    "ms/step",
    "vs O0",
    "peak MiB",
    "skipped",
    "loss scale",
)


def _header(report: DemoReport) -> str:
    env = report.environment
    lines = [
        f"ampinit {env['ampinit']} demo | torch {env['torch']} | device {env['device']}: {env['device_name']} "
        f"| {env['threads']} threads",
    ]
    if env["device"] == "cpu":
        slow = env["fp16_matmul_slowdown_vs_fp32"]
        if env["fp16_emulated"]:
            fewer = any(level in FP16_LEVELS for level in report.config["levels"])
            lines.append(
                f"fp16 matmuls run {slow:.0f}x slower than fp32 on this CPU (no fp16 hardware)"
                + (": O1-O3 run fewer steps, compare levels at equal steps (loss @ N, loss curves)" if fewer else "")
            )
        else:
            lines.append(f"fp16 matmul time vs fp32 on this CPU: {slow:.2f}x")
    lines.append(f"peak memory: {report.memory_method}")
    return "\n".join(lines)


def common_steps(task: TaskReport) -> int:
    """The step count every run of ``task`` reached: the losses at this step compare the levels fairly."""
    return min(run.steps for run in task.runs)


def _columns(task: TaskReport) -> list[str]:
    return [column.format(n=common_steps(task)) for column in COLUMNS]


def _row(run: RunResult, common: int) -> list[str]:
    steps = f"{run.steps}" + (f" of {run.planned_steps}" if run.stopped_by_budget else "")
    return [
        run.level,
        run.compute_dtype,
        run.weight_dtype + (" + fp32 masters" if run.master_weights else ""),
        steps,
        f"{run.final_loss:.4f}",
        f"{run.losses[common - 1]:.4f}",
        f"{run.accuracy:.1%}",
        f"{run.ms_per_step:.1f}",
        "-" if run.speedup_vs_o0 is None else f"{run.speedup_vs_o0:.2f}x",
        "-" if run.peak_memory_mib is None else f"{run.peak_memory_mib:.1f}",
        f"{run.skipped_steps}",
        f"{run.final_loss_scale:g}",
    ]


def _notes(task: TaskReport) -> list[str]:
    notes = [
        f"loss @ {common_steps(task)}: the training loss at the step every run reached (same batches for all levels)",
        f"accuracy: {task.accuracy_name}; ms/step: median over steps after the first {WARMUP_STEPS}, levels run one "
        "after the other (on a machine busy with other jobs, rerun or use --threads 1 before trusting a ratio)",
    ]
    cut = [run.level for run in task.runs if run.stopped_by_budget]
    if cut:
        notes.append(f"stopped by the time budget before their planned steps: {', '.join(cut)}")
    diverged = [run.level for run in task.runs if not math.isfinite(run.final_loss)]
    if diverged:
        notes.append(f"non-finite final loss (diverged): {', '.join(diverged)}")
    return notes


def format_table(task: TaskReport) -> str:
    """The task's runs as an aligned text table, with a title line and notes."""
    rows = [_columns(task), *(_row(run, common_steps(task)) for run in task.runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [f"{task.name}: {task.description}"]
    for index, row in enumerate(rows):
        cells = [cell.ljust(width) if i < 3 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += [f"  {note}" for note in _notes(task)]
    return "\n".join(lines)


def format_markdown(report: DemoReport) -> str:
    lines = ["# ampinit demo results", "", *(f"- {line}" for line in _header(report).splitlines())]
    lines.append(f"- wall time: {report.wall_seconds:.0f} s")
    for task in report.tasks:
        lines += ["", f"## {task.name}", "", task.description, ""]
        lines.append("| " + " | ".join(_columns(task)) + " |")
        lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
        lines += ["| " + " | ".join(_row(run, common_steps(task))) + " |" for run in task.runs]
        lines += ["", *(f"- {note}" for note in _notes(task))]
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


def write_png(report: DemoReport, path: Path) -> None:
    """Loss curves per level for each task; below them the checkerboard target beside each level's drawing."""
    from matplotlib.figure import Figure

    boards = next((task for task in report.tasks if task.target is not None), None)
    columns = max(len(report.tasks), 1 + (len(boards.runs) if boards else 0))
    figure = Figure(figsize=(max(8.0, 1.9 * columns), 5.6 if boards else 3.6), layout="constrained")
    grid = figure.add_gridspec(2 if boards else 1, columns * len(report.tasks))
    for index, task in enumerate(report.tasks):
        axes = figure.add_subplot(grid[0, index * columns : (index + 1) * columns])
        for run in task.runs:
            style = "-" if run.level == "O0" else "--" if run.level in FP16_LEVELS else ":"
            axes.plot(
                range(1, len(run.losses) + 1),
                run.losses,
                style,
                label=f"{run.level} ({run.compute_dtype}, {run.steps} steps)",
                linewidth=1.4,
                marker="o",
                markevery=[len(run.losses) - 1],
            )
        axes.set_yscale("log")
        axes.set_title(f"{task.name}: training loss")
        axes.set_xlabel("step")
        axes.legend(fontsize="small")
    if boards is not None:
        images: list[tuple[str, list[list[float]]]] = [("target", boards.target or [])]
        images += [(f"{run.level}: {_drawn_title(run)}", run.prediction or []) for run in boards.runs]
        span = len(report.tasks)
        for index, (title, image) in enumerate(images):
            axes = figure.add_subplot(grid[1, index * span : (index + 1) * span])
            axes.imshow(image, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            axes.set_title(title, fontsize="small")
            axes.set_axis_off()
    env = report.environment
    figure.suptitle(f"ampinit demo on {env['device']} ({env['device_name']}), torch {env['torch']}", fontsize="medium")
    figure.savefig(path, dpi=110)
