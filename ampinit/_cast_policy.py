"""The O1/O4 cast engine: PyTorch's autocast dispatch, switched on for the life of a session.

Apex's O1 patched ~1,000 torch functions in Python. ampinit uses PyTorch's own autocast dispatch instead
(``../docs/design.md``, decision 2): the same op lists Apex's native successor uses, at native speed and
compatible with ``torch.compile``. A :class:`CastPolicy` does three things:

* ``activate()``: from ``initialize`` until ``close``, torch calls in the initializing thread follow the policy,
  inside and outside the model, as Apex's global patching did;
* ``install_forward_hooks(model)``: the model's forward follows it in any thread (e.g. DataLoader workers or
  a serving thread);
* ``suspended()``: a region with no casting (the optimizer step, the backward inside ``scale_loss``, and the
  user's ``disable_casts()``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.utils.hooks import RemovableHandle

CastPolicyName = Literal["apex", "native"]
CAST_POLICIES: tuple[CastPolicyName, ...] = ("apex", "native")


class CastPolicy:
    """Autocast to ``dtype`` on ``device_types`` while active."""

    def __init__(
        self,
        device_types: list[str],
        dtype: torch.dtype,
        *,
        policy: CastPolicyName = "apex",
        allow_banned: bool = False,
    ) -> None:
        self.device_types = sorted(set(device_types))
        self.dtype = dtype
        self.policy = policy
        self.allow_banned = allow_banned
        self._saved: list[tuple[str, bool, torch.dtype]] = []
        self._thread: int | None = None
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def activate(self) -> None:
        """Switch the policy on in the calling thread until :meth:`deactivate`."""
        if self.active:
            raise RuntimeError("CastPolicy.activate() called twice without deactivate()")
        for device in self.device_types:
            self._saved.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, self.dtype)
        # Counts as an open autocast region, so that a user's nested ``with torch.autocast`` does not clear
        # the weight-cast cache on its exit.
        torch.autocast_increment_nesting()
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
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        for device, enabled, dtype in reversed(self._saved):
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        self._saved.clear()
        self._thread = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No casting inside; the previous state comes back on exit, also when the body raises."""
        self._local.suspended = getattr(self._local, "suspended", 0) + 1
        try:
            with contextlib.ExitStack() as stack:
                for device in self.device_types:
                    stack.enter_context(torch.autocast(device, enabled=False))
                yield
        finally:
            self._local.suspended -= 1

    def clear_cache(self) -> None:
        """Forget cached weight casts (weights change at every optimizer step)."""
        torch.clear_autocast_cache()

    def install_forward_hooks(self, model: torch.nn.Module) -> list[RemovableHandle]:
        """Run ``model``'s forward under the policy in whichever thread calls it."""

        def enter(module: torch.nn.Module, args: Any) -> None:
            stack = self._thread_stack()
            contexts = contextlib.ExitStack()
            if not getattr(self._local, "suspended", 0):  # a forward inside disable_casts() stays uncast
                for device in self.device_types:
                    contexts.enter_context(torch.autocast(device, dtype=self.dtype))
            stack.append(contexts)

        def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self._thread_stack()
            if stack:
                stack.pop().close()

        return [
            model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True),
        ]

    def _thread_stack(self) -> list[contextlib.ExitStack]:
        stack: list[contextlib.ExitStack] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack
