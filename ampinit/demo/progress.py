"""Progress of an interleaved run: how long the rest takes with the time budget counted (:class:`Eta`), shown as a
tqdm bar or, without tqdm, as plain lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, TextIO

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
