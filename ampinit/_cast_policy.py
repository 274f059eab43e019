"""The O1/O4 cast engine: PyTorch's autocast dispatch, switched on for the life of a session.

Apex's O1 patched ~1,000 torch functions in Python. ampinit uses PyTorch's own autocast dispatch instead
(``docs/design.md``, decision 2), at native speed and compatible with ``torch.compile``. With
``policy="apex"`` the ops of Apex's lists that a device's native lists lack (on the CPU: softmax, layer_norm,
sum, exp, pow, norms, ...) get extra kernels on that device's autocast dispatch key (``_cast_lists.plan``), so
that every device runs Apex's cast semantics. ``policy="native"`` keeps PyTorch's lists only.

A :class:`CastPolicy` does four things:

* ``activate()``: from ``initialize`` until ``close``, torch calls in the initializing thread follow the policy,
  inside and outside the model, as Apex's global patching did; it also applies the user's pending
  ``register_*_function`` registrations for the session's lifetime;
* ``install_forward_hooks(model)``: the model's forward follows it in any thread (e.g. DataLoader workers or
  a serving thread);
* ``suspended()``: a region with no casting (the optimizer step, the backward inside ``scale_loss``, and the
  user's ``disable_casts()``);
* ``clear_cache()``: forget cached weight casts (the session calls it at every ``scale_loss`` exit and step;
  the policy itself also clears at the entry of each outermost model forward).

The extra kernels are process-wide, like any dispatcher registration: they are registered when the first
``apex`` policy activates, reference-counted per device type, and removed when the last one deactivates. They
cast only in threads where an ``apex`` policy is the innermost one on (the initializing thread, or a session
model's forward), and in threads with no policy of their own while they run a backward (autograd's device
threads: checkpoint recompute); elsewhere they behave as the device's native autocast does.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils.hooks import RemovableHandle

from ampinit import _functions
from ampinit._cast_lists import BANNED_BCE_MESSAGE, NATIVE_BCE_MESSAGE, Policy, plan

CastPolicyName = Literal["apex", "native"]
CAST_POLICIES: tuple[CastPolicyName, ...] = ("apex", "native")

# Device types whose autocast dispatch key this torch build defines (the keys the extra kernels go to).
AUTOCAST_KEYS: dict[str, str] = {
    device: key
    for device, key in {
        "cpu": "AutocastCPU",
        "cuda": "AutocastCUDA",
        "xpu": "AutocastXPU",
        "mps": "AutocastMPS",
        "hpu": "AutocastHPU",
        "ipu": "AutocastIPU",
        "privateuseone": "AutocastPrivateUse1",
    }.items()
    if hasattr(DispatchKey, key)
}
_LOWER_PRECISION = (torch.float16, torch.bfloat16)

# The policies on in this thread, innermost last (the initializing thread's, then any model forward's).
_scopes = threading.local()


def _scope_stack() -> list[CastPolicy]:
    stack: list[CastPolicy] | None = getattr(_scopes, "stack", None)
    if stack is None:
        stack = _scopes.stack = []
    return stack


def _activated_stack() -> list[CastPolicy]:
    """The policies activated in this thread and not yet deactivated, in activation order."""
    stack: list[CastPolicy] | None = getattr(_scopes, "activated", None)
    if stack is None:
        stack = _scopes.activated = []
    return stack


# Every policy active in the process, in activation order (a thread of autograd's engine has none of its own).
_open: list[CastPolicy] = []
_open_lock = threading.Lock()


def _innermost() -> CastPolicy | None:
    """The policy the extra kernels follow in this thread.

    The thread's innermost one; in a thread with none, while autograd runs a backward there (the engine's
    device threads, which run CUDA backward and so recompute checkpointed forwards, or a backward started in
    another thread), the process's latest active policy: torch.utils.checkpoint restores the forward's
    autocast state for the recompute, and the recompute must cast the same ops as the forward did.
    """
    stack: list[CastPolicy] | None = getattr(_scopes, "stack", None)
    if stack:
        return stack[-1]
    if _open and torch._C._current_graph_task_id() != -1:
        with _open_lock:
            return _open[-1] if _open else None
    return None


class CastPolicy:
    """Autocast to ``dtype`` on ``device_types`` while active, with Apex's lists on top for ``policy="apex"``."""

    def __init__(
        self,
        device_types: list[str],
        dtype: torch.dtype,
        *,
        policy: CastPolicyName = "apex",
        allow_banned: bool = False,
    ) -> None:
        if policy not in CAST_POLICIES:
            raise ValueError(f"cast_policy must be one of {list(CAST_POLICIES)}, got {policy!r}")
        if dtype not in _LOWER_PRECISION:
            raise ValueError(f"The O1/O4 cast dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.device_types = sorted(set(device_types))
        if policy == "apex":
            unknown = [d for d in self.device_types if d not in AUTOCAST_KEYS]
            if unknown:
                raise ValueError(
                    f"cast_policy='apex' needs an autocast dispatch key for device type {unknown[0]!r}; known: "
                    f"{sorted(AUTOCAST_KEYS)}. Use cast_policy='native' for PyTorch's own lists on this device."
                )
        self.dtype = dtype
        self.policy = policy
        self.allow_banned = allow_banned
        self._saved: list[tuple[str, bool, torch.dtype]] = []
        self._thread: int | None = None
        self._local = threading.local()
        self._acquired: list[str] = []
        self._restore_user_functions: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def activate(self) -> None:
        """Switch the policy on in the calling thread until :meth:`deactivate`."""
        if self.active:
            raise RuntimeError("CastPolicy.activate() called twice without deactivate()")
        try:
            if self.policy == "apex":
                for device in self.device_types:
                    KERNELS.acquire(device)
                    self._acquired.append(device)
            self._restore_user_functions = _functions.REGISTRY.apply()
        except BaseException:
            self._release_kernels()
            raise
        for device in self.device_types:
            self._saved.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, self.dtype)
        # Counts as an open autocast region, so that a user's nested ``with torch.autocast`` does not clear
        # the weight-cast cache on its exit.
        torch.autocast_increment_nesting()
        _activated_stack().append(self)
        _scope_stack().append(self)
        with _open_lock:
            _open.append(self)
        self._thread = threading.get_ident()

    def deactivate(self) -> None:
        """Restore the autocast state found at :meth:`activate` (must run in the same thread)."""
        if not self.active:
            return
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "The cast policy was activated in another thread: close() the session from the thread that "
                "called initialize(), because autocast state is per thread."
            )
        try:
            stack = _scope_stack()
            for index in range(len(stack) - 1, -1, -1):
                if stack[index] is self:
                    del stack[index]
                    break
            with _open_lock:
                _open.remove(self)
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            _functions.clear_cache()
            self._restore_autocast_state()
            self._thread = None
        finally:
            try:
                if self._restore_user_functions is not None:
                    self._restore_user_functions()
                    self._restore_user_functions = None
            finally:
                self._release_kernels()

    def _restore_autocast_state(self) -> None:
        """Put back the state found at activation, or hand it to a policy activated later in this thread.

        Sessions may close in any order: when a later policy still holds a device, that policy saved this one's
        state at its activation, so it inherits what this one found instead, and the current state stays.
        """
        activated = _activated_stack()
        index = next(i for i, policy in enumerate(activated) if policy is self)
        later = activated[index + 1 :]
        del activated[index]
        for device, enabled, dtype in reversed(self._saved):
            heir = next((p for p in later if any(d == device for d, _, _ in p._saved)), None)
            if heir is None:
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)
            else:
                heir._saved = [(d, enabled, dtype) if d == device else (d, e, t) for d, e, t in heir._saved]
        self._saved.clear()

    def _release_kernels(self) -> None:
        while self._acquired:
            KERNELS.release(self._acquired.pop())

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No casting inside; the previous state comes back on exit, also when the body raises."""
        # Flipping the thread's autocast flags directly: a ``torch.autocast`` object per device costs tens of
        # microseconds, and this runs at least twice per training step (backward and optimizer step).
        self._local.suspended = getattr(self._local, "suspended", 0) + 1
        saved = [(device, torch.is_autocast_enabled(device)) for device in self.device_types]
        try:
            for device, _ in saved:
                torch.set_autocast_enabled(device, False)
            yield
        finally:
            for device, enabled in saved:
                torch.set_autocast_enabled(device, enabled)
            self._local.suspended -= 1

    def clear_cache(self) -> None:
        """Forget cached weight casts (weights change at every optimizer step)."""
        torch.clear_autocast_cache()
        _functions.clear_cache()

    def install_forward_hooks(self, model: torch.nn.Module) -> list[RemovableHandle]:
        """Run ``model``'s forward under the policy in whichever thread calls it."""

        def enter(module: torch.nn.Module, args: Any) -> None:
            stack = self._thread_stack()
            if not stack:
                # Weights may have changed since the last forward outside the optimizer (``load_state_dict``
                # between eval forwards, a manual update): casts live for one outermost forward at most.
                self.clear_cache()
            if getattr(self._local, "suspended", 0):  # a forward inside disable_casts() stays uncast
                stack.append(None)
                return
            saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in self.device_types]
            for device, _, _ in saved:
                torch.set_autocast_enabled(device, True)
                torch.set_autocast_dtype(device, self.dtype)
            # An open autocast region, as ``torch.autocast`` would count it: the weight-cast cache lives until
            # the outermost one closes.
            torch.autocast_increment_nesting()
            _scope_stack().append(self)
            stack.append(saved)

        def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self._thread_stack()
            if not stack:
                return
            saved = stack.pop()
            if saved is None:
                return
            _scope_stack().pop()
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            for device, enabled, dtype in saved:
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)

        # torch.compile runs the hooks eagerly (a region opened in one hook and closed in another cannot be
        # traced) and compiles the forward under the autocast state they set, on which it guards.
        return [
            model.register_forward_pre_hook(torch.compiler.disable(enter)),  # type: ignore[no-untyped-call]
            model.register_forward_hook(torch.compiler.disable(leave), always_call=True),  # type: ignore[no-untyped-call]
        ]

    def _thread_stack(self) -> list[list[tuple[str, bool, torch.dtype]] | None]:
        """Per thread, per open model forward: the autocast state to restore (None: the forward was uncast)."""
        stack: list[list[tuple[str, bool, torch.dtype]] | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack


# -- the extra kernels ---------------------------------------------------------------------------------------------
def _applies() -> bool:
    policy = _innermost()
    return policy is not None and policy.policy == "apex"


def _explicit_dtype(op: torch._ops.OpOverload) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """Whether a call passes the op's optional ``dtype`` argument (such calls are left alone, as autocast does)."""
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == "dtype":
            if argument.kwarg_only:
                return lambda args, kwargs: kwargs.get("dtype") is not None
            return lambda args, kwargs: (
                kwargs.get("dtype") is not None or (len(args) > position and args[position] is not None)
            )
    return lambda args, kwargs: False


def _tensor_arguments(op: torch._ops.OpOverload) -> tuple[list[int], list[str]]:
    """Positions and names of the op's Tensor-typed arguments (``Tensor``, ``Tensor?``, ``Tensor[]``...).

    Read once from the schema, so that a call casts only those instead of inspecting every argument.
    """
    positions, names = [], []
    for position, argument in enumerate(op._schema.arguments):
        if "Tensor" in str(argument.type):
            positions.append(position)
            names.append(argument.name)
    return positions, names


def make_kernel(op: torch._ops.OpOverload, policy: Policy, device_type: str) -> Callable[..., Any]:
    """The autocast kernel of ``op`` on ``device_type``: cast by ``policy``, then run ``op`` below autocast."""
    excluded = DispatchKeySet(getattr(DispatchKey, AUTOCAST_KEYS[device_type]))
    explicit_dtype = _explicit_dtype(op)
    tensor_positions, tensor_names = _tensor_arguments(op)

    def run(args: Any, kwargs: dict[str, Any]) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    def cast_and_run(dtype: torch.dtype, lower: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cast_args = list(args)
        for position in tensor_positions:
            if position < len(cast_args) and cast_args[position] is not None:
                cast_args[position] = _functions.cast_all(cast_args[position], dtype, device_type, lower=lower)
        if kwargs:
            kwargs = {
                k: _functions.cast_all(v, dtype, device_type, lower=lower) if k in tensor_names else v
                for k, v in kwargs.items()
            }
        return run(cast_args, kwargs)

    def lower_kernel(*args: Any, **kwargs: Any) -> Any:
        if not _applies() or explicit_dtype(args, kwargs):
            return run(args, kwargs)
        return cast_and_run(torch.get_autocast_dtype(device_type), True, args, kwargs)

    def fp32_kernel(*args: Any, **kwargs: Any) -> Any:
        if not _applies() or explicit_dtype(args, kwargs):
            return run(args, kwargs)
        return cast_and_run(torch.float32, False, args, kwargs)

    def promote_kernel(*args: Any, **kwargs: Any) -> Any:
        if _applies():
            dtypes = _functions.floating_dtypes((*args, *kwargs.values()), device_type)
            if len(dtypes) > 1:
                return cast_and_run(_functions.widest(dtypes), False, args, kwargs)
        return run(args, kwargs)

    def banned_kernel(*args: Any, **kwargs: Any) -> Any:
        policy = _innermost()
        if policy is None or policy.policy != "apex":  # what the device's own autocast kernel does
            if device_type != "cpu":
                raise RuntimeError(NATIVE_BCE_MESSAGE)
            return cast_and_run(torch.float32, False, args, kwargs)
        dtypes = _functions.floating_dtypes((*args, *kwargs.values()), device_type)
        if any(dtype in _LOWER_PRECISION for dtype in dtypes):
            if not policy.allow_banned:
                # A deliberate refusal, with Apex's exception type and message (code may catch either).
                raise NotImplementedError(BANNED_BCE_MESSAGE)
            return cast_and_run(torch.float32, False, args, kwargs)
        return run(args, kwargs)

    kernels = {"lower": lower_kernel, "fp32": fp32_kernel, "promote": promote_kernel, "banned": banned_kernel}
    return kernels[policy]


class _Kernels:
    """The extra autocast kernels, one ``torch.library.Library`` per device type, reference-counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: dict[str, tuple[torch.library.Library, int]] = {}

    def registered(self) -> dict[str, int]:
        """Device type -> how many active policies hold its kernels."""
        with self._lock:
            return {device: count for device, (_, count) in self._libraries.items()}

    def acquire(self, device_type: str) -> None:
        with self._lock:
            library, count = self._libraries.get(device_type, (None, 0))
            if library is None:
                library = _register(device_type)
            self._libraries[device_type] = (library, count + 1)

    def release(self, device_type: str) -> None:
        with self._lock:
            library, count = self._libraries[device_type]
            if count > 1:
                self._libraries[device_type] = (library, count - 1)
                return
            del self._libraries[device_type]
            library._destroy()  # type: ignore[no-untyped-call]


def _register(device_type: str) -> torch.library.Library:
    key = AUTOCAST_KEYS[device_type]
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():
            # Replacing the banned ops' native kernel (binary_cross_entropy: fp32 on CPU, an error on CUDA) is
            # the point; the dispatcher warns about it, once per process, and restores the native kernel when
            # the library is destroyed. The plan overrides no other native kernel.
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for op, policy in plan(key).items():
                library.impl(op, make_kernel(op, policy, device_type), key)  # type: ignore[no-untyped-call]
    except BaseException:
        library._destroy()  # type: ignore[no-untyped-call]
        raise
    return library


KERNELS = _Kernels()
