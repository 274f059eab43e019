"""A snapshot of every piece of process state that ampinit (or a test) can change, for the leak check in
conftest.py: two snapshots taken around a test must be equal.

Covered: torch's thread-wide state (autocast per device and its cache, default dtype, grad mode), CUDA's
sync-debug mode (on a CUDA run), whether ``ampinit._masters.triton_kernels`` is built for Triton's interpreter,
the user's pending function registrations and every function patched (``register_*_function``, list edits,
Apex's tensor rules), the autocast kernels registered through ``torch.library``, the cast-policy scopes of this
thread, Apex's O1 lists as ``apex.amp.lists`` holds them, the Apex import alias (``sys.modules`` entries and the
finder on ``sys.meta_path``), and ``sys.meta_path`` itself. Live amp sessions are checked separately (conftest
closes them so that one leak does not cascade).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ampinit._casting import fused_gelu, kernels, scopes, user_functions
from ampinit._casting import lists as cast_lists
from ampinit.compat.apex import _alias
from tests import _device, _triton

_APEX_NAMES = ("apex", "amp_C")


def _torch_state() -> dict[str, Any]:
    autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _device.autocast_device_types()}
    return {
        "autocast": autocast,
        "autocast cache": torch.is_autocast_cache_enabled(),
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
    }


def _device_state() -> dict[str, Any]:
    state: dict[str, Any] = {}
    if _device.device_under_test().type == "cuda":
        # A test that leaves "error" on fails every later CUDA test in its process.
        state["CUDA sync-debug mode"] = torch.cuda.get_sync_debug_mode()
    triton_master = sys.modules.get("ampinit._masters.triton_kernels")
    if triton_master is not None:
        # Interpreted kernels would run Triton's interpreter on the GPU tensors of a later CUDA step.
        state["ampinit._masters.triton_kernels built for the interpreter"] = _triton.interpreted(triton_master)
    return state


def _function_registrations() -> dict[str, Any]:
    registry = user_functions.REGISTRY
    with registry.lock:
        pending = [(id(r.module), r.name, r.kind) for r in registry.pending]
        applied = registry.applied
        patched = registry.patches.patched()
    return {
        "pending registrations": pending,
        "sessions holding function patches": applied,
        # registrations, list edits and Apex's tensor rules (``.cpu``, ``exp_``...) alike
        "patched functions (module id, name, wrappers)": patched,
    }


def _cast_policy_state() -> dict[str, Any]:
    return {
        "autocast kernels (device -> holders)": kernels.KERNELS.registered(),
        "cast-policy scopes": [id(p) for p in scopes.thread_scopes()],
        "activated cast policies": [id(p) for p in scopes.activated()],
        # Edits to apex.amp.lists persist for the process, as in Apex: a test that makes one must undo it.
        "Apex's O1 lists (apex.amp.lists)": cast_lists.current_lists(),
        # The fused gelu on CPU tensors is a test's own (the interpreter), and so are its CPU decisions; a GPU's
        # decisions are the process's cache, kept on purpose.
        "fused gelu on the CPU": (
            fused_gelu.ON_CPU,
            {where: decision for where, decision in fused_gelu.status().items() if where.startswith("cpu")},
        ),
    }


def _import_state() -> dict[str, Any]:
    aliases = {
        name: id(module) for name, module in sys.modules.items() if name in _APEX_NAMES or name.startswith("apex.")
    }
    return {
        "apex alias installed": _alias._saved is not None,
        "apex modules": aliases,
        "sys.meta_path": [id(finder) for finder in sys.meta_path],
    }


def snapshot() -> dict[str, Any]:
    """Everything the leak check compares, keyed by a name a failure message can show."""
    return {**_torch_state(), **_device_state(), **_function_registrations(), **_cast_policy_state(), **_import_state()}


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per entry that changed: ``name: before -> after``."""
    return [f"{key}: {before[key]!r} -> {after.get(key)!r}" for key in before if before[key] != after.get(key)]
