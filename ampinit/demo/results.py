"""What the demo measured: one :class:`RunResult` per task and level, a :class:`TaskReport` per task and the whole
:class:`DemoReport` (what the tables, the verdict, the JSON, the Markdown and the PNG are made from), and the
figures read across a task's runs (the steps they share, the speedups against O0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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


def common_steps(task: TaskReport) -> int:
    """The step count every run of ``task`` reached (all of them, unless a run failed)."""
    return min(run.steps for run in task.runs)


def _fill_speedups(runs: list[RunResult]) -> None:
    base = next((run.ms_per_step for run in runs if run.level == "O0"), None)
    for run in runs:
        run.speedup_vs_o0 = None if base is None else base / run.ms_per_step
