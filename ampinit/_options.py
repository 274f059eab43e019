"""The options of one ``initialize()`` call, checked and resolved once (policy layer: plain data, no torch state).

:func:`resolve_options` takes ``initialize``'s arguments (the models and optimizers aside) and returns a frozen
:class:`AmpOptions`. Every check on an option's value lives here or in :func:`ampinit._opt_levels.resolve`, which
applies Apex's override rules to the level's properties, so the layers above read options and never re-check
them. The defaults are ``initialize``'s: this function takes every option explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ampinit._loss_scale import DynamicLossScale
from ampinit._opt_levels import BF16_MASTER_WEIGHTS, LEVELS, Properties, did_you_mean, resolve
from ampinit._types import CAST_POLICIES, CastPolicyName

#: How an optimizer's moments are stored between steps: torch's fp32 tensors, bf16 (stochastically rounded) or
#: 8-bit block-wise quantized (``ampinit._masters.precision``).
OptimizerStateName = Literal["fp32", "bf16", "8bit"]
OPTIMIZER_STATES: tuple[OptimizerStateName, ...] = ("fp32", "bf16", "8bit")

#: ``initialize``'s default ceiling of the dynamic loss scale (Apex's).
DEFAULT_MAX_LOSS_SCALE = 2.0**24


@dataclass(frozen=True)
class AmpOptions:
    """Everything one :func:`ampinit.initialize` call asked for, after checks and Apex's override rules.

    Attributes:
        properties: the opt level's properties with the overrides applied (Apex's ``Properties``).
        loss_scale: what each loss scaler starts from: a static scale, or the dynamic rules, with ``initialize``'s
            ``min_loss_scale``/``max_loss_scale`` already folded into the :class:`DynamicLossScale`.
        num_losses, verbosity, cast_model_outputs, cast_policy, allow_banned, sync_free, skip_nonfinite,
            allow_half_model, optimizer_state: as given to ``initialize``.
        stuck_weights_every: measure stuck weights at every N-th step of each optimizer (``ampinit._stuck``);
            None: never.
    """

    properties: Properties
    loss_scale: float | DynamicLossScale
    num_losses: int
    verbosity: int
    cast_model_outputs: torch.dtype | None
    cast_policy: CastPolicyName
    allow_banned: bool
    sync_free: bool | None
    skip_nonfinite: bool
    allow_half_model: bool
    stuck_weights_every: int | None = None
    optimizer_state: OptimizerStateName = "fp32"

    @property
    def enabled(self) -> bool:
        return self.properties.enabled


def resolve_options(
    *,
    enabled: bool,
    opt_level: object,
    cast_model_type: object,
    patch_torch_functions: object,
    patch_torch_functions_type: object,
    keep_batchnorm_fp32: object,
    master_weights: object,
    loss_scale: object,
    cast_model_outputs: object,
    num_losses: object,
    verbosity: object,
    min_loss_scale: object,
    max_loss_scale: object,
    cast_policy: object,
    allow_banned: object,
    sync_free: object,
    skip_nonfinite: object,
    allow_half_model: object,
    stuck_weights_every: object,
    optimizer_state: object,
) -> AmpOptions:
    """Check every option once and resolve the level's properties; the first bad value raises."""
    floor, ceiling = _scale_bounds(min_loss_scale, max_loss_scale)
    overrides = {
        "cast_model_type": cast_model_type,
        "patch_torch_functions": patch_torch_functions,
        "patch_torch_functions_type": patch_torch_functions_type,
        "keep_batchnorm_fp32": keep_batchnorm_fp32,
        "master_weights": master_weights,
        "loss_scale": loss_scale,
    }
    properties = _properties(enabled, opt_level, overrides)
    options = AmpOptions(
        properties=properties,
        loss_scale=_scale_setting(properties, floor, ceiling),
        num_losses=_count("num_losses", num_losses, minimum=1),
        verbosity=_count("verbosity", verbosity, minimum=0),
        cast_model_outputs=_output_dtype(cast_model_outputs),
        cast_policy=_cast_policy(cast_policy),
        allow_banned=_flag("allow_banned", allow_banned),
        sync_free=_sync_free(sync_free),
        skip_nonfinite=_flag("skip_nonfinite", skip_nonfinite),
        allow_half_model=_flag("allow_half_model", allow_half_model),
        stuck_weights_every=_interval("stuck_weights_every", stuck_weights_every),
        optimizer_state=_optimizer_state(optimizer_state, properties),
    )
    if options.sync_free and isinstance(options.loss_scale, DynamicLossScale) and options.loss_scale.raise_at_min:
        raise ValueError("DynamicLossScale(raise_at_min=True) needs a host sync per step; it cannot be sync_free")
    return options


