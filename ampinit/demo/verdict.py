"""Which opt level the measurements recommend on this machine, read from the measured table only, so that a
reader can check every step of the reasoning against it. The demo and the doctor both decide with
:func:`choose_level`, on figures measured the same way (:func:`ampinit.demo.interleaved.train_interleaved`), so
they give one answer: on a loaded machine it is marked tentative, and a speed figure the noise check rejected is
never the ground for a recommendation (there is none then)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

#: A level must be at least this many times as fast as O0 (geometric mean over the tasks) to be recommended.
MIN_SPEEDUP = 1.10
#: A level's loss at the common step may exceed O0's by this fraction (plus ``LOSS_SLACK``) and still count as
#: training like fp32; its accuracy may trail O0's by at most ``ACCURACY_SLACK``.
LOSS_TOLERANCE = 0.05
LOSS_SLACK = 0.01
ACCURACY_SLACK = 0.02


@dataclass(frozen=True)
class LevelOutcome:
    """One level on one task, as the demo measured it: what :func:`choose_level` reads."""

    task: str
    level: str
    loss_at_common_step: float
    accuracy: float
    speedup_vs_o0: float | None


@dataclass(frozen=True)
class Verdict:
    level: str | None
    reason: str
    tentative: bool

    def text(self) -> str:
        head = f"Use {self.level} on this machine" if self.level else "No recommendation"
        warning = " (TENTATIVE: the machine was busy, rerun when it is idle)" if self.tentative and self.level else ""
        return f"{head}{warning}: {self.reason}"


def choose_level(outcomes: Sequence[LevelOutcome], busy: bool, noisy: Collection[tuple[str, str]] = ()) -> Verdict:
    """The fastest level that trains like fp32 on every task, if it beats O0 by ``MIN_SPEEDUP``; else O0.

    "Trains like fp32": a finite loss at the step every run reached, at most ``LOSS_TOLERANCE`` (+
    ``LOSS_SLACK``) above O0's, and an accuracy at most ``ACCURACY_SLACK`` below O0's. "Fastest": the
    geometric mean over the tasks of the speedup vs O0.

    ``busy`` (other processes loaded the machine) marks the verdict tentative. ``noisy`` holds the ``(task,
    level)`` runs whose step times the noise check rejected: when O0 or a level that trains like fp32 is among
    them, the speed comparison rests on a rejected figure, so there is no recommendation.
    """
    tasks = list(dict.fromkeys(o.task for o in outcomes))
    reference = {o.task: o for o in outcomes if o.level == "O0"}
    if set(reference) != set(tasks):
        return Verdict(None, "O0 (fp32) did not run, so there is nothing to compare with: add O0 to --levels", busy)
    levels = [level for level in dict.fromkeys(o.level for o in outcomes) if level != "O0"]
    speedups: dict[str, float] = {}
    rejected: list[str] = []
    for level in levels:
        mine = {o.task: o for o in outcomes if o.level == level}
        problem = _training_problem(mine, reference, tasks)
        if problem:
            rejected.append(f"{level} ({problem})")
            continue
        ratios = [mine[task].speedup_vs_o0 or 0.0 for task in tasks]
        speedups[level] = math.exp(statistics.fmean(math.log(max(r, 1e-9)) for r in ratios)) if ratios else 0.0
    notes = []
    if rejected:
        notes.append("did not train like fp32: " + ", ".join(rejected))
    rejected_figures = sorted(f"{task} {level}" for task, level in noisy if level == "O0" or level in speedups)
    if rejected_figures:
        trained = ", ".join(speedups) or "none"
        reason = (
            f"the step times of {', '.join(rejected_figures)} varied too much to compare speeds (the noise check "
            f"rejected them), so no level is recommended on them; rerun when the machine is idle. Levels that "
            f"trained like fp32 here: {trained}"
        )
        return Verdict(None, "; ".join([reason, *notes]) + ".", busy)
    slower = [f"{level} ({speedup:.2f}x)" for level, speedup in speedups.items() if speedup < MIN_SPEEDUP]
    best = max(speedups, key=speedups.__getitem__, default=None)
    if best is None or speedups[best] < MIN_SPEEDUP:
        if slower:
            notes.append("not clearly faster than O0: " + ", ".join(slower))
        reason = f"no level that trains like fp32 ran at least {MIN_SPEEDUP:.2f}x as fast as O0 here"
        return Verdict("O0", "; ".join([reason, *notes]) + ".", busy)
    per_task = ", ".join(f"{task} {_speedup_of(outcomes, task, best):.2f}x" for task in tasks)
    reason = (
        f"it ran {speedups[best]:.2f}x as fast as O0 (geometric mean; {per_task}) and its loss stayed within "
        f"{LOSS_TOLERANCE:.0%} of fp32's"
    )
    others = [f"{level} {speedups[level]:.2f}x" for level in speedups if level != best]
    if others:
        notes.append("other levels that train like fp32: " + ", ".join(others))
    return Verdict(best, "; ".join([reason, *notes]) + ".", busy)


def _training_problem(mine: dict[str, LevelOutcome], reference: dict[str, LevelOutcome], tasks: list[str]) -> str:
    for task in tasks:
        if task not in mine:
            return f"did not run {task}"
        run, ref = mine[task], reference[task]
        if not math.isfinite(run.loss_at_common_step):
            return f"non-finite loss on {task}"
        limit = ref.loss_at_common_step * (1 + LOSS_TOLERANCE) + LOSS_SLACK
        if run.loss_at_common_step > limit:
            return f"loss {run.loss_at_common_step:.4f} vs fp32's {ref.loss_at_common_step:.4f} on {task}"
        if run.accuracy < ref.accuracy - ACCURACY_SLACK:
            return f"accuracy {run.accuracy:.1%} vs fp32's {ref.accuracy:.1%} on {task}"
    return ""


def _speedup_of(outcomes: Sequence[LevelOutcome], task: str, level: str) -> float:
    return next(o.speedup_vs_o0 or 0.0 for o in outcomes if o.task == task and o.level == level)
