"""Which cast policy is on where: per thread, the policies in force, and in the process, the open ones.

A :class:`~ampinit._casting.policy.CastPolicy` is on in the thread that activated it (from ``initialize`` until
``close``) and, for the length of a model forward, in whichever thread runs the forward. The extra autocast
kernels ask :func:`innermost` which one to follow.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ampinit._casting.policy import CastPolicy

_local = threading.local()

# Every policy active in the process, in activation order (a thread of autograd's engine has none of its own).
_open: list[CastPolicy] = []
_open_lock = threading.Lock()


def thread_scopes() -> list[CastPolicy]:
    """The policies on in this thread, innermost last (the initializing thread's, then any model forward's)."""
    stack: list[CastPolicy] | None = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def activated() -> list[CastPolicy]:
    """The policies activated in this thread and not yet deactivated, in activation order."""
    stack: list[CastPolicy] | None = getattr(_local, "activated", None)
    if stack is None:
        stack = _local.activated = []
    return stack


def open_process_wide(policy: CastPolicy) -> None:
    with _open_lock:
        _open.append(policy)


def close_process_wide(policy: CastPolicy) -> None:
    with _open_lock:
        _open.remove(policy)


def innermost() -> CastPolicy | None:
    """The policy the extra kernels follow in this thread.

    The thread's innermost one; in a thread with none, while autograd runs a backward there (the engine's
    device threads, which run CUDA backward and so recompute checkpointed forwards, or a backward started in
    another thread), the process's latest active policy: torch.utils.checkpoint restores the forward's
    autocast state for the recompute, and the recompute must cast the same ops as the forward did.
    """
    stack: list[CastPolicy] | None = getattr(_local, "scopes", None)
    if stack:
        return stack[-1]
    if _open and torch._C._current_graph_task_id() != -1:
        with _open_lock:
            return _open[-1] if _open else None
    return None
