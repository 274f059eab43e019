"""The hooks an amp session puts on a model: shared by a deep copy of the model, inert in a pickled one.

Engine layer, no dependencies. A hook that is a closure or a bound method of the session's objects drags the
session (its optimizer, masters and thread-local state) into anything that copies or pickles the model:
``copy.deepcopy(model)`` (EMA helpers) and ``torch.save(model)`` (whole-model checkpoints, which Apex's O1 left
working). :class:`SessionHook` wraps such a hook so that:

- a deep copy shares the hook: the hooks act on the module they are called with and on parameter identities, so
  on a copy they cast its inputs and outputs as its half weights need and leave its state dict alone;
- a pickled model carries :func:`inert_hook` in its place: the session does not travel, and the loaded model is a
  plain module with the weights (and dtypes) it had when it was saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class SessionHook:
    """A model hook of an amp session: calls ``fn``; see the module docstring for copies and pickles."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        _calls_run_eagerly()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> SessionHook:
        return self

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return (_inert, ())


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a session's hook is in a model loaded from a pickle: nothing (every hook kind reads None as such)."""
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


def _calls_run_eagerly() -> None:
    """Make every hook run eagerly around a compiled forward (``torch.compiler.disable`` on ``SessionHook.__call__``),
    once, at the first hook made rather than at import: the decorator imports ``torch._dynamo`` (and sympy), a
    second that ``import ampinit`` must not cost.

    Traced, a hook was a frame resumed after a graph break with the forward's output as its input, which dynamo
    wraps by reading its ``.grad``: a warning on a non-leaf tensor (an error where warnings are errors), and a
    second graph. The cast policy's hooks open and close one autocast region across two hooks, which cannot be
    traced at all.
    """
    call = SessionHook.__call__
    if getattr(call, "_ampinit_eager", False):
        return
    eager = torch.compiler.disable(call)  # type: ignore[no-untyped-call]
    eager._ampinit_eager = True
    SessionHook.__call__ = eager  # type: ignore[method-assign]
