"""``apex.amp.frontend``: ``initialize``, ``state_dict`` and ``load_state_dict`` with Apex's exact signatures.

Apex's loose inputs are converted here, once, and everything else is ampinit's strict core:

* LARC-wrapped optimizers: the inner optimizer goes to ampinit, the LARC object comes back in its place;
* every optimizer gets Apex's ``_amp_stash`` and ``_lazy_init_maybe_master_weights()`` (see ``_stash``);
* ``_amp_state.allow_incoming_model_not_fp32``: models whose weights are already fp16, bf16 or mixed are
  accepted at every level, as in Apex. The level then does what it does to any model: O0/O2/O3/O5 cast it
  (O2/O5 build fp32 masters from the half values, as Apex did), O1/O4 and ``cast_model_type=False`` leave it
  as it is and cast around it;
* O1/O4 cast by Apex's exact lists (``cast_policy="apex"``), not by ampinit's default ``"auto"``, which leaves
  out entries measured to change no result;
* at O1 (fp16 function casts), Apex's tensor rules that code written for it depends on (``.cpu()`` of a half
  tensor gives float32; ``exp_`` and the other in-place forms of Apex's fp32 functions refuse fp16 tensors with
  Apex's ``NotImplementedError``): :func:`follow_apex_tensor_rules`, undone when the session closes.
"""

from __future__ import annotations

from typing import Any, cast

import torch

import ampinit
from ampinit import Properties
from ampinit._types import OptLevel
from ampinit.compat.apex import _loose
from ampinit.compat.apex.amp import _stash
from ampinit.compat.apex.amp._amp_state import _amp_state
from ampinit.compat.apex.amp.handle import unwrap_optimizer

__all__ = ["Properties", "initialize", "load_state_dict", "state_dict"]


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
    *,
    optimizer_state: str = "fp32",
) -> Any:
    """Apex's ``amp.initialize``: same signature, defaults and return shape (see :func:`ampinit.initialize`).

    The values Apex accepted are converted first (``verbosity=is_master``, ``enabled=None``, numpy numbers:
    see ``_loose``). ``optimizer_state`` (keyword only, not Apex's) and ``master_weights``'s ampinit values
    (``"remainder"``, ``"remainder8"``, ``"stochastic"``) set the precision dial (docs/precision.md)."""
    enabled = _loose.truth(enabled)  # type: ignore[assignment]
    inner = _unwrap_optimizers(optimizers)
    result = ampinit.initialize(  # type: ignore[call-overload]  # the converted values are Apex-typed objects
        models,
        inner,
        enabled=enabled,
        opt_level=cast(OptLevel, opt_level),  # Apex's signature takes any str; initialize refuses a bad one by name
        cast_model_type=cast_model_type,
        patch_torch_functions=_loose.optional_truth(patch_torch_functions),
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=_loose.optional_truth(master_weights),
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        num_losses=_loose.whole_number("num_losses", num_losses),
        verbosity=_loose.whole_number("verbosity", verbosity),
        min_loss_scale=_loose.real_number(min_loss_scale),
        max_loss_scale=_loose.real_number(max_loss_scale),
        allow_half_model=bool(_amp_state.allow_incoming_model_not_fp32),
        optimizer_state=optimizer_state,
        cast_policy="apex",  # Apex's exact lists, not ampinit's default: legacy code gets the casts it was written for
    )
    if enabled:
        follow_apex_tensor_rules(_session_of(models))
        _attach_stashes(optimizers, inner)
    if optimizers is None or inner is optimizers:
        return result
    out_models, _ = result
    return out_models, optimizers  # the caller's LARC objects (their inner optimizers are now managed)


def _session_of(models: Any) -> ampinit.AmpSession | None:
    first = models[0] if isinstance(models, (list, tuple)) else models
    return ampinit.session_of(first)


def follow_apex_tensor_rules(session: ampinit.AmpSession | None) -> None:
    """Have ``session``'s O1 casts follow Apex's tensor rules too (``ampinit._casting.apex_tensor``).

    The session is closed again when that fails, so that ``initialize`` leaves nothing half-applied.
    """
    if session is None:
        return
    try:
        session.follow_apex_tensor_rules()
    except BaseException:
        session.close()
        raise


def _unwrap_optimizers(optimizers: Any) -> Any:
    if isinstance(optimizers, list):
        unwrapped = [unwrap_optimizer(o) for o in optimizers]
        return optimizers if all(a is b for a, b in zip(unwrapped, optimizers)) else unwrapped
    return unwrap_optimizer(optimizers) if optimizers is not None else None


def _attach_stashes(given: Any, inner: Any) -> None:
    """Apex's ``optimizer._amp_stash`` and ``_lazy_init_maybe_master_weights`` on each optimizer the caller holds."""
    if given is None:
        return
    pairs = zip(given, inner) if isinstance(given, list) else [(given, inner)]
    for holder, optimizer in pairs:
        _stash.attach(holder, optimizer)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's ``amp.state_dict()``: ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``."""
    return ampinit.state_dict(destination)


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Apex's ``amp.load_state_dict()`` (entries matched by position, as in Apex)."""
    ampinit.load_state_dict(state_dict)
