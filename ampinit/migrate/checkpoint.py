"""Apex checkpoints for native torch.amp: the loss scaler's state as ``GradScaler`` state, Apex ``FusedAdam``
state as ``torch.optim.AdamW``/``Adam`` state, an O2 checkpoint whole.

An Apex O2 checkpoint (saved as Apex's docs say: ``{'model': model.state_dict(), 'optimizer':
optimizer.state_dict(), 'amp': amp.state_dict()}``) already holds fp32 model weights (Apex's state-dict hook) and
an optimizer state whose indices follow the param groups with the fp32 masters in the model parameters' places,
with fp32 state tensors. So the model part loads into a plain fp32 model as it is; the amp part changes format,
and so does the optimizer part where ``ampinit migrate --to torch`` replaced the optimizer: FusedAdam (Apex's, or
ampinit's, which keeps Apex's layout) counts steps once per parameter group (``group['step']``), torch's Adam and
AdamW once per parameter (``state[i]['step']``), and their ``load_state_dict`` raises ``KeyError: 'step'`` on the
former. The moments (``exp_avg``, ``exp_avg_sq``) are the same in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["convert_apex_checkpoint", "grad_scaler_state", "torch_optimizer_state"]


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


#: Group keys that only Apex's other Adam-family optimizers have, and which of them it is: torch.optim has no LAMB
#: and no NovoGrad, so ``ampinit migrate --to torch`` keeps them (the file is refused) and their state has no target.
_NOT_ADAM = {"max_grad_norm": "FusedLAMB", "norm_type": "FusedNovoGrad", "grad_averaging": "FusedLAMB/FusedNovoGrad"}
#: Per-parameter state of Apex's FusedAdam that torch's Adam/AdamW hold too.
_ADAM_STATE = frozenset({"exp_avg", "exp_avg_sq"})


def torch_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``torch.optim.AdamW``/``Adam`` state from an Apex ``FusedAdam`` ``state_dict()`` (or ampinit's), for the
    torch optimizer ``ampinit migrate --to torch`` wrote in its place; any other state is returned as it is.

    FusedAdam's state is recognised by its groups' ``bias_correction`` key, which torch's optimizers do not have.
    Each parameter's ``step`` becomes its group's step count: the step number Apex's next update would have used
    for it. It is stored as a Python float, which torch's ``load_state_dict`` turns into its own step tensor
    (dtype and device as that torch version and the optimizer's ``fused``/``capturable`` want). The group's
    ``step`` and ``bias_correction`` go; its hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``, and
    keys such as a scheduler's ``initial_lr``) stay, and torch fills in its other options with its defaults.
    Parameter indices are the same in both. Tensors are shared with ``state``, which is left unchanged.

    Raises ``ValueError`` for Apex state that no torch optimizer takes: FusedLAMB's or FusedNovoGrad's,
    ``bias_correction=False`` (torch always corrects), or per-parameter state other than the two moments.
    State already in torch's layout (checkpoints saved after the migration), FusedSGD's (``momentum_buffer``,
    torch SGD's own layout) and any other optimizer's pass through.
    """
    groups = state["param_groups"]
    if not any("bias_correction" in group for group in groups):
        return dict(state)
    per_param = dict(state["state"])
    converted_groups = []
    for number, group in enumerate(groups):
        others = [key for key in _NOT_ADAM if key in group]  # the most telling key first
        if others:
            raise ValueError(
                f"param_groups[{number}] is {_NOT_ADAM[others[0]]} state (it has {others!r}): "
                "torch.optim has no such optimizer, so no torch optimizer can resume it; run the script with "
                "`ampinit run` or migrate it with --to ampinit, which keep this optimizer"
            )
        if not group.get("bias_correction", True):
            raise ValueError(
                f"param_groups[{number}] is FusedAdam(bias_correction=False) state: torch's Adam and AdamW always "
                "correct the bias, so neither resumes it exactly (ampinit migrate --to torch keeps such a FusedAdam)"
            )
        step = float(group.get("step", 0))
        for index in group["params"]:
            if index not in per_param or "step" in per_param[index]:
                continue
            extra = sorted(set(per_param[index]) - _ADAM_STATE)
            if extra:
                raise ValueError(
                    f"parameter {index} has FusedAdam state {extra!r} besides {sorted(_ADAM_STATE)!r}, which "
                    "torch's Adam and AdamW do not keep (master weights are O2's): resume it with `ampinit run`"
                )
            per_param[index] = {"step": step, **per_param[index]}
        converted_groups.append({key: value for key, value in group.items() if key not in ("step", "bias_correction")})
    return {**state, "state": per_param, "param_groups": converted_groups}


def convert_apex_checkpoint(
    checkpoint: Mapping[str, Any],
    *,
    amp_key: str = "amp",
    model_key: str = "model",
    scaler_key: str = "scaler",
    optimizer_key: str = "optimizer",
) -> dict[str, Any]:
    """An Apex checkpoint as a native torch.amp one: ``checkpoint[amp_key]`` becomes ``checkpoint[scaler_key]``
    (GradScaler state), FusedAdam state in ``checkpoint[optimizer_key]`` becomes the state of the
    ``torch.optim.AdamW``/``Adam`` that ``ampinit migrate --to torch`` put in its place (:func:`torch_optimizer_state`,
    whose ``ValueError`` names state no torch optimizer takes), and any half-precision floating tensor in
    ``checkpoint[model_key]`` becomes fp32 (for checkpoints saved without Apex's fp32 state-dict hook). Everything
    else is kept as it is; ``checkpoint`` itself is left unchanged."""
    if amp_key not in checkpoint:
        raise KeyError(f"The checkpoint has no {amp_key!r} entry (keys: {list(checkpoint)!r})")
    converted = {key: value for key, value in checkpoint.items() if key != amp_key}
    converted[scaler_key] = grad_scaler_state(checkpoint[amp_key])
    optimizer_state = checkpoint.get(optimizer_key)
    if isinstance(optimizer_state, Mapping) and "param_groups" in optimizer_state:
        converted[optimizer_key] = torch_optimizer_state(optimizer_state)
    model_state = checkpoint.get(model_key)
    if isinstance(model_state, Mapping):
        converted[model_key] = {
            k: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v
            for k, v in model_state.items()
        }
    return converted
