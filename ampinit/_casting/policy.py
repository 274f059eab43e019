"""The O1/O4 cast policy: PyTorch's autocast dispatch, switched on for the life of a session.

Apex's O1 patched ~1,000 torch functions in Python. ampinit uses PyTorch's own autocast dispatch instead
(``docs/design.md``, decision 2), at native speed and compatible with ``torch.compile``. With
``policy="apex"`` the ops of Apex's lists that a device's native lists lack (on the CPU: softmax, layer_norm,
sum, exp, pow, norms, ...) get extra kernels on that device's autocast dispatch key (``kernels``), so that every
device runs Apex's cast semantics. ``policy="auto"`` registers the same kernels less those measured to change no
result on the device at the policy's dtype (``lists.unchanged``), which then run as native autocast runs them.
``policy="native"`` keeps PyTorch's lists only.

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

For sessions made through the Apex API, ``follow_apex_tensor_rules()`` adds Apex's tensor rules (``apex_tensor``:
``.cpu()`` of a half tensor gives float32, in-place fp32-list functions refuse fp16) until ``deactivate()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ampinit._casting import apex_tensor, arguments, lists, scopes, user_functions
from ampinit._casting.kernels import AUTOCAST_KEYS, KERNELS
from ampinit._casting.lists import Policy
from ampinit._hooks import SessionHook
from ampinit._types import CastPolicyName

# What a model forward restores on exit: (device, autocast enabled, autocast dtype) per device, and the cache flag.
_Saved = tuple[list[tuple[str, bool, torch.dtype]], bool]
# One open model forward: its module's id, and what to restore (None: the forward was uncast).
_Entry = tuple[int, _Saved | None]


class CastPolicy:
    """Autocast to ``dtype`` on ``device_types`` while active, with Apex's lists on top for ``policy="apex"``
    (less the entries that change no result there for ``policy="auto"``)."""

    def __init__(
        self,
        device_types: list[str],
        dtype: torch.dtype,
        *,
        policy: CastPolicyName = "auto",
        allow_banned: bool = False,
    ) -> None:
        # ``policy`` and ``dtype`` come from options ``ampinit._options`` checked; the device types come from the
        # models, which nothing checked before.
        self.device_types = sorted(set(device_types))
        if policy != "native":
            unknown = [d for d in self.device_types if d not in AUTOCAST_KEYS]
            if unknown:
                raise ValueError(
                    f"cast_policy={policy!r} needs an autocast dispatch key for device type {unknown[0]!r}; known: "
                    f"{sorted(AUTOCAST_KEYS)}. Use cast_policy='native' for PyTorch's own lists on this device."
                )
        self.dtype = dtype
        self.policy = policy
        self.allow_banned = allow_banned
        self._saved: list[tuple[str, bool, torch.dtype]] = []
        self._saved_cache_enabled = True
        self._thread: int | None = None
        self._local = threading.local()
        self._acquired: list[str] = []
        self._restore_user_functions: Callable[[], None] | None = None
        self._stop_apex_tensor_rules: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def activate(self) -> None:
        """Switch the policy on in the calling thread until :meth:`deactivate`."""
        if self.active:
            raise RuntimeError("CastPolicy.activate() called twice without deactivate()")
        try:
            patches: list[tuple[object, str, Policy]] = []
            if self.policy != "native":
                apex_lists = lists.current_lists()  # as the code edited apex.amp.lists before initialize
                for device in self.device_types:
                    left_out = lists.unchanged(device, self.dtype, apex_lists) if self.policy == "auto" else frozenset()
                    holder = f"cast_policy={self.policy!r} ({self.dtype})"
                    KERNELS.acquire(device, apex_lists, left_out=left_out, holder=holder, dtype=self.dtype)
                    self._acquired.append(device)
                patches = lists.python_patches(apex_lists)
            self._restore_user_functions = user_functions.REGISTRY.apply(patches)
        except BaseException:
            self._release_kernels()
            raise
        for device in self.device_types:
            self._saved.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, self.dtype)
        # The thread stays one open autocast region for the session's life, but torch's weight-cast cache checks
        # neither versions nor ``.data`` swaps: outside a model forward nothing clears it between a weight's uses
        # (a head or loss weight updated in place, ``load_state_dict`` of a module not passed to initialize), so
        # casts are not cached there. Model forwards switch it back on (``install_forward_hooks``).
        self._saved_cache_enabled = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        # Counts as an open autocast region, so that a user's nested ``with torch.autocast`` does not clear
        # the weight-cast cache on its exit.
        torch.autocast_increment_nesting()
        scopes.activated().append(self)
        scopes.thread_scopes().append(self)
        scopes.open_process_wide(self)
        self._thread = threading.get_ident()

    def deactivate(self) -> None:
        """Restore the autocast state found at :meth:`activate` (must run in the same thread)."""
        if not self.active:
            return
        self.check_thread()
        try:
            stack = scopes.thread_scopes()
            for index in range(len(stack) - 1, -1, -1):
                if stack[index] is self:
                    del stack[index]
                    break
            scopes.close_process_wide(self)
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            arguments.clear_cache()
            self._restore_autocast_state()
            self._thread = None
        finally:
            try:
                if self._stop_apex_tensor_rules is not None:
                    stop, self._stop_apex_tensor_rules = self._stop_apex_tensor_rules, None
                    stop()
            finally:
                try:
                    if self._restore_user_functions is not None:
                        self._restore_user_functions()
                        self._restore_user_functions = None
                finally:
                    self._release_kernels()

    def cache_outside_forwards(self) -> None:
        """Cache weight casts in the activating thread outside model forwards too, until the session clears them.

        For Apex's old ``amp.init()``, whose sessions have no model forward (where the cache is otherwise on):
        Apex's ``enable_caching`` kept a cast until the next ``scale_loss`` exit, with Apex's caveat that a weight
        changed in place meanwhile reads its old cast.
        """
        if self.active and threading.get_ident() == self._thread:
            torch.set_autocast_cache_enabled(True)

    def follow_apex_tensor_rules(self) -> None:
        """Also apply Apex's O1 tensor rules while this policy is in force, until :meth:`deactivate`.

        For sessions made through the Apex API (``apex.amp``), whose code may depend on them: ``.cpu()`` of a half
        tensor gives float32, and the in-place forms of Apex's fp32 functions refuse fp16 tensors
        (``apex_tensor``). Apex had them at fp16 only, so a bf16 policy (O4) keeps autocast's behaviour.
        """
        if not self.active:
            raise RuntimeError("CastPolicy.follow_apex_tensor_rules() needs an active policy: call activate() first")
        if self.dtype != torch.float16 or self._stop_apex_tensor_rules is not None:
            return
        self._stop_apex_tensor_rules = apex_tensor.follow(self, lists.current_lists())

    def check_thread(self) -> None:
        """Raise unless :meth:`deactivate` can run in the calling thread (the one that activated the policy).

        The session asks before it undoes anything, so that a ``close()`` refused here can be made again from
        the right thread.
        """
        if self.active and threading.get_ident() != self._thread:
            raise RuntimeError(
                "The cast policy was activated in another thread: close() the session from the thread that "
                "called initialize(), because autocast state is per thread."
            )

    def _restore_autocast_state(self) -> None:
        """Put back the state found at activation, or hand it to a policy activated later in this thread.

        Sessions may close in any order: when a later policy still holds a device, that policy saved this one's
        state at its activation, so it inherits what this one found instead, and the current state stays.
        """
        activated = scopes.activated()
        index = next(i for i, policy in enumerate(activated) if policy is self)
        later = activated[index + 1 :]
        del activated[index]
        # The cache flag is one per thread: the next policy activated after this one saved the value this one set.
        if later:
            later[0]._saved_cache_enabled = self._saved_cache_enabled
        else:
            torch.set_autocast_cache_enabled(self._saved_cache_enabled)
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
    def suspended(self, *, by_user: bool = True) -> Iterator[None]:
        """No casting inside; the previous state comes back on exit, also when the body raises.

        ``by_user``: the user's ``disable_casts()``, inside which a model forward stays uncast too. The session's own
        suspensions (the backward inside ``scale_loss``, the optimizer step) pass False: a model forward run there
        is the recompute of a ``torch.utils.checkpoint`` around the model, which must cast as the original forward
        did (:meth:`install_forward_hooks`).
        """
        # Flipping the thread's autocast flags directly: a ``torch.autocast`` object per device costs tens of
        # microseconds, and this runs at least twice per training step (backward and optimizer step).
        counter = "suspended" if by_user else "session_suspended"
        setattr(self._local, counter, getattr(self._local, counter, 0) + 1)
        saved = [(device, torch.is_autocast_enabled(device)) for device in self.device_types]
        try:
            for device, _ in saved:
                torch.set_autocast_enabled(device, False)
            yield
        finally:
            for device, enabled in saved:
                torch.set_autocast_enabled(device, enabled)
            setattr(self._local, counter, getattr(self._local, counter) - 1)

    def casts_as_now(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a step's closure: the user's forward and backward), to run with the casts of the calling thread
        as they are now, also when it is called inside a suspension (the optimizer step), in this thread."""
        thread = threading.get_ident()
        enabled = [(device, torch.is_autocast_enabled(device)) for device in self.device_types]
        user, session = getattr(self._local, "suspended", 0), getattr(self._local, "session_suspended", 0)

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return fn(*args, **kwargs)
            inside = [(device, torch.is_autocast_enabled(device)) for device in self.device_types]
            counts = getattr(self._local, "suspended", 0), getattr(self._local, "session_suspended", 0)
            self._local.suspended, self._local.session_suspended = user, session
            for device, on in enabled:
                torch.set_autocast_enabled(device, on)
            try:
                return fn(*args, **kwargs)
            finally:
                for device, on in inside:
                    torch.set_autocast_enabled(device, on)
                self._local.suspended, self._local.session_suspended = counts

        return call

    def _forward_uncast(self) -> bool:
        """Whether a model forward entered now stays uncast.

        Inside the user's ``disable_casts()``, yes. Inside the session's own suspension (the backward of
        ``scale_loss``), a model forward is the recompute of a ``torch.utils.checkpoint`` around the model, which
        restored the autocast state found where the checkpoint was called: in the activating thread that state
        says whether the original forward was cast (casts are on there except inside ``disable_casts()``); in any
        other thread casts are off outside model forwards, and the forward cast by its hooks, as the recompute does.
        """
        if getattr(self._local, "suspended", 0):
            return True
        if getattr(self._local, "session_suspended", 0) and threading.get_ident() == self._thread:
            return not any(torch.is_autocast_enabled(device) for device in self.device_types)
        return False

    def clear_cache(self) -> None:
        """Forget cached weight casts (weights change at every optimizer step)."""
        torch.clear_autocast_cache()
        arguments.clear_cache()

    def install_forward_hooks(self, model: torch.nn.Module) -> list[RemovableHandle]:
        """Run ``model``'s forward under the policy in whichever thread calls it."""

        def enter(module: torch.nn.Module, args: Any) -> None:
            stack = self._thread_stack()
            if not stack:
                # Weights may have changed since the last forward outside the optimizer (``load_state_dict``
                # between eval forwards, a manual update): casts live for one outermost forward at most.
                self.clear_cache()
            if self._forward_uncast():  # a forward inside disable_casts() stays uncast
                stack.append((id(module), None))
                return
            saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in self.device_types]
            for device, _, _ in saved:
                torch.set_autocast_enabled(device, True)
                torch.set_autocast_dtype(device, self.dtype)
            # Weights are cast once per forward (the cache is cleared at the outermost entry, see above).
            saved_cache = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(True)
            # An open autocast region, as ``torch.autocast`` would count it: the weight-cast cache lives until
            # the outermost one closes.
            torch.autocast_increment_nesting()
            scopes.thread_scopes().append(self)
            stack.append((id(module), (saved, saved_cache)))

        def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self._thread_stack()
            # Only the call whose pre-hook opened the entry closes it: when an earlier pre-hook of this call
            # raised, ``enter`` did not run, and the top entry is an enclosing forward's, still running.
            if not stack or stack[-1][0] != id(module):
                return
            _, entry = stack.pop()
            if entry is None:
                return
            saved, saved_cache = entry
            scopes.thread_scopes().pop()
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            for device, enabled, dtype in saved:
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)
            torch.set_autocast_cache_enabled(saved_cache)

        # torch.compile runs the hooks eagerly (SessionHook: a region opened in one hook and closed in another
        # cannot be traced) and compiles the forward under the autocast state they set, on which it guards.
        return [
            model.register_forward_pre_hook(SessionHook(enter)),
            model.register_forward_hook(SessionHook(leave), always_call=True),
        ]

    def _thread_stack(self) -> list[_Entry]:
        """Per thread, per open model forward: the autocast state and cache flag to restore (None: uncast)."""
        stack: list[_Entry] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack
