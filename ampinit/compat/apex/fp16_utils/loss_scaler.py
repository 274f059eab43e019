"""``apex.fp16_utils.loss_scaler``: the manual loss scalers of Apex's pre-amp API."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampinit import _kernels

__all__ = ["DynamicLossScaler", "LossScaler"]


class LossScaler:
    """A static loss scale: never reports an overflow, never changes."""

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

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
    ``scale_window`` iterations without one."""

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        # One host read per device, not one per gradient (Apex's loop synchronised once per tensor): the max-abs
        # of every grad is computed in one multi-tensor kernel per (device, dtype) group and checked on device.
        grads = [p.grad for p in params if p.grad is not None]
        flags = [torch.stack(_kernels.max_abs(group)).isfinite().all() for (_, (group,)) in _kernels.grouped(grads)]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for flag in flags:
            by_device.setdefault(flag.device, []).append(flag)
        return not all(bool(torch.stack(same).all()) for same in by_device.values())

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
