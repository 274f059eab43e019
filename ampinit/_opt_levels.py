"""Opt levels: the property table, Apex's override rules, and one pure validation function.

This is the policy layer: plain data and checks, no torch state is touched. O0-O3 follow NVIDIA Apex exactly
(values, ``brief`` strings, override messages); O4 and O5 are ROCm Apex's bfloat16 levels.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ampinit._loss_scale import DynamicLossScale
from ampinit._types import HALF_DTYPES, MODEL_DTYPES, OPT_LEVELS, OptLevel

LossScaleSetting = float | Literal["dynamic"] | DynamicLossScale
#: ``True``: fp32 masters; ``"remainder"``: bf16 weights plus 16-bit remainders (``ampinit._masters.remainder``);
#: ``"remainder8"``: bf16 weights plus 8-bit remainders; ``"stochastic"``: the bf16 weights alone, updated with
#: stochastic rounding (``ampinit._masters.precision``, ``ampinit._masters.dial_grads``).
BF16MasterWeights = Literal["remainder", "remainder8", "stochastic"]
MasterWeights = bool | BF16MasterWeights | None
#: The ``master_weights`` values kept in (or as) the bf16 weight, which need a bfloat16 model.
BF16_MASTER_WEIGHTS: tuple[BF16MasterWeights, ...] = ("remainder", "remainder8", "stochastic")

#: The order in which Apex applies overrides; each is checked against the selected opt level.
OVERRIDE_ORDER: tuple[str, ...] = (
    "enabled",
    "opt_level",
    "cast_model_type",
    "patch_torch_functions",
    "patch_torch_functions_type",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
)


@dataclass(frozen=True)
class Properties:
    """The resolved options of one :func:`ampinit.initialize` call (Apex's ``Properties``, made immutable)."""

    enabled: bool
    opt_level: OptLevel
    cast_model_type: torch.dtype | Literal[False] | None
    patch_torch_functions: bool | None
    patch_torch_functions_type: torch.dtype | None
    keep_batchnorm_fp32: bool | None
    master_weights: MasterWeights
    loss_scale: LossScaleSetting

    # Derived views, so that no layer above re-derives them differently.
    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the model is cast to, or ``None`` when the model is left alone."""
        return self.cast_model_type or None

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """The lower-precision dtype of the function-cast policy (O1/O4), or ``None`` when there is none."""
        if not self.patch_torch_functions:
            return None
        return self.patch_torch_functions_type or torch.float16

    @property
    def dynamic(self) -> bool:
        return not isinstance(self.loss_scale, float)

    @property
    def uses_master_weights(self) -> bool:
        return bool(self.master_weights)

    @property
    def remainder_masters(self) -> bool:
        """Masters kept in or as the bf16 weight (``master_weights="remainder"``, ``"remainder8"``, ``"stochastic"``):
        no fp32 master tensors, amp takes every step."""
        return self.master_weights in BF16_MASTER_WEIGHTS

    @property
    def short_circuits(self) -> bool:
        """True when ``scale_loss`` has nothing to do: no masters, no dynamic scale, a scale of 1 (Apex's rule)."""
        return not self.uses_master_weights and not self.dynamic and self.loss_scale == 1.0

    def options(self) -> dict[str, Any]:
        """The options in Apex's order, as Apex printed them."""
        return {name: getattr(self, name) for name in OVERRIDE_ORDER}


@dataclass(frozen=True)
class OptLevelSpec:
    brief: str
    defaults: Properties


def _level(
    level: OptLevel,
    brief: str,
    cast_model_type: torch.dtype | None,
    patch: bool | None,
    patch_type: torch.dtype | None,
    keep_bn: bool | None,
    master: bool | None,
    loss_scale: LossScaleSetting,
) -> OptLevelSpec:
    return OptLevelSpec(brief, Properties(True, level, cast_model_type, patch, patch_type, keep_bn, master, loss_scale))


# Values quoted from Apex's frontend.py (O0-O3) and ROCm apex's frontend.py (O4, O5).
_TABLE = (
    _level("O0", "O0:  Pure FP32 training.\n", torch.float32, False, None, None, False, 1.0),
    _level(
        "O1",
        "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
        None,
        True,
        torch.float16,
        None,
        None,
        "dynamic",
    ),
    _level(
        "O2",
        "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
        torch.float16,
        False,
        None,
        True,
        True,
        "dynamic",
    ),
    _level("O3", "O3:  Pure FP16 training.", torch.float16, False, None, False, False, 1.0),
    _level(
        "O4",
        "O4:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
        None,
        True,
        torch.bfloat16,
        None,
        None,
        1.0,
    ),
    _level(
        "O5",
        "O5:  BFLOAT16 training with FP32 batchnorm and FP32 master weights.\n",
        torch.bfloat16,
        None,
        None,
        True,
        True,
        1.0,
    ),
)
LEVELS: dict[OptLevel, OptLevelSpec] = {spec.defaults.opt_level: spec for spec in _TABLE}

# The levels that cast around functions (O1/O4) rather than casting the model, read from the table.
FUNCTION_CAST_LEVELS = tuple(level for level, spec in LEVELS.items() if spec.defaults.patch_torch_functions)


def unknown_level_message(opt_level: object) -> str:
    message = (
        f"Unexpected optimization level {opt_level}. Options are {', '.join(map(repr, OPT_LEVELS))}.  "
        "Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
    )
    if isinstance(opt_level, str):
        # "o2", "02", " O2": a near miss of a valid level gets the level it most likely meant.
        guess = opt_level.strip().upper()
        guess = "O" + guess[1:] if guess[:1] == "0" else guess
        if guess in LEVELS:
            message += f" Did you mean {guess!r}?"
    return message


def resolve(opt_level: object, overrides: Mapping[str, Any]) -> Properties:
    """Apply ``overrides`` (the non-``None`` keyword arguments of ``initialize``) to ``opt_level``'s preset.

    Checks follow Apex's ``Properties.__setattr__``: each override is checked against the selected level, in
    Apex's order, and the first violation raises. Apex's loose strings are accepted ("True", "False", "128.0").
    """
    if not isinstance(opt_level, str) or opt_level not in LEVELS:  # a list or set would not even hash
        raise RuntimeError(unknown_level_message(opt_level))
    level: OptLevel = opt_level
    unexpected = set(overrides) - set(OVERRIDE_ORDER)
    if unexpected:
        raise ValueError(f"Tried to set unexpected option(s) {sorted(unexpected)}; allowed: {list(OVERRIDE_ORDER)}")
    changes: dict[str, Any] = {}
    for name in OVERRIDE_ORDER:
        if name in overrides and overrides[name] is not None and name != "opt_level":
            changes[name] = _CHECKS[name](level, overrides[name])
    properties = dataclasses.replace(LEVELS[level].defaults, **changes)
    _check_remainder_dtype(properties)
    return properties


def _loose_bool(name: str, value: object) -> bool:
    if value in ("True", "False"):
        return value == "True"
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be a boolean or the string 'True' or 'False', found {name}={value!r}")


def _check_enabled(level: OptLevel, value: object) -> bool:
    return _loose_bool("enabled", value)


def _check_cast_model_type(level: OptLevel, value: object) -> torch.dtype | Literal[False]:
    if value is False:
        return False
    if not isinstance(value, torch.dtype):
        raise TypeError(f"cast_model_type must be a torch.dtype, False or None, got {value!r}")
    if value not in MODEL_DTYPES:
        raise ValueError(f"cast_model_type must be one of {list(MODEL_DTYPES)}, got {value!r}")
    if level in FUNCTION_CAST_LEVELS and value is not torch.float32:
        raise RuntimeError(
            f"{level} inserts casts around Torch functions rather than model weights, so with {level}, the model "
            "weights themselves should remain FP32. If you wish to cast the model to a different type, use "
            f"opt_level='O2' or 'O3'. cast_model_type was {value}"
        )
    return value


def _check_patch_torch_functions(level: OptLevel, value: object) -> bool:
    flag = _loose_bool("patch_torch_functions", value)
    if level not in FUNCTION_CAST_LEVELS and flag:
        raise RuntimeError(
            "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'."
            if level in ("O0", "O2", "O3")
            else "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1' or 'O4'."
        )
    return flag


def _check_patch_torch_functions_type(level: OptLevel, value: object) -> torch.dtype:
    if level not in FUNCTION_CAST_LEVELS:
        raise RuntimeError(
            "Currently, patch_torch_functions_type should only be set by selecting opt_level='O1' or 'O4'."
        )
    # ROCm apex pins O1 to float16 and O4 to bfloat16; ampinit lets either level take either half dtype,
    # so that a dtype override works on every level.
    if value not in HALF_DTYPES:
        raise ValueError(f"patch_torch_functions_type must be one of {list(HALF_DTYPES)}, got {value!r}")
    assert isinstance(value, torch.dtype)
    return value


def _check_keep_batchnorm_fp32(level: OptLevel, value: object) -> bool:
    if level in FUNCTION_CAST_LEVELS:
        raise RuntimeError(
            f"With opt_level {level}, batchnorm functions are automatically patched to run in FP32, so "
            f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}"
        )
    if value in ("True", "False"):
        return value == "True"
    if isinstance(value, bool):
        return value
    # Apex raised AssertionError here; a bad value is a ValueError in ampinit (same message).
    raise ValueError(
        "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, "
        f"found keep_batchnorm_fp32={value}"
    )


def _check_master_weights(level: OptLevel, value: object) -> MasterWeights:
    if level in FUNCTION_CAST_LEVELS:
        raise RuntimeError(
            f"It doesn't make sense to use master_weights with {level}. With {level}, your model weights "
            "themselves should be FP32."
        )
    for name in BF16_MASTER_WEIGHTS:
        if value == name:
            return name
    if value in ("True", "False") or isinstance(value, bool):
        return _loose_bool("master_weights", value)
    raise ValueError(
        f"master_weights must be True, False, {', '.join(map(repr, BF16_MASTER_WEIGHTS))} or None (or the strings "
        f"'True'/'False'), found master_weights={value!r}{did_you_mean(value, BF16_MASTER_WEIGHTS)}"
    )


def did_you_mean(value: object, allowed: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for a string close to one of ``allowed`` (difflib), else the empty string."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value.strip().lower(), [a.lower() for a in allowed], n=1, cutoff=0.6)
    if not close:
        return ""
    return f". Did you mean {next(a for a in allowed if a.lower() == close[0])!r}?"


def _check_remainder_dtype(properties: Properties) -> None:
    # Checked on the resolved properties: the model dtype may come from the level or from cast_model_type.
    if properties.master_weights in BF16_MASTER_WEIGHTS and properties.model_dtype != torch.bfloat16:
        raise ValueError(
            f"master_weights={properties.master_weights!r} needs a bfloat16 model (opt_level='O5', or "
            f"cast_model_type=torch.bfloat16), got model dtype {properties.model_dtype} at {properties.opt_level}: "
            "the weight is the upper half of each fp32 master, which a remainder completes (or stochastic rounding "
            "updates) only for a bf16 weight; an fp16 weight has other exponent and mantissa widths and "
            "needs a full fp32 master (master_weights=True)."
        )


def _check_loss_scale(level: OptLevel, value: object) -> LossScaleSetting:
    if value == "dynamic" or isinstance(value, DynamicLossScale):
        return value
    if isinstance(value, bool):
        raise TypeError(
            f"loss_scale must be a number, a numeric string, 'dynamic' or a DynamicLossScale, got {value!r}"
        )
    try:
        scale = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be a number, a numeric string such as '128.0', 'dynamic' or a DynamicLossScale, "
            f"got {value!r}"
        ) from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"A static loss_scale must be a finite number > 0, got {value!r}")
    return scale


_CHECKS: dict[str, Any] = {
    "enabled": _check_enabled,
    "cast_model_type": _check_cast_model_type,
    "patch_torch_functions": _check_patch_torch_functions,
    "patch_torch_functions_type": _check_patch_torch_functions_type,
    "keep_batchnorm_fp32": _check_keep_batchnorm_fp32,
    "master_weights": _check_master_weights,
    "loss_scale": _check_loss_scale,
}


def describe(properties: Properties) -> list[str]:
    """Apex's option table, one ``"name : value"`` line per option."""
    return [f"{name:26} : {value}" for name, value in properties.options().items()]
