"""Casting arguments: autocast's eligibility rule, the weight-cast cache, and the dtype helpers.

Shared by the extra autocast kernels (``kernels``) and the user-function decorators (``user_functions``).
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_thread = threading.local()


# ``tensor.is_cpu`` costs a fifth of ``tensor.device.type == "cpu"``, and these tests run on every argument of
# every listed op.
_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": operator.attrgetter("is_cpu"),
    "cuda": operator.attrgetter("is_cuda"),
    "xpu": operator.attrgetter("is_xpu"),
    "mps": operator.attrgetter("is_mps"),
}
# ``tensor.float()`` costs about half of ``tensor.to(torch.float32)`` (no overload resolution); same autograd node.
_CASTS: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.float32: torch.Tensor.float,
    torch.float16: torch.Tensor.half,
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float64: torch.Tensor.double,
}


def on_device(tensor: torch.Tensor, device_type: str) -> bool:
    test = _ON_DEVICE.get(device_type)
    return test(tensor) if test is not None else tensor.device.type == device_type


def eligible(value: object, device_type: str) -> bool:
    """Autocast's rule: a floating tensor on ``device_type`` that is not float64."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and on_device(value, device_type)
    )


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, by the cheapest call that does it."""
    method = _CASTS.get(dtype)
    return method(tensor) if method is not None else tensor.to(dtype)


@dataclass
class _CacheEntry:
    source: weakref.ref[torch.Tensor]
    version: int
    cast: torch.Tensor


def _cache() -> dict[tuple[int, torch.dtype], _CacheEntry]:
    cache: dict[tuple[int, torch.dtype], _CacheEntry] | None = getattr(_thread, "cache", None)
    if cache is None:
        cache = _thread.cache = {}
    return cache


def clear_cache() -> None:
    """Forget this thread's cached weight casts."""
    _cache().clear()


def _cacheable(tensor: torch.Tensor) -> bool:
    # Autocast's rule for its own cache (fp32 leaves that require grad, not views), restricted to plain tensors
    # so that torch.compile's fake and functional tensors never land in it.
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.dtype == torch.float32
        and tensor.requires_grad
        and tensor.is_leaf
        and tensor._base is None
    )


def cast_lower(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, cast once per weight and reused until the weight changes.

    An entry is reused only while the weight is the same object at the same version (an optimizer step or a
    ``load_state_dict`` bumps it, so a cast is never stale), and not when a cast made under ``no_grad`` would
    cut the graph (Apex's cache broke across train -> eval -> train on exactly this).
    """
    if tensor.dtype == dtype:
        return tensor
    if not _cacheable(tensor) or not torch.is_autocast_cache_enabled():  # off outside model forwards (``policy``)
        return cast(tensor, dtype)
    cache = _cache()
    key = (id(tensor), dtype)
    entry = cache.get(key)
    if (
        entry is not None
        and entry.source() is tensor
        and entry.version == tensor._version
        and (entry.cast.requires_grad or not torch.is_grad_enabled())
    ):
        return entry.cast
    result = cast(tensor, dtype)
    cache[key] = _CacheEntry(weakref.ref(tensor), tensor._version, result)
    return result


def cast_all(value: Any, dtype: torch.dtype, device_type: str, *, lower: bool = False) -> Any:
    """``value`` with every eligible tensor (also inside lists and tuples) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        # Cheapest tests first: this runs on every argument of every listed op under the Apex policy.
        if value.dtype == dtype or not eligible(value, device_type):
            return value
        return cast_lower(value, dtype) if lower else cast(value, dtype)
    if type(value) in (list, tuple) and value:
        items = [cast_all(item, dtype, device_type, lower=lower) for item in value]
        return items if type(value) is list else tuple(items)
    return value


def floating_dtypes(values: Any, device_type: str) -> set[torch.dtype]:
    """The dtypes of the eligible tensors in ``values`` (one level of lists and tuples)."""
    found: set[torch.dtype] = set()
    for value in values:
        if isinstance(value, (list, tuple)):
            found.update(v.dtype for v in value if eligible(v, device_type))
        elif eligible(value, device_type):
            found.add(value.dtype)
    return found


def widest(dtypes: set[torch.dtype]) -> torch.dtype:
    return functools.reduce(torch.promote_types, sorted(dtypes, key=str))


def device_of(values: Any) -> str | None:
    """The device type of the first floating tensor in ``values`` (one level of lists and tuples), or None."""
    for value in values:
        candidates = value if isinstance(value, (list, tuple)) else (value,)
        for item in candidates:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item.device.type
    return None
