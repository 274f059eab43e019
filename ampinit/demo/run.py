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

import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch

import ampinit
from ampinit.demo.config import DemoConfig
from ampinit.demo.interleaved import train_interleaved, warm_up
from ampinit.demo.machine import NOISY_SPREAD, busy_reasons, cpu_flags, cpu_model, load_average, load_reasons
from ampinit.demo.memory import _PeakMemory, measure_memory
from ampinit.demo.output import _header, format_table, format_verdict, write_outputs
from ampinit.demo.progress import make_progress
from ampinit.demo.results import DemoReport, TaskReport, _fill_speedups, common_steps
from ampinit.demo.verdict import LevelOutcome, choose_level
from ampinit.demo.workloads import _make_task


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
