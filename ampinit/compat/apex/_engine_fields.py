"""Apex's scalers expose their scale and clean-step count as plain fields that legacy code assigns; on ampinit's
engine scaler those two live in its state, so an assignment reloads that state with one of them changed."""

from __future__ import annotations

from ampinit._scaler import LossScaler as EngineScaler


def set_loss_scale(engine: EngineScaler, value: float) -> None:
    """Make ``value`` the engine scaler's current loss scale, keeping its count of clean steps."""
    engine.load_state_dict({"loss_scale": float(value), "unskipped": engine.unskipped()})


def set_unskipped(engine: EngineScaler, value: int) -> None:
    """Make ``value`` the engine scaler's count of clean steps, keeping its loss scale."""
    engine.load_state_dict({"loss_scale": engine.loss_scale(), "unskipped": int(value)})
