"""``apex.amp.frontend``: ``initialize``, ``state_dict`` and ``load_state_dict`` with Apex's exact signatures.

Apex's loose inputs are converted here, once, and everything else is ampinit's strict core:

* LARC-wrapped optimizers: the inner optimizer goes to ampinit, the LARC object comes back in its place;
* ``_amp_state.allow_incoming_model_not_fp32``: a half-precision model is accepted at the levels that cast the
  model anyway (O0, O2, O3, O5), by bringing it to fp32 first; Apex built its masters from the half values too,
  so the result is the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ampinit
from ampinit import Properties
from ampinit._types import HALF_DTYPES
from ampinit.compat.apex.amp._amp_state import _amp_state
from ampinit.compat.apex.amp.handle import unwrap_optimizer

__all__ = ["Properties", "initialize", "load_state_dict", "state_dict"]

_FUNCTION_CAST_LEVELS = ("O1", "O4")


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | str | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Apex's ``amp.initialize``: same signature, defaults and return shape (see :func:`ampinit.initialize`)."""
    inner = _unwrap_optimizers(optimizers)
    if _amp_state.allow_incoming_model_not_fp32 and enabled:
        _upcast_half_models(models, opt_level, cast_model_type)
    result = ampinit.initialize(
        models,
        inner,
        enabled=enabled,
        opt_level=opt_level,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )
    if optimizers is None or inner is optimizers:
        return result
    out_models, _ = result
    return out_models, optimizers  # the caller's LARC objects (their inner optimizers are now managed)


def _unwrap_optimizers(optimizers: Any) -> Any:
    if isinstance(optimizers, list):
        unwrapped = [unwrap_optimizer(o) for o in optimizers]
        return optimizers if all(a is b for a, b in zip(unwrapped, optimizers)) else unwrapped
    return unwrap_optimizer(optimizers) if optimizers is not None else None


def _upcast_half_models(models: Any, opt_level: str, cast_model_type: Any) -> None:
    model_list = models if isinstance(models, list) else [models]
    half = [m for m in model_list if isinstance(m, nn.Module) and _has_half_tensors(m)]
    if not half:
        return
    if opt_level in _FUNCTION_CAST_LEVELS or cast_model_type is False:
        raise RuntimeError(
            f"_amp_state.allow_incoming_model_not_fp32 is set and a model has half-precision weights, but "
            f"opt_level={opt_level!r} (cast_model_type={cast_model_type!r}) keeps the model's own weights: pass an "
            "fp32 model, or use opt_level='O2'/'O3', which cast the model themselves."
        )
    for model in half:
        model.float()


def _has_half_tensors(model: nn.Module) -> bool:
    return any(t.dtype in HALF_DTYPES for t in (*model.parameters(), *model.buffers()))


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's ``amp.state_dict()``: ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``."""
    return ampinit.state_dict(destination)


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Apex's ``amp.load_state_dict()`` (entries matched by position, as in Apex)."""
    ampinit.load_state_dict(state_dict)
