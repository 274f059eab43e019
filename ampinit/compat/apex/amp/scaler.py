"""``apex.amp.scaler.LossScaler``: Apex's host-side loss scaler, for code that builds one directly.

``amp.initialize`` does not use this class (ampinit's sessions keep their scale on the device); Apex's
``FP16_Optimizer`` does, as it did in Apex. Apex's rules: a dynamic scale starts at ``min(init_scale,
max_loss_scale)``, halves on overflow (not below ``min_loss_scale``) and doubles after ``scale_window`` clean
steps; ``scale_factor`` is accepted and, as in Apex, not used. A static scale never skips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LossScaler"]


class LossScaler:
    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else float(loss_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> float:
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        self._has_overflow = False

    def unscale(
        self,
        model_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        unused_scale: float,
        models_are_masters: bool = False,
        scale_override: float | None = None,
    ) -> None:
        """``master = model * (1/scale)``; flags an inf/NaN in any model grad (dynamic scales only)."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else scale_override
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        with torch.no_grad():
            for model, master in zip(model_grads, master_grads):
                if self.dynamic and not bool(torch.isfinite(model).all()):
                    self._has_overflow = True
                if master is not model:
                    master.copy_(model)
                master.mul_(1.0 / scale)

    def update_scale(self) -> bool:
        """Fold the overflow state into the scale; returns whether the step must be skipped."""
        if self._has_overflow and self.dynamic:
            should_skip = True
            halved = self._loss_scale / 2.0
            self._loss_scale = max(self._min_loss_scale, halved) if self._min_loss_scale else halved
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self._loss_scale}, unskipped={self._unskipped})"
