"""``apex.fp16_utils.loss_scaler``: the manual loss scalers of Apex's pre-amp API, on ampinit's engine scaler.

Apex's ``DynamicLossScaler`` rule (divide by ``scale_factor`` on overflow, not below 1; multiply after
``scale_window`` iterations without one) is GradScaler's rule with ``backoff_factor = 1/scale_factor`` and a floor
of 1, which is what the engine scaler (:class:`ampinit._scaler.LossScaler`) runs: no second copy of it here. The
scale lives on the CPU (these scalers are read on the host at every backward, as Apex's Python floats were).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ampinit._loss_scale import DynamicLossScale
from ampinit._scaler import LossScaler as EngineScaler

__all__ = ["DynamicLossScaler", "LossScaler"]

_HOST = torch.device("cpu")
# Apex's dynamic scaler has no ceiling; the engine wants a finite one, and no float32 scale exceeds this.
_NO_CEILING = torch.finfo(torch.float32).max


class LossScaler:
    """A static loss scale: never reports an overflow, never changes."""

    def __init__(self, scale: float = 1) -> None:
        self._scaler = self._engine(float(scale))

    @staticmethod
    def _engine(setting: float | DynamicLossScale) -> EngineScaler:
        scaler = EngineScaler(setting)
        scaler.materialize(_HOST)
        return scaler

    @property
    def cur_scale(self) -> float:
        return self._scaler.loss_scale()

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scaler.set_loss_scale(value)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple[torch.Tensor, ...], grad_out: Any) -> tuple[torch.Tensor, ...]:
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]


class DynamicLossScaler(LossScaler):
    """Apex's first dynamic scaler: divide by ``scale_factor`` on overflow (not below 1), multiply after
    ``scale_window`` iterations without one.

    ``cur_scale``, ``scale_factor`` and ``scale_window`` read and write the engine scaler; ``cur_iter`` and
    ``last_overflow_iter`` are kept as Apex kept them, for code that reads them.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        self._scaler = self._engine(_rules(init_scale, scale_factor, scale_window))
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def _config(self) -> DynamicLossScale:
        config = self._scaler.config
        assert config is not None, "a DynamicLossScaler's engine scaler is dynamic"
        return config

    @property
    def scale_factor(self) -> float:
        return self._config.growth_factor

    @scale_factor.setter
    def scale_factor(self, value: float) -> None:
        self._scaler.reconfigure(_rules(self._config.init_scale, value, self._config.growth_interval))

    @property
    def scale_window(self) -> int:
        return self._config.growth_interval

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        self._scaler.reconfigure(dataclasses.replace(self._config, growth_interval=value))

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any gradient of ``params`` is inf/NaN: the engine's check (one kernel per device and dtype,
        grads left as they are), then one host read."""
        self._scaler.clear_overflow()
        self._scaler.check_([p.grad for p in params if p.grad is not None])
        return bool(self._scaler.found_inf.item())

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        self._scaler.set_overflow(overflow)
        self._scaler.update()
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1


def _rules(init_scale: float, scale_factor: float, scale_window: int) -> DynamicLossScale:
    """Apex's DynamicLossScaler arguments as the engine's rules (ValueError naming the bad one)."""
    if not (isinstance(scale_factor, (int, float)) and scale_factor > 1.0):
        raise ValueError(f"DynamicLossScaler.scale_factor must be a number > 1, got {scale_factor!r}")
    return DynamicLossScale(
        init_scale=init_scale,
        growth_factor=scale_factor,
        backoff_factor=1.0 / scale_factor,
        growth_interval=scale_window,
        min_scale=1.0,
        max_scale=_NO_CEILING,
    )
