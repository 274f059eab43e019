"""``apex.amp.handle``: ``scale_loss``, ``disable_casts`` and the O1 handle of the old ``amp.init()`` API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

import ampinit
from ampinit import AmpSession
from ampinit.compat.apex import _loose

__all__ = ["AmpHandle", "NoOpHandle", "disable_casts", "scale_loss"]

OLD_API_MESSAGE = (
    "The old Amp API is no longer supported.  Please move to the new API, documented here:  "
    "https://nvidia.github.io/apex/amp.html.  Transition guide:  "
    "https://nvidia.github.io/apex/amp.html#transition-guide-for-old-api-users"
)
_EMPTY_CACHE: Mapping[Any, torch.Tensor] = MappingProxyType({})


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer amp manages: LARC's inner optimizer, anything else unchanged."""
    from ampinit.compat.apex.parallel.LARC import LARC

    return optimizer.optim if isinstance(optimizer, LARC) else optimizer


def _unwrap_all(optimizers: Any) -> Any:
    if isinstance(optimizers, (list, tuple)):
        return type(optimizers)(unwrap_optimizer(o) for o in optimizers)
    return unwrap_optimizer(optimizers)


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Apex's ``amp.scale_loss``; LARC-wrapped optimizers and the values Apex accepted (a numpy ``loss_id``,
    ``delay_unscale=step % k != 0`` as any truth value) are accepted as in Apex."""
    return ampinit.scale_loss(
        loss,
        _unwrap_all(optimizers),
        _loose.whole_number("loss_id", loss_id),  # type: ignore[arg-type]
        model,
        bool(delay_unscale),
        bool(delay_overflow_check),
    )


def disable_casts() -> contextlib.AbstractContextManager[None]:
    """Apex's ``amp.disable_casts()`` (restores the casts also when the body raises)."""
    return ampinit.disable_casts()


class AmpHandle:
    """The O1 handle (``amp.init()``'s return value, ``_amp_state.handle``): a view over an O1 session."""

    def __init__(self, session: AmpSession, verbose: bool = False) -> None:
        self._session = session
        self._verbose = verbose

    @property
    def session(self) -> AmpSession:
        return self._session

    def is_active(self) -> bool:
        return not self._session.closed

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with self._session.disable_casts():
            yield

    def _deactivate(self) -> None:
        """Undo the casts (Apex restored its patched functions; ampinit closes the session)."""
        self._session.close()

    def _clear_cache(self) -> None:
        """Forget the cached weight casts (the session also does it at every ``scale_loss`` exit and step)."""
        self._session.clear_cast_cache()

    def remove_cache(self, param: torch.Tensor) -> None:
        """Forget the cached casts, of ``param`` among others (torch's cache cannot drop one entry)."""
        self._session.clear_cast_cache()

    @property
    def has_cache(self) -> bool:
        return True

    @property
    def cache(self) -> Mapping[Any, torch.Tensor]:
        """Always empty: ampinit's cast cache is internal to its cast engine (see docs/migration.md)."""
        return _EMPTY_CACHE

    @property
    def verbose(self) -> bool:
        return self._verbose

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> Any:
        raise RuntimeError(OLD_API_MESSAGE)

    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Any:
        raise RuntimeError(OLD_API_MESSAGE)

    def __repr__(self) -> str:
        return f"AmpHandle({self._session!r})"


class NoOpHandle:
    """``amp.init(enabled=False)``: casts nothing."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def _deactivate(self) -> None:
        pass

    def _clear_cache(self) -> None:
        pass

    def remove_cache(self, param: torch.Tensor) -> None:
        pass

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> Any:
        raise RuntimeError(OLD_API_MESSAGE)

    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Any:
        raise RuntimeError(OLD_API_MESSAGE)
