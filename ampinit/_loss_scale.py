"""Loss-scaling configuration (policy layer: plain data, no torch state)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DynamicLossScale:
    """How a dynamic loss scale starts, shrinks and grows.

    Pass an instance as ``loss_scale=`` to :func:`ampinit.initialize` instead of the string ``"dynamic"``.

    Args:
        init_scale: the first scale. Apex starts at ``min(2**16, max_scale)``; so does this default.
        growth_factor: the scale is multiplied by it after ``growth_interval`` clean steps in a row.
        backoff_factor: the scale is multiplied by it when the scale backs off after an overflow.
        growth_interval: clean (overflow-free) unscale steps needed before the scale grows.
        min_scale: the scale never backs off below this floor (``None``: no floor, as in Apex).
        max_scale: the scale never grows above this ceiling.
        hysteresis: the scale backs off at the ``hysteresis``-th overflow in a row; a clean step resets the
            count. ``1`` (the default, Apex's behaviour) backs off at every overflow. Every overflowing step is
            skipped whatever this value is: hysteresis only delays the *scale* change.
        raise_at_min: raise :class:`ampinit.LossScaleAtMinimumError` when a step overflows while the scale
            already sits at ``min_scale``, rather than skipping steps forever (DeepSpeed's and fairseq's
            behaviour). Needs ``min_scale``.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float = 2.0**24
    hysteresis: int = 1
    raise_at_min: bool = False

    def __post_init__(self) -> None:
        def positive_finite(name: str, value: float | None) -> None:
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DynamicLossScale.{name} must be a finite number > 0, got {value!r}")

        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            positive_finite(name, getattr(self, name))
        if self.growth_factor <= 1.0:
            raise ValueError(f"DynamicLossScale.growth_factor must be > 1.0, got {self.growth_factor!r}")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"DynamicLossScale.backoff_factor must be < 1.0, got {self.backoff_factor!r}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicLossScale.{name} must be an int >= 1, got {value!r}")
        if self.min_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(
                f"DynamicLossScale.min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})"
            )
        if self.min_scale is not None and self.first_scale < self.min_scale:
            raise ValueError(
                f"DynamicLossScale starts at {self.first_scale!r} (init_scale capped at max_scale), below its "
                f"min_scale {self.min_scale!r}"
            )
        if self.raise_at_min and self.min_scale is None:
            raise ValueError("DynamicLossScale.raise_at_min=True needs a min_scale to know where the minimum is")

    @property
    def first_scale(self) -> float:
        """The scale training starts with: ``init_scale`` capped at ``max_scale`` (Apex's rule)."""
        return min(self.init_scale, self.max_scale)
