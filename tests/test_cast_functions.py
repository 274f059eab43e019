"""Apex's user-function API: half/float/promote_function decorators and register_*_function."""

from __future__ import annotations

import re
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampinit as amp

LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


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


@pytest.mark.parametrize("how", ["apex list edit", "register_float_function"])
def test_function_patches_survive_sessions_closing_out_of_order(how: str) -> None:
    """Two O1 sessions open at once (supported: "Sessions may close in any order", CastPolicy), both patching
    ``torch.sigmoid`` to fp32, through an edit of Apex's lists (read by every ``initialize``) or a
    ``register_float_function`` before each ``initialize``. Apex's rule for such a name: while casts are on, its
    floating inputs are cast to fp32 (docs/cast-policy.md, "Editing Apex's lists" / "User functions").

    Got: closing the first session put back the ``torch.sigmoid`` it had found, dropping the open second session's
    patch (``torch.sigmoid`` of a half tensor gave float16 under the open session); closing the second then
    reinstalled the first session's wrapper, which outlived every session (``torch.sigmoid`` not the original).

    Found by: the review of the O1/O4 cast policy.
    """
    from ampinit.compat.apex.amp.lists import torch_overrides

    original = torch.sigmoid
    sessions = []
    if how == "apex list edit":
        torch_overrides.FP32_FUNCS.append("sigmoid")
    try:
        for index in range(2):
            if how == "register_float_function":
                if index == 0:
                    amp.register_float_function(torch, "sigmoid")
                else:  # registered while the first session is open: for the next initialize (a warning says so)
                    with pytest.warns(UserWarning, match="takes effect at the next"):
                        amp.register_float_function(torch, "sigmoid")
            model = nn.Linear(4, 4)
            amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
            sessions.append(amp.current_session())
        half = g(3).half()
        assert torch.sigmoid(half).dtype == torch.float32
        sessions[0].close()
        assert torch.sigmoid(half).dtype == torch.float32  # the second session is still open
        sessions[1].close()
        assert torch.sigmoid is original
    finally:
        for session in reversed(sessions):
            session.close()
        if how == "apex list edit":
            torch_overrides.FP32_FUNCS.remove("sigmoid")
        torch.sigmoid = original  # so that the leak check reports this test only


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_registering_a_listed_torch_function_gives_it_the_registered_cast(level: str, dtype: torch.dtype) -> None:
    """Apex applied the user's ``register_*_function`` patches first, innermost, around the original function
    (shared/reference/apex-amp.md §3.2 step 0, before the lists in step 1): the original C function then ran on
    the arguments as the registration cast them, whatever list the name was also on. So after
    ``register_float_function(torch, "matmul")`` (forcing fp32 attention scores, say) ``torch.matmul`` is fp32,
    and after ``register_half_function(torch, "exp")`` ``torch.exp`` is half.

    Got: the registration cast the arguments, then torch's autocast cast them back by the list (``torch.mm``,
    ``torch.matmul``, ``F.linear`` half; ``torch.exp`` fp32): registering a listed function had no effect. The
    same reaches a pybind11 extension decorated with ``half_function`` (Apex's documented use): autocast cast
    the ATen calls it makes inside, which Apex never did.

    Found by: the review of the O1/O4 cast policy.
    """
    amp.register_float_function(torch, "mm")
    amp.register_float_function(torch, "matmul")
    amp.register_float_function(F, "linear")
    amp.register_half_function(torch, "exp")
    amp.register_float_function(torch.Tensor, "bmm")
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    a, b = g(4, 4), g(4, 4, seed=1)
    try:
        torch.testing.assert_close(torch.mm(a, b), torch.mm(a.double(), b.double()).float())
        assert torch.matmul(a.to(dtype), b).dtype == torch.float32
        assert F.linear(a, b).dtype == torch.float32
        assert a[None].bmm(b[None]).dtype == torch.float32
        assert torch.equal(torch.exp(a), torch.exp(a.to(dtype)))
        # a Python function keeps the policy inside (Apex's patched functions applied inside it)
        helper = amp.float_function(lambda x, y: torch.bmm(x[None], y[None]))
        assert helper(a.to(dtype), b).dtype == dtype
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_promote_registration_of_a_listed_builtin_keeps_the_list_cast(level: str, dtype: torch.dtype) -> None:
    """Apex wrapped the user's registrations inside its list patches: after ``register_promote_function(torch,
    "mm")`` the list cast ``torch.mm``'s arguments to half first and promote then saw one dtype, so the op stayed
    half; a promote-registered fp32-list op (``torch.exp``) stayed fp32. A promote registration is no half or float
    cast of its own that would come last.

    Got: the registered C function ran with autocast off, so ``torch.mm(fp32, fp32)`` gave float32 (and
    ``Tensor.mm``, not registered, half) and ``torch.exp(half)`` half.

    Found by: the twentieth session's audit of the cast engine's user registrations.
    """
    amp.register_promote_function(torch, "mm")
    amp.register_promote_function(torch, "exp")
    amp.register_promote_function(torch.Tensor, "bmm")
    model = nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    x = g(3, 3)
    try:
        assert torch.mm(x, x).dtype == dtype == x.mm(x).dtype
        assert torch.mm(x.to(dtype), x).dtype == dtype  # promoted to fp32, then cast by the list
        assert x[None].bmm(x[None].to(dtype)).dtype == dtype
        assert torch.exp(x.to(dtype)).dtype == torch.float32
    finally:
        amp.deinitialize()
