"""``apex.amp.scaler.LossScaler``: Apex's loss scaler, as a face of one of ampinit's engine scalers.

There is one scaler implementation in ampinit (:class:`ampinit._scaler.LossScaler`, the scale and its counts on
the device); this class only gives it Apex's names. ``_amp_state.loss_scalers[i]`` is one of these over a session's
scaler, and ``LossScaler("dynamic", ...)`` built directly (Apex's ``FP16_Optimizer`` does) owns a fresh engine
scaler. Apex's rules, which are the engine's: a dynamic scale starts at ``min(init_scale, max_loss_scale)``, halves
on overflow (not below ``min_loss_scale``) and doubles after ``scale_window`` clean ``update_scale()`` calls (not
above ``max_loss_scale``); ``scale_factor`` is accepted and, as in Apex, not used. A static scale never skips.

Apex's private fields that public code reads or sets are properties over the engine scaler:
``_loss_scale``, ``_unskipped``, ``_scale_seq_len`` (the growth interval, settable), ``_max_loss_scale``,
``_min_loss_scale``, ``_has_overflow`` and ``_overflow_buf`` (the overflow flag itself: a one-element tensor that
``unscale`` raises and ``update_scale`` reads; Apex's was int32 on CUDA, this one is the engine's float32 flag on
the scaler's device, which ``fill_(1)``, ``zero_()``, ``item()`` and the ``amp_C`` ops treat alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ampinit._loss_scale import DynamicLossScale
from ampinit._scaler import LossScaler as EngineScaler
from ampinit.compat.apex.amp_C import multi_tensor_axpby, multi_tensor_scale

#: The session's hand-over of a decision deferred to a step (``AmpSession.decide_deferred_by_hand``).
TakeDeferred = Callable[[EngineScaler], Callable[[torch.Tensor], None] | None]

__all__ = ["LossScaler"]


def _default_device() -> torch.device:
    """Where a scaler built directly keeps its flag: CUDA when there is one (Apex's choice), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class LossScaler:
    """Apex's ``LossScaler(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale)``."""

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        if loss_scale == "dynamic":
            # Apex applies a floor only when min_loss_scale is truthy (`if self._min_loss_scale:`).
            setting: float | DynamicLossScale = DynamicLossScale(
                init_scale=init_scale,
                growth_interval=scale_window,
                min_scale=min_loss_scale or None,
                max_scale=max_loss_scale,
            )
        elif isinstance(loss_scale, str):
            raise ValueError(f"loss_scale must be a number or 'dynamic', got {loss_scale!r}")
        else:
            setting = float(loss_scale)
        engine = EngineScaler(setting)
        engine.materialize(_default_device())
        self._engine = engine
        self._static_seq_len = scale_window
        self._static_limits: tuple[float | None, float | None] = (min_loss_scale, max_loss_scale)
        self._assigned_buf: torch.Tensor | None = None
        self._take_deferred: TakeDeferred | None = None

    @classmethod
    def of(cls, engine: EngineScaler, take_deferred: TakeDeferred | None = None) -> LossScaler:
        """The Apex face of an existing engine scaler (a session's): reads and writes go to ``engine``.

        ``take_deferred``: the session's hand-over of a decision deferred to a step (``delay_overflow_check=True``),
        which ``update_scale()`` takes, since the code that calls it decides that step itself."""
        face = object.__new__(cls)
        face._engine = engine
        face._static_seq_len = 2000
        face._static_limits = (None, None)
        face._assigned_buf = None
        face._take_deferred = take_deferred
        return face

    # -- Apex's public methods ------------------------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        return self._engine.dynamic

    def loss_scale(self) -> float:
        return self._engine.loss_scale()

    def clear_overflow_state(self) -> None:
        if self._engine.device is not None:
            self._engine.clear_overflow()

    def unscale(
        self,
        model_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        unused_scale: float,
        models_are_masters: bool = False,
        scale_override: float | None = None,
    ) -> None:
        """``master = model * (1/scale)``; raises the overflow flag if any model grad is inf/NaN (Apex's fused path)."""
        scale = self.loss_scale() if scale_override is None else scale_override
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        if model_grads:
            multi_tensor_scale(0, self._flag_for(model_grads[0].device), [model_grads, master_grads], 1.0 / scale)

    def unscale_with_stashed(
        self,
        model_grads: Sequence[torch.Tensor],
        stashed_master_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        scale_override: tuple[float, float, float] | None = None,
    ) -> None:
        """``master = model * (out/grads_scale) + stashed * (out/stashed_scale)``; checks only the model grads.

        ``scale_override`` is Apex's ``(grads_have_scale, stashed_have_scale, out_scale)``; by default the model
        grads carry the current scale and the stash none.
        """
        grads_scale, stashed_scale, out_scale = (
            (self.loss_scale(), 1.0, 1.0) if scale_override is None else scale_override
        )
        if model_grads:
            multi_tensor_axpby(
                0,
                self._flag_for(model_grads[0].device),
                [model_grads, stashed_master_grads, master_grads],
                out_scale / grads_scale,
                out_scale / stashed_scale,
                0,
            )

    def update_scale(self) -> bool:
        """Fold the overflow flag into the scale (Apex's rules, run by the engine); returns whether to skip.

        As in Apex, a static scale ignores the flag: it never skips and counts every call as clean.
        """
        engine = self._engine
        if engine.device is None:
            engine.materialize(_default_device())
        # After delay_overflow_check=True blocks Apex decided nothing: the code calling this decides the step
        # (BERT's run_pretraining), so the session's step() must not decide (and update the scale) again.
        settle = None if self._take_deferred is None else self._take_deferred(engine)
        if self._assigned_buf is not None:
            # Apex read ``self._overflow_buf.item()``: a buffer the code assigned (its own kernels' flag) decides.
            engine.set_overflow(bool(self._assigned_buf.item()))
        should_skip = self.dynamic and self._has_overflow
        if settle is not None:
            # A step the code takes anyway after an overflow still leaves the weights alone (any scale).
            settle(engine.lend_flag())
        if not self.dynamic:
            engine.clear_overflow()
        engine.update()
        return should_skip

    # -- Apex's private fields ------------------------------------------------------------------------------
    @property
    def _loss_scale(self) -> float:
        return self._engine.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        # Legacy code sets the starting scale this way (e.g. ``loss_scalers[0]._loss_scale = 2.**10``).
        self._engine.set_loss_scale(value)

    @property
    def _unskipped(self) -> int:
        return self._engine.unskipped()

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._engine.set_unskipped(value)

    @property
    def _scale_seq_len(self) -> int:
        """Clean ``update_scale()`` calls before a dynamic scale doubles (Apex's ``scale_window``); settable."""
        config = self._engine.config
        return self._static_seq_len if config is None else config.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        config = self._engine.config
        if config is None:
            self._static_seq_len = value  # Apex stores it for a static scale too, and never uses it
            return
        self._engine.reconfigure(dataclasses.replace(config, growth_interval=value))

    @property
    def _max_loss_scale(self) -> float | None:
        config = self._engine.config
        return self._static_limits[1] if config is None else config.max_scale

    @property
    def _min_loss_scale(self) -> float | None:
        config = self._engine.config
        return self._static_limits[0] if config is None else config.min_scale

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """The overflow flag (one element, 1 after an overflow) that ``unscale`` raises and ``update_scale`` reads.

        Assignable, as Apex's plain attribute was: BERT's ``run_pretraining.py`` sets its own ``amp_C`` buffer
        (``scaler._overflow_buf = overflow_buf; scaler.update_scale()``); ``update_scale()`` then reads that one."""
        if self._assigned_buf is not None:
            return self._assigned_buf
        if self._engine.device is None:
            # A session's scaler before its first scale_loss: nothing has been checked yet, and the flag will be
            # created on the loss's device then.
            return torch.zeros(1, dtype=torch.float32)
        return self._engine.writable_flag()  # legacy code may pass it to a kernel that raises it

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(f"_overflow_buf must be a one-element tensor, got {value!r}")
        self._assigned_buf = value

    @property
    def _has_overflow(self) -> bool:
        """Whether the flag is raised (a host read, as Apex's ``_overflow_buf.item()``); settable."""
        return self._engine.device is not None and bool(self._engine.found_inf.item())

    @_has_overflow.setter
    def _has_overflow(self, value: bool) -> None:
        if self._engine.device is None:
            self._engine.materialize(_default_device())  # made on the default device before the first scale_loss
        self._engine.set_overflow(value)

    def _flag_for(self, device: torch.device) -> torch.Tensor:
        """The flag, to be written (a lent one is copied first: ``LossScaler.writable_flag``)."""
        if self._engine.device is None:
            self._engine.materialize(device)
        return self._engine.writable_flag()

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self.loss_scale()}, unskipped={self._unskipped})"
