"""Apex checkpoints for native torch.amp: the loss scaler's state as ``GradScaler`` state, an O2 checkpoint whole.

An Apex O2 checkpoint (saved as Apex's docs say: ``{'model': model.state_dict(), 'optimizer':
optimizer.state_dict(), 'amp': amp.state_dict()}``) already holds fp32 model weights (Apex's state-dict hook) and
an optimizer state whose indices follow the param groups with the fp32 masters in the model parameters' places,
with fp32 state tensors. So the model and optimizer parts load into a plain fp32 model and its torch optimizer as
they are; only the amp part changes format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["convert_apex_checkpoint", "grad_scaler_state"]


def grad_scaler_state(
    amp_state: Mapping[str, Any],
    loss_id: int = 0,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> dict[str, Any]:
    """``torch.amp.GradScaler`` state from Apex's ``amp.state_dict()`` (or ampinit's): scale and growth tracker.

    Apex's ``unskipped`` (clean steps since the last scale change) is GradScaler's ``_growth_tracker``. The
    defaults are Apex's schedule (halve on overflow, double after 2000 clean steps), which GradScaler's defaults
    also are. Entries are taken by position, as Apex's ``load_state_dict`` does.
    """
    entries = [value for key, value in amp_state.items() if "loss_scaler" in key]
    if not 0 <= loss_id < len(entries):
        raise ValueError(
            f"loss_id={loss_id!r} is out of range: the amp state has {len(entries)} loss scaler(s) "
            f"({list(amp_state)!r})"
        )
    entry = entries[loss_id]
    try:
        scale, unskipped = float(entry["loss_scale"]), int(entry["unskipped"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"An amp loss-scaler entry needs 'loss_scale' and 'unskipped', got {entry!r}") from err
    return {
        "scale": scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "_growth_tracker": unskipped,
    }


def convert_apex_checkpoint(
    checkpoint: Mapping[str, Any],
    *,
    amp_key: str = "amp",
    model_key: str = "model",
    scaler_key: str = "scaler",
) -> dict[str, Any]:
    """An Apex checkpoint as a native torch.amp one: ``checkpoint[amp_key]`` becomes ``checkpoint[scaler_key]``
    (GradScaler state), and any half-precision floating tensor in ``checkpoint[model_key]`` becomes fp32 (for
    checkpoints saved without Apex's fp32 state-dict hook). Everything else is kept as it is."""
    if amp_key not in checkpoint:
        raise KeyError(f"The checkpoint has no {amp_key!r} entry (keys: {list(checkpoint)!r})")
    converted = {key: value for key, value in checkpoint.items() if key != amp_key}
    converted[scaler_key] = grad_scaler_state(checkpoint[amp_key])
    model_state = checkpoint.get(model_key)
    if isinstance(model_state, Mapping):
        converted[model_key] = {
            k: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v
            for k, v in model_state.items()
        }
    return converted