def _properties(enabled: object, opt_level: object, overrides: dict[str, object]) -> Properties:
    if not enabled:
        # Apex ignores the level and its overrides when amp is off; so does ampinit.
        return resolve(opt_level if isinstance(opt_level, str) and opt_level in LEVELS else "O0", {"enabled": False})
    return resolve(opt_level, {"enabled": enabled, **overrides})


def _optimizer_state(value: object, properties: Properties) -> OptimizerStateName:
    state = next((name for name in OPTIMIZER_STATES if value == name and isinstance(value, str)), None)
    if state is None:
        raise ValueError(
            f"optimizer_state must be one of {list(OPTIMIZER_STATES)}, got {value!r}"
            f"{did_you_mean(value, OPTIMIZER_STATES)}"
        )
    if state != "fp32" and properties.enabled and not properties.uses_master_weights:
        # Without masters the optimizer's own step() runs, and it reads its state as fp32 tensors.
        raise ValueError(
            f"optimizer_state={state!r} needs master weights (amp takes the step and stores the moments), but "
            f"{properties.opt_level} has master_weights={properties.master_weights!r}: use opt_level='O5' (bf16 "
            f"model) or 'O2', or pass master_weights=True or one of {list(BF16_MASTER_WEIGHTS)} with a bf16 model"
        )
    return state


def _count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _interval(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1 (every N-th step) or None (off), got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 (every N-th step) or None (off), got {value!r}")
    return value


def _cast_policy(value: object) -> CastPolicyName:
    if not isinstance(value, str):
        raise TypeError(f"cast_policy must be a str, one of {list(CAST_POLICIES)}, got {value!r}")
    for name in CAST_POLICIES:
        if value == name:
            return name
    raise ValueError(
        f"cast_policy must be one of {list(CAST_POLICIES)}, got {value!r}{did_you_mean(value, CAST_POLICIES)}"
    )


def _dtype_or_none(name: str, value: object) -> torch.dtype | None:
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or None, got {value!r}")
    return value


def _output_dtype(value: object) -> torch.dtype | None:
    dtype = _dtype_or_none("cast_model_outputs", value)
    if dtype is not None and not dtype.is_floating_point:
        # Only floating outputs are cast, and cast to a non-floating dtype they would leave autograd.
        raise ValueError(f"cast_model_outputs must be a floating-point torch.dtype or None, got {dtype!r}")
    return dtype


def _sync_free(value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"sync_free must be True, False or None (the default: decide a dynamic scale's skips on the device "
            f"wherever reading them would wait for it), got {value!r}"
        )
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _scale_bounds(min_loss_scale: object, max_loss_scale: object) -> tuple[float | None, float]:
    """``initialize``'s floor and ceiling for a dynamic scale; a floor of ``None`` or 0 means none (Apex's)."""
    floor = None if min_loss_scale is None else _bound("min_loss_scale", min_loss_scale)
    ceiling = _bound("max_loss_scale", max_loss_scale)
    if floor and floor > ceiling:
        raise ValueError(f"min_loss_scale ({min_loss_scale!r}) must not exceed max_loss_scale ({max_loss_scale!r})")
    return floor, ceiling


def _bound(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def _scale_setting(properties: Properties, floor: float | None, ceiling: float) -> float | DynamicLossScale:
    setting = properties.loss_scale
    if isinstance(setting, DynamicLossScale):
        if floor is not None or ceiling != DEFAULT_MAX_LOSS_SCALE:
            raise ValueError(
                "With loss_scale=DynamicLossScale(...), set min_scale and max_scale on the DynamicLossScale, "
                f"not min_loss_scale={floor!r} / max_loss_scale={ceiling!r} on initialize()."
            )
        return setting
    if setting == "dynamic":
        return DynamicLossScale(min_scale=floor or None, max_scale=ceiling)
    return float(setting)
