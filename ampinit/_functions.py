"""Casting a function's arguments: the helpers the O1/O4 kernels use, and Apex's user-function API.

``half_function``, ``float_function`` and ``promote_function`` decorate a function so that, while a cast policy
is on in the calling thread (autocast enabled for the arguments' device, i.e. inside an O1/O4 session and not
inside ``disable_casts()``), its floating tensor arguments are cast first; otherwise it is called as is.

``register_half_function(module, name)`` and its siblings record a function to patch. As in Apex, the
registrations are consumed by the next O1/O4 ``initialize``: that session patches ``module.name`` with the
decorated function and puts the original back when it closes, so nothing outlives the session. Register again
before each ``initialize`` that should apply them.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

CastKind = Literal["half", "float", "promote"]
F = TypeVar("F", bound=Callable[..., Any])

_thread = threading.local()


# -- casting ---------------------------------------------------------------------------------------------------
def eligible(value: object, device_type: str) -> bool:
    """Autocast's rule: a floating tensor on ``device_type`` that is not float64."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
    )


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
    if not _cacheable(tensor):
        return tensor.to(dtype)
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
    cast = tensor.to(dtype)
    cache[key] = _CacheEntry(weakref.ref(tensor), tensor._version, cast)
    return cast


def cast_all(value: Any, dtype: torch.dtype, device_type: str, *, lower: bool = False) -> Any:
    """``value`` with every eligible tensor (also inside lists and tuples) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        # Cheapest tests first: this runs on every argument of every listed op under the Apex policy.
        if value.dtype == dtype or not eligible(value, device_type):
            return value
        return cast_lower(value, dtype) if lower else value.to(dtype)
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


def _device_of(values: Any) -> str | None:
    for value in values:
        candidates = value if isinstance(value, (list, tuple)) else (value,)
        for item in candidates:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item.device.type
    return None


# -- decorators ---------------------------------------------------------------------------------------------------
def _cast_wrapper(fn: F, kind: CastKind) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        device_type = _device_of(values)
        if device_type is None or not torch.is_autocast_enabled(device_type):
            return fn(*args, **kwargs)
        if kind == "promote":
            dtypes = floating_dtypes(values, device_type)
            if len(dtypes) < 2:
                return fn(*args, **kwargs)
            dtype, lower = widest(dtypes), False
        elif kind == "half":
            dtype, lower = torch.get_autocast_dtype(device_type), True
        else:
            dtype, lower = torch.float32, False
        args = cast_all(args, dtype, device_type, lower=lower)
        kwargs = {k: cast_all(v, dtype, device_type, lower=lower) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    wrapper.__ampinit_cast__ = kind  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def half_function(fn: F) -> F:
    """Run ``fn`` on the autocast dtype (fp16 under O1, bf16 under O4) while a cast policy is on."""
    return _cast_wrapper(fn, "half")


def float_function(fn: F) -> F:
    """Run ``fn`` on float32 inputs while a cast policy is on."""
    return _cast_wrapper(fn, "float")


def promote_function(fn: F) -> F:
    """Run ``fn`` with its floating inputs in their widest dtype while a cast policy is on."""
    return _cast_wrapper(fn, "promote")


_DECORATORS: dict[CastKind, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "half": half_function,
    "float": float_function,
    "promote": promote_function,
}


# -- registrations ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Registration:
    module: Any
    name: str
    kind: CastKind


class _Registry:
    """Pending registrations, and how many sessions currently hold patches (to warn about late ones)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[_Registration] = []
        self.applied = 0

    def add(self, module: Any, name: str, kind: CastKind) -> None:
        if not hasattr(module, name):
            raise ValueError(f"No function named {name} in module {module}.")
        with self.lock:
            self.pending.append(_Registration(module, name, kind))
            late = self.applied > 0
        if late:
            warnings.warn(
                f"register_{kind}_function({module!r}, {name!r}) was called while an O1/O4 session is open: "
                "it takes effect at the next ampinit.initialize(), as in Apex.",
                stacklevel=3,
            )

    def apply(self) -> Callable[[], None]:
        """Patch every pending registration (consuming them); return the function that undoes the patches."""
        with self.lock:
            registrations, self.pending = self.pending, []
            self.applied += 1
        undo: list[Callable[[], None]] = []
        try:
            for registration in registrations:
                undo.append(_patch(registration))
        except BaseException:
            _run_reversed(undo)
            self._release()
            raise
        released = False

        def restore() -> None:
            nonlocal released
            if released:
                return
            released = True
            try:
                _run_reversed(undo)
            finally:
                self._release()

        return restore

    def _release(self) -> None:
        with self.lock:
            self.applied -= 1


def _patch(registration: _Registration) -> Callable[[], None]:
    module, name = registration.module, registration.name
    namespace = vars(module)
    had_own = name in namespace
    previous = namespace.get(name)
    replacement = _DECORATORS[registration.kind](getattr(module, name))
    setattr(module, name, replacement)

    def restore() -> None:
        if had_own:
            setattr(module, name, previous)
        elif vars(module).get(name) is replacement:
            delattr(module, name)

    return restore


def _run_reversed(undo: list[Callable[[], None]]) -> None:
    while undo:
        undo.pop()()


REGISTRY = _Registry()


def register_half_function(module: Any, name: str) -> None:
    """Have the next O1/O4 session run ``module.name`` on the autocast dtype (Apex's ``register_half_function``)."""
    REGISTRY.add(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Have the next O1/O4 session run ``module.name`` in float32 (``register_float_function(torch, "sigmoid")``)."""
    REGISTRY.add(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Have the next O1/O4 session run ``module.name`` with its inputs promoted to their widest dtype."""
    REGISTRY.add(module, name, "promote")
