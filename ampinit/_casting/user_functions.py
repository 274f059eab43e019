"""Apex's user-function API: the cast decorators and the registrations the next O1/O4 session applies.

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
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from ampinit._casting.arguments import cast_all, device_of, floating_dtypes, widest
from ampinit._casting.lists import Policy

CastKind = Literal["half", "float", "promote"]
# The decorator that casts like each list policy (``lists.KIND_POLICY``).
_POLICY_KIND: dict[Policy, CastKind] = {"lower": "half", "fp32": "float", "promote": "promote"}
F = TypeVar("F", bound=Callable[..., Any])


# -- decorators ---------------------------------------------------------------------------------------------------
# Functions implemented in C (torch's own ops, ``Tensor`` methods, a pybind11 extension's kernels): Apex's patches
# could not reach inside them, so the decorated call ran them on the arguments exactly as cast. Autocast does
# reach the ATen calls they make, so they run with the device's autocast off; a Python function keeps the policy
# inside, as Apex's patched torch functions applied inside it.
_COMPILED = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)


def _call_below_autocast(fn: Callable[..., Any], device_type: str, args: Any, kwargs: Any) -> Any:
    torch.set_autocast_enabled(device_type, False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_autocast_enabled(device_type, True)


def _torch_own(fn: Callable[..., Any]) -> bool:
    """Whether C function ``fn`` is one of torch's own ops (``torch.mm``, ``F.linear``'s ``torch._C._nn.linear``,
    ``Tensor.mm``): autocast casts its arguments by the policy's lists, as Apex's list patches did around the user's
    registrations. An extension's kernel (any other module) is not on a list."""
    module = getattr(fn, "__module__", None)
    if isinstance(module, str) and (module == "torch" or module.startswith("torch.")):
        return True
    owner = getattr(fn, "__objclass__", None)
    return isinstance(owner, type) and issubclass(owner, torch._C.TensorBase)


def _cast_wrapper(fn: F, kind: CastKind) -> F:
    compiled = isinstance(fn, _COMPILED)
    # A promote registration of one of torch's own ops keeps autocast on: Apex applied the lists' casts outside the
    # user's registrations, so a listed op was cast by its list first (``torch.mm`` to half, ``torch.exp`` to
    # fp32) and promote then saw one dtype; an op on no list is left alone by autocast either way. (A half or float
    # registration's own cast came last there, so those run below autocast.)
    promote_under_lists = kind == "promote" and compiled and _torch_own(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        device_type = device_of(values)
        if device_type is None or not torch.is_autocast_enabled(device_type):
            return fn(*args, **kwargs)
        if kind == "promote":
            dtypes = floating_dtypes(values, device_type)
            if len(dtypes) < 2:
                below = compiled and not promote_under_lists
                return _call_below_autocast(fn, device_type, args, kwargs) if below else fn(*args, **kwargs)
            dtype, lower = widest(dtypes), False
        elif kind == "half":
            dtype, lower = torch.get_autocast_dtype(device_type), True
        else:
            dtype, lower = torch.float32, False
        args = cast_all(args, dtype, device_type, lower=lower)
        kwargs = {k: cast_all(v, dtype, device_type, lower=lower) for k, v in kwargs.items()}
        if compiled and not promote_under_lists:
            return _call_below_autocast(fn, device_type, args, kwargs)
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


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
_DECORATORS: dict[CastKind, Decorator] = {
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


@dataclass
class _Chain:
    """The session patches of one ``module.name``: the original, and each open session's wrapper in applying order."""

    module: Any
    name: str
    had_own: bool  # the name was in ``vars(module)`` (else it came from a class, and is deleted again)
    previous: Any  # ``vars(module)[name]`` before the first patch
    original: Callable[..., Any]  # ``getattr(module, name)`` before the first patch: what the casts wrap
    decorators: list[tuple[object, Decorator]]
    installed: Any = None


class _Patches:
    """Every session's patches of ``module.name``, shared, so that sessions may close in any order.

    The attribute holds the original wrapped by the open sessions' wrappers (casts, and Apex's tensor rules,
    ``apex_tensor``) in the order they were applied; closing a session rebuilds the chain from the others' (one
    session's undo putting back what it found would drop a later session's patch while it is open, and reinstall
    its own after the later one closed).
    """

    def __init__(self) -> None:
        self._chains: dict[tuple[int, str], _Chain] = {}

    def patched(self) -> list[tuple[int, str, int]]:
        """``(id(module), name, number of wrappers)`` for every function patched now (for the tests' leak check)."""
        return sorted((id(chain.module), chain.name, len(chain.decorators)) for chain in self._chains.values())

    def push(self, module: Any, name: str, decorator: Decorator) -> tuple[tuple[int, str], object]:
        key = (id(module), name)
        chain = self._chains.get(key)
        if chain is None:
            namespace = vars(module)
            chain = _Chain(module, name, name in namespace, namespace.get(name), getattr(module, name), [])
            self._chains[key] = chain
        token = object()
        chain.decorators.append((token, decorator))
        self._install(chain)
        return key, token

    def pop(self, key: tuple[int, str], token: object) -> None:
        chain = self._chains[key]
        chain.decorators = [(t, d) for t, d in chain.decorators if t is not token]
        ours = vars(chain.module).get(chain.name) is chain.installed
        if chain.decorators:
            if ours:  # someone who rebound it after us keeps their binding
                self._install(chain)
            return
        del self._chains[key]
        if chain.had_own:
            setattr(chain.module, chain.name, chain.previous)
        elif ours:
            delattr(chain.module, chain.name)

    @staticmethod
    def _install(chain: _Chain) -> None:
        value = chain.original
        for _, decorator in chain.decorators:
            value = decorator(value)
        setattr(chain.module, chain.name, value)
        chain.installed = value


class _Registry:
    """Pending registrations, and how many sessions currently hold patches (to warn about late ones)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[_Registration] = []
        self.applied = 0
        self.patches = _Patches()

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

    def apply(self, list_patches: Sequence[tuple[object, str, Policy]] = ()) -> Callable[[], None]:
        """Patch every pending registration (consuming them), then ``list_patches`` (names added to Apex's lists
        that no kernel carries, ``lists.python_patches``), in Apex's order; return the function that undoes them.
        """
        with self.lock:
            registrations, self.pending = self.pending, []
            self.applied += 1
        registrations += [_Registration(module, name, _POLICY_KIND[policy]) for module, name, policy in list_patches]
        try:
            undo = self.wrap([(r.module, r.name, _DECORATORS[r.kind]) for r in registrations])
        except BaseException:
            self._release()
            raise
        released = False

        def restore() -> None:
            nonlocal released
            if released:
                return
            released = True
            try:
                undo()
            finally:
                self._release()

        return restore

    def wrap(self, patches: Sequence[tuple[object, str, Decorator]]) -> Callable[[], None]:
        """Wrap each ``module.name`` with its decorator, in the shared chains; return the function that undoes them.

        For a session's own wrappers (Apex's tensor rules), which, unlike registrations, nothing has to consume.
        """
        applied: list[tuple[tuple[int, str], object]] = []

        def undo() -> None:
            with self.lock:
                while applied:
                    self.patches.pop(*applied.pop())

        try:
            with self.lock:
                for module, name, decorator in patches:
                    applied.append(self.patches.push(module, name, decorator))
        except BaseException:
            undo()
            raise
        return undo

    def _release(self) -> None:
        with self.lock:
            self.applied -= 1


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
