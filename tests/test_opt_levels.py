"""Opt-level table and override rules, checked against facts quoted from Apex (and ROCm apex for O4/O5)."""

from __future__ import annotations

import re

import pytest
import torch

from ampinit import DynamicLossScale
from ampinit._opt_levels import LEVELS, describe, resolve

# Apex's table (shared/reference/apex-amp.md §2) and ROCm apex's O4/O5 (apex/amp/frontend.py).
APEX_TABLE = {
    "O0": dict(
        cast_model_type=torch.float32,
        patch_torch_functions=False,
        keep_batchnorm_fp32=None,
        master_weights=False,
        loss_scale=1.0,
    ),
    "O1": dict(
        cast_model_type=None,
        patch_torch_functions=True,
        keep_batchnorm_fp32=None,
        master_weights=None,
        loss_scale="dynamic",
    ),
    "O2": dict(
        cast_model_type=torch.float16,
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    ),
    "O3": dict(
        cast_model_type=torch.float16,
        patch_torch_functions=False,
        keep_batchnorm_fp32=False,
        master_weights=False,
        loss_scale=1.0,
    ),
    "O4": dict(
        cast_model_type=None,
        patch_torch_functions=True,
        patch_torch_functions_type=torch.bfloat16,
        keep_batchnorm_fp32=None,
        master_weights=None,
        loss_scale=1.0,
    ),
    "O5": dict(
        cast_model_type=torch.bfloat16,
        patch_torch_functions=None,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale=1.0,
    ),
}
APEX_BRIEFS = {
    "O0": "O0:  Pure FP32 training.\n",
    "O1": "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
    "O2": "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
    "O3": "O3:  Pure FP16 training.",
}


@pytest.mark.parametrize("level", sorted(APEX_TABLE))
def test_level_defaults_match_apex(level: str) -> None:
    props = resolve(level, {})
    assert props.enabled is True and props.opt_level == level
    for name, expected in APEX_TABLE[level].items():
        assert getattr(props, name) == expected, name


@pytest.mark.parametrize("level", sorted(APEX_BRIEFS))
def test_briefs_match_apex(level: str) -> None:
    assert LEVELS[level].brief == APEX_BRIEFS[level]  # type: ignore[index]


@pytest.mark.parametrize("bad", ["01", "o1", "O6", 1, None])
def test_unknown_level_names_the_letter_o(bad: object) -> None:
    with pytest.raises(
        RuntimeError, match=re.escape(f"Unexpected optimization level {bad}. Options are 'O0', 'O1'")
    ) as info:
        resolve(bad, {})
    assert "the prefix O is the letter O, not the number zero." in str(info.value)


@pytest.mark.parametrize(
    ("level", "overrides", "message"),
    [
        (
            "O1",
            {"cast_model_type": torch.float16},
            "O1 inserts casts around Torch functions rather than model weights, so with O1, the model weights "
            "themselves should remain FP32. If you wish to cast the model to a different type, "
            "use opt_level='O2' or 'O3'. cast_model_type was torch.float16",
        ),
        (
            "O2",
            {"patch_torch_functions": True},
            "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.",
        ),
        (
            "O1",
            {"keep_batchnorm_fp32": True},
            "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so keep_batchnorm_fp32 "
            "should be None. keep_batchnorm_fp32 was True",
        ),
        (
            "O1",
            {"master_weights": True},
            "It doesn't make sense to use master_weights with O1. "
            "With O1, your model weights themselves should be FP32.",
        ),
    ],
)
def test_override_violations_raise_apex_messages(level: str, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RuntimeError, match=re.escape(message)):
        resolve(level, overrides)


def test_bad_keep_batchnorm_value_is_a_value_error_with_apex_text() -> None:
    with pytest.raises(ValueError, match=re.escape("found keep_batchnorm_fp32=maybe")):
        resolve("O2", {"keep_batchnorm_fp32": "maybe"})


