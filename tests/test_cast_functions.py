"""Apex's user-function API: half/float/promote_function decorators and register_*_function."""

from __future__ import annotations

import re
import threading
import types

import pytest
import torch
from torch import nn

import ampinit as amp

LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]


def dtypes(*tensors: torch.Tensor) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in tensors)


@amp.half_function
def half_fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.dtype, ...]:
    return dtypes(a, b)


@amp.float_function
def float_fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.dtype, ...]:
    return dtypes(a, b)


@amp.promote_function
def promote_fn(a: torch.Tensor, *, b: torch.Tensor) -> tuple[torch.dtype, ...]:
    return dtypes(a, b)


def start(level: str) -> nn.Module:
    model = nn.Linear(2, 2)
    amp.initialize(model, opt_level=level, verbosity=0)
    return model


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_decorators_cast_only_while_a_policy_is_on(level: str, dtype: torch.dtype) -> None:
    f32, half = torch.ones(2), torch.ones(2, dtype=dtype)
    assert half_fn(f32, f32) == (torch.float32, torch.float32)  # no session: called through
    assert float_fn(half, half) == (dtype, dtype)
    start(level)
    try:
        assert half_fn(f32, half) == (dtype, dtype)
        assert float_fn(half, f32) == (torch.float32, torch.float32)
        assert promote_fn(half, b=f32) == (torch.float32, torch.float32)
        assert promote_fn(half, b=half) == (dtype, dtype)
        assert half_fn(f32, torch.ones(2, dtype=torch.float64)) == (dtype, torch.float64)  # autocast's rule
        with amp.disable_casts():
            assert half_fn(f32, f32) == (torch.float32, torch.float32)
        seen: list[tuple[torch.dtype, ...]] = []
        thread = threading.Thread(target=lambda: seen.append(half_fn(f32, f32)))
        thread.start()
        thread.join()
        assert seen == [(torch.float32, torch.float32)]  # other threads: only inside a session model's forward
    finally:
        amp.deinitialize()
    assert half_fn(f32, f32) == (torch.float32, torch.float32)
    assert half_fn.__name__ == "half_fn"


def test_register_of_a_missing_name_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape(f"No function named nope in module {torch}.")):
        amp.register_half_function(torch, "nope")


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_registrations_patch_for_one_session_and_are_undone(level: str, dtype: torch.dtype) -> None:
    module = types.ModuleType("user_ops")

    def combine(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.dtype, ...]:
        return dtypes(a, b)

    module.half_op = module.float_op = module.promote_op = combine  # type: ignore[attr-defined]
    amp.register_half_function(module, "half_op")
    amp.register_float_function(module, "float_op")
    amp.register_promote_function(module, "promote_op")
    f32, half = torch.ones(2), torch.ones(2, dtype=dtype)
    start(level)
    try:
        assert module.half_op(f32, f32) == (dtype, dtype)
        assert module.float_op(half, half) == (torch.float32, torch.float32)
        assert module.promote_op(half, f32) == (torch.float32, torch.float32)
    finally:
        amp.deinitialize()
    assert module.half_op is module.float_op is module.promote_op is combine
    start(level)  # consumed by the first session, as in Apex
    try:
        assert module.half_op is combine
    finally:
        amp.deinitialize()


def test_registering_a_tensor_method_restores_the_inherited_one() -> None:
    assert "sigmoid" not in vars(torch.Tensor)
    amp.register_float_function(torch.Tensor, "sigmoid")
    start("O1")
    try:
        assert torch.ones(2, dtype=torch.float16).sigmoid().dtype == torch.float32
    finally:
        amp.deinitialize()
    assert "sigmoid" not in vars(torch.Tensor)
    assert torch.ones(2, dtype=torch.float16).sigmoid().dtype == torch.float16


def test_registering_during_a_session_warns_and_waits_for_the_next() -> None:
    module = types.ModuleType("late")
    module.op = lambda a: a.dtype  # type: ignore[attr-defined]
    original = module.op
    start("O1")
    try:
        with pytest.warns(UserWarning, match=re.escape("it takes effect at the next ampinit.initialize()")):
            amp.register_float_function(module, "op")
        assert module.op is original
    finally:
        amp.deinitialize()
    start("O1")
    try:
        assert module.op(torch.ones(1, dtype=torch.float16)) == torch.float32
    finally:
        amp.deinitialize()
    assert module.op is original
