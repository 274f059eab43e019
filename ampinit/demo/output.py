"""The report as text and files: the aligned table per task, the verdict lines, the Markdown, and the files written
(``results.json``, ``results.md`` and the PNG of :mod:`ampinit.demo.plot`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TextIO

from ampinit.demo.config import WARMUP_STEPS
from ampinit.demo.plot import write_png
from ampinit.demo.results import DemoReport, RunResult, TaskReport, common_steps

JSON_NAME, MARKDOWN_NAME, PNG_NAME = "results.json", "results.md", "demo.png"
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
        why = " (O3 steps AdamW in fp16, where its eps=1e-8 is 0: docs/faq.md)" if "O3" in diverged else ""
        notes.append(f"non-finite final loss (diverged): {', '.join(diverged)}{why}")
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