@pytest.mark.parametrize(
    ("overrides", "name", "expected"),
    [
        ({"keep_batchnorm_fp32": "False"}, "keep_batchnorm_fp32", False),
        ({"keep_batchnorm_fp32": "True"}, "keep_batchnorm_fp32", True),
        ({"master_weights": "False"}, "master_weights", False),
        ({"loss_scale": "128.0"}, "loss_scale", 128.0),
        ({"loss_scale": 64}, "loss_scale", 64.0),
        ({"loss_scale": "dynamic"}, "loss_scale", "dynamic"),
    ],
)
def test_loose_strings_are_converted(overrides: dict[str, object], name: str, expected: object) -> None:
    value = getattr(resolve("O2", overrides), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("bad", ["abc", "-1", 0, float("inf"), float("nan")])
def test_bad_static_loss_scale(bad: object) -> None:
    with pytest.raises(ValueError, match="loss_scale"):
        resolve("O2", {"loss_scale": bad})


def test_dynamic_config_object_is_kept() -> None:
    config = DynamicLossScale(init_scale=1024.0, hysteresis=2)
    props = resolve("O2", {"loss_scale": config})
    assert props.loss_scale is config and props.dynamic


@pytest.mark.parametrize(
    ("level", "overrides", "model_dtype", "cast_dtype"),
    [
        ("O2", {"cast_model_type": torch.bfloat16}, torch.bfloat16, None),
        ("O3", {"cast_model_type": torch.bfloat16}, torch.bfloat16, None),
        ("O5", {"cast_model_type": torch.float16}, torch.float16, None),
        ("O1", {"patch_torch_functions_type": torch.bfloat16}, None, torch.bfloat16),
        ("O4", {"patch_torch_functions_type": torch.float16}, None, torch.float16),
        ("O1", {"cast_model_type": False}, None, torch.float16),
    ],
)
def test_dtype_override_on_every_level(
    level: str, overrides: dict[str, object], model_dtype: torch.dtype | None, cast_dtype: torch.dtype | None
) -> None:
    props = resolve(level, overrides)
    assert props.model_dtype == model_dtype
    assert props.cast_dtype == cast_dtype


def test_patch_type_outside_function_cast_levels_is_refused() -> None:
    with pytest.raises(RuntimeError, match=re.escape("patch_torch_functions_type should only be set")):
        resolve("O2", {"patch_torch_functions_type": torch.float16})


@pytest.mark.parametrize("bad", [torch.float64, torch.int8])
def test_cast_model_type_must_be_a_float_model_dtype(bad: torch.dtype) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        resolve("O2", {"cast_model_type": bad})


def test_cast_model_type_must_be_a_dtype() -> None:
    with pytest.raises(TypeError, match=re.escape("'float16'")):
        resolve("O2", {"cast_model_type": "float16"})


def test_short_circuit_rule_matches_apex() -> None:
    # Apex short-circuits scale_loss when there are no masters, no dynamic scale and the scale is 1.0.
    assert resolve("O0", {}).short_circuits and resolve("O3", {}).short_circuits and resolve("O4", {}).short_circuits
    assert not resolve("O1", {}).short_circuits and not resolve("O2", {}).short_circuits
    assert not resolve("O5", {}).short_circuits  # masters need their grads moved even at scale 1
    assert not resolve("O3", {"loss_scale": 128.0}).short_circuits


def test_describe_lists_every_option_in_apex_order() -> None:
    lines = describe(resolve("O1", {}))
    names = [line.split(":")[0].strip() for line in lines]
    assert names == [
        "enabled",
        "opt_level",
        "cast_model_type",
        "patch_torch_functions",
        "patch_torch_functions_type",
        "keep_batchnorm_fp32",
        "master_weights",
        "loss_scale",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(growth_factor=1.0), "growth_factor must be > 1.0"),
        (dict(backoff_factor=1.5), "backoff_factor must be < 1.0"),
        (dict(hysteresis=0), "hysteresis must be an int >= 1, got 0"),
        (dict(growth_interval=1.5), "growth_interval must be an int >= 1, got 1.5"),
        (dict(init_scale=-1.0), "init_scale must be a finite number > 0, got -1.0"),
        (dict(min_scale=8.0, max_scale=4.0), "min_scale (8.0) must not exceed max_scale (4.0)"),
        (dict(raise_at_min=True), "raise_at_min=True needs a min_scale"),
        (
            dict(init_scale=2.0, min_scale=4.0),
            "starts at 2.0 (init_scale capped at max_scale), below its min_scale 4.0",
        ),
    ],
)
def test_dynamic_loss_scale_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DynamicLossScale(**kwargs)  # type: ignore[arg-type]
