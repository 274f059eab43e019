"""The demo's figure: per task, the loss against step and against time, and the checkerboard target beside each
level's drawing (matplotlib, imported only when a PNG is written).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ampinit.demo.results import DemoReport, RunResult, common_steps

FP16_LEVELS: tuple[str, ...] = ("O1", "O2", "O3")


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
