"""The leak check in conftest.py sees every kind of module state it claims to cover (tests/_leaks.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from ampinit._casting import kernels, user_functions
from ampinit.compat import apex
from ampinit.compat.apex.amp.lists import torch_overrides
from tests import _leaks


def _pending_registration() -> Callable[[], None]:
    user_functions.register_half_function(torch, "tanh")

    def undo() -> None:
        with user_functions.REGISTRY.lock:
            user_functions.REGISTRY.pending.pop()

    return undo


def _autocast_kernels() -> Callable[[], None]:
    kernels.KERNELS.acquire("cpu")
    return lambda: kernels.KERNELS.release("cpu")


def _edited_apex_list() -> Callable[[], None]:
    torch_overrides.FP32_FUNCS.append("sigmoid")
    return torch_overrides.FP32_FUNCS.pop


def _apex_alias() -> Callable[[], None]:
    apex.install()
    return apex.uninstall


def _meta_path_entry() -> Callable[[], None]:
    finder = object()
    sys.meta_path.append(finder)  # type: ignore[arg-type]
    return lambda: sys.meta_path.remove(finder)  # type: ignore[arg-type]


def _autocast_on() -> Callable[[], None]:
    torch.set_autocast_enabled("cpu", True)
    return lambda: torch.set_autocast_enabled("cpu", False)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (_pending_registration, "pending registrations"),
        (_autocast_kernels, "autocast kernels (device -> holders)"),
        (_edited_apex_list, "Apex's O1 lists (apex.amp.lists)"),
        (_apex_alias, "apex alias installed"),
        (_meta_path_entry, "sys.meta_path"),
        (_autocast_on, "autocast"),
    ],
)
def test_each_kind_of_state_is_seen(change: Callable[[], Callable[[], None]], key: str) -> None:
    before = _leaks.snapshot()
    undo = change()
    try:
        changed = _leaks.differences(before, _leaks.snapshot())
    finally:
        undo()
    assert any(line.startswith(f"{key}:") for line in changed), changed
    assert _leaks.differences(before, _leaks.snapshot()) == []
