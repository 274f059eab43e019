"""What ``ampinit demo`` runs (:class:`DemoConfig`, the ``--quick`` preset) and the checks of its values: the opt
levels, tasks, device, step counts, block size, time budget and threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampinit._types import OPT_LEVELS as _OPT_LEVELS
from ampinit._types import OptLevel
from ampinit.demo._names import TASKS

OPT_LEVELS: tuple[str, ...] = _OPT_LEVELS
DEVICES: tuple[str, ...] = ("cpu", "cuda")
#: Steps at the start of a run left out of the ms/step median (first-call allocations, kernel selection).
WARMUP_STEPS = 3
#: A run always takes at least this many steps, whatever the time budget says.
MIN_STEPS = 3


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
