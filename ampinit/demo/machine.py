"""What the demo and the doctor read about the machine they run on: the CPU's model and the flags that decide
bf16/fp16 speed, the load average, and whether step times were too noisy (or the machine too busy) to trust."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

#: The CPU features that decide bf16 and fp16 speed on x86: without them, bf16 and fp16 arithmetic is emulated.
SPEED_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
#: Load from other processes (in CPUs' worth of runnable threads) above which the timings are called unreliable.
BUSY_LOAD_FRACTION = 0.5
#: Relative spread (interquartile range / median) of a level's step times above which its timing is noisy.
NOISY_SPREAD = 0.25


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of :data:`SPEED_FLAGS` the CPU has, from ``/proc/cpuinfo`` (empty where there is none)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    if line is None:
        return {}
    flags = set(line.split(":", 1)[1].split())
    return {name: name in flags for name in SPEED_FLAGS}


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo``, or ``""``."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def load_average() -> float | None:
    """The 1-minute load average, or ``None`` where the OS does not report one (Windows)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over median: 0 for identical step times, ~0.1 on a quiet machine; infinite for fewer
    than 4 samples, where no spread can be measured (so the noise check rejects them)."""
    if len(samples) < 4:
        return math.inf
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


def load_reasons(load_before: float | None, load_after: float | None, cpus: int, threads: int) -> list[str]:
    """Why other processes may have slowed the timings (empty when the load average was low). ``load_after``
    includes this run's own ``threads``, which are subtracted."""
    others = max(load_before or 0.0, (load_after or 0.0) - threads)
    if others < BUSY_LOAD_FRACTION * cpus:
        return []
    return [
        f"other processes kept about {others:.1f} of {cpus} CPUs busy (load average before the run "
        f"{_fmt(load_before)}, after {_fmt(load_after)} with this run's {threads} threads)"
    ]


def noisy_runs(spreads: dict[str, float]) -> list[str]:
    """The runs (``spreads`` maps a run's name to the relative spread of its step times) whose timing the noise
    check rejects: its median is no figure to compare speeds with."""
    return [name for name, spread in spreads.items() if spread > NOISY_SPREAD]


def busy_reasons(
    load_before: float | None,
    load_after: float | None,
    cpus: int,
    threads: int,
    spreads: dict[str, float],
) -> list[str]:
    """Why the timings should not be trusted: the load (:func:`load_reasons`) and the runs the noise check
    rejected (:func:`noisy_runs`); empty when the machine looked quiet. ``spreads`` maps a run's name
    (``"mlp O5"``) to the relative spread of its step times."""
    reasons = load_reasons(load_before, load_after, cpus, threads)
    noisy = noisy_runs(spreads)
    if noisy:
        worst = max(noisy, key=spreads.__getitem__)
        reasons.append(
            f"step times varied by more than {NOISY_SPREAD:.0%} (interquartile range / median) in "
            f"{len(noisy)} of {len(spreads)} runs, up to {spreads[worst]:.0%} in {worst}"
        )
    return reasons


def _fmt(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.2f}"
