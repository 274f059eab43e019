"""Apex's tensor rules that legacy code depends on, for O1 sessions made through the Apex API (``apex.amp``).

Apex's O1 patched ``torch`` and ``torch.Tensor`` in Python (``apex/amp/amp.py``, ``init``), and three of those
patches do what autocast never does, since autocast keeps a tensor's dtype through device copies and in-place ops:

* step 1: ``cpu`` is on ``tensor_overrides.FP32_FUNCS`` ("Cast to fp32 before transfer to CPU"), so ``.cpu()`` of
  a half tensor on the cast device returned float32 (``utils.maybe_float``), except inside ``disable_casts()``;
* step 3: for each name on ``torch_overrides.FP32_FUNCS`` with an in-place function ``torch.<name>_``, a call with
  any fp16 tensor argument raised ``NotImplementedError("Cannot call in-place function <name>_ with fp16
  arguments.")`` (``wrap.err_if_any_half``);
* step 3.5: for each name on ``tensor_overrides.FP32_FUNCS`` with an in-place method ``Tensor.<name>_``, calling it
  on an fp16 tensor raised ``NotImplementedError("Cannot call in-place method <name>_ on fp16 Tensors.")``
  (``wrap.err_if_arg0_half``).

The two refusals looked at the dtype only (``x.type()`` ending in ``HalfTensor``, on any device) and ignored
``disable_casts()``. The names come from the lists as code edited them before ``initialize``, as Apex read them.

:func:`follow` wraps those functions for one :class:`~ampinit._casting.policy.CastPolicy`, in the shared patch
chains of ``user_functions`` (so sessions may close in any order), and each wrapper acts only where that policy is
the one in force in the calling thread (``scopes.innermost``). The native ``ampinit`` API never calls it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampinit._casting import scopes
from ampinit._casting.lists import ApexLists
from ampinit._casting.user_functions import REGISTRY, Decorator
from ampinit._types import HALF_DTYPES

if TYPE_CHECKING:
    from ampinit._casting.policy import CastPolicy


def _inplace(names: tuple[str, ...], namespace: object) -> list[str]:
    # Apex's ``utils.as_inplace`` and ``has_func``: the name plus "_", where the namespace has it.
    return [name + "_" for name in names if hasattr(namespace, name + "_")]


def _has_fp16(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float16
    if isinstance(value, (list, tuple)):
        return any(_has_fp16(item) for item in value)
    return False


def _cpu_to_float(policy: CastPolicy) -> Decorator:
    def decorate(cpu: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(cpu)
        def apex_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.dtype in HALF_DTYPES and scopes.innermost() is policy:
                device_type = self.device.type
                if device_type in policy.device_types and torch.is_autocast_enabled(device_type):
                    self = self.float()
            return cpu(self, *args, **kwargs)

        return apex_cpu

    return decorate


def _refuse_fp16_self(policy: CastPolicy, name: str) -> Decorator:
    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def apex_inplace_method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.dtype == torch.float16 and scopes.innermost() is policy:
                raise NotImplementedError(f"Cannot call in-place method {name} on fp16 Tensors.")
            return method(self, *args, **kwargs)

        return apex_inplace_method

    return decorate


def _refuse_fp16_arguments(policy: CastPolicy, name: str) -> Decorator:
    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def apex_inplace_function(*args: Any, **kwargs: Any) -> Any:
            if scopes.innermost() is policy and (_has_fp16(args) or _has_fp16(tuple(kwargs.values()))):
                raise NotImplementedError(f"Cannot call in-place function {name} with fp16 arguments.")
            return function(*args, **kwargs)

        return apex_inplace_function

    return decorate


def patches(policy: CastPolicy, lists: ApexLists) -> list[tuple[object, str, Decorator]]:
    """``(namespace, name, wrapper)`` for each function Apex's rules change under ``lists``, for ``policy``."""
    tensor_fp32 = lists.get("tensor_overrides", "FP32_FUNCS")
    torch_fp32 = lists.get("torch_overrides", "FP32_FUNCS")
    found: list[tuple[object, str, Decorator]] = []
    if "cpu" in tensor_fp32:
        found.append((torch.Tensor, "cpu", _cpu_to_float(policy)))
    found += [(torch, name, _refuse_fp16_arguments(policy, name)) for name in _inplace(torch_fp32, torch)]
    found += [(torch.Tensor, name, _refuse_fp16_self(policy, name)) for name in _inplace(tensor_fp32, torch.Tensor)]
    return found


def follow(policy: CastPolicy, lists: ApexLists) -> Callable[[], None]:
    """Apply Apex's tensor rules under ``lists`` wherever ``policy`` is in force; return the function that stops."""
    return REGISTRY.wrap(patches(policy, lists))
