"""``apex.amp._amp_state``: read-through views over the current ampinit session.

Apex kept its state in one module-global object whose fields appeared at runtime. Legacy code reads a few of
them (``_amp_state.loss_scalers[0].loss_scale()``, ``opt_properties``, ``handle``, ``verbosity``); here each is a
property that looks up :func:`ampinit.current_session` when read, so there is no second copy of any state. Only the
two switches that Apex let users set before ``initialize`` (``allow_incoming_model_not_fp32``, ``hard_override``)
are stored here, because they are inputs, not state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

import ampinit
from ampinit import AmpSession, Properties
from ampinit.compat.apex.amp.scaler import LossScaler

if TYPE_CHECKING:
    from ampinit.compat.apex.amp.handle import AmpHandle

logger = logging.getLogger("ampinit")

__all__ = ["LossScalerView", "_amp_state", "master_params", "maybe_print", "warn_or_err"]


#: The type of ``_amp_state.loss_scalers[i]``: Apex's ``LossScaler`` over one of the session's scalers.
LossScalerView = LossScaler


class AmpState:
    """The object behind ``apex.amp._amp_state``."""

    def __init__(self) -> None:
        #: Apex skipped its fp32/CUDA parameter check when this was set. ampinit accepts CPU models anyway and
        #: uses the flag to accept half-precision models at levels that cast the model (see initialize).
        self.allow_incoming_model_not_fp32 = False
        #: Apex turned its option-validation errors into printed warnings when this was set; ampinit keeps them
        #: errors (a wrong option is a bug), and only records the flag.
        self.hard_override = False
        self._handles: weakref.WeakKeyDictionary[AmpSession, AmpHandle] = weakref.WeakKeyDictionary()

    @staticmethod
    def _session(field: str) -> AmpSession:
        session = ampinit.current_session()
        if session is None:
            raise AttributeError(f"_amp_state has no {field!r}: amp.initialize() has not been called (or was undone)")
        return session

    @property
    def opt_properties(self) -> Properties:
        return self._session("opt_properties").properties

    @property
    def loss_scalers(self) -> list[LossScaler]:
        """Apex's scalers, as faces of the session's: ``loss_scalers[0]._scale_seq_len = 10`` changes the session."""
        session = self._session("loss_scalers")
        return [LossScaler.of(scaler, session.decide_deferred_by_hand) for scaler in session.scalers]

    @property
    def verbosity(self) -> int:
        session = ampinit.current_session()
        return 1 if session is None else session.verbosity

    @verbosity.setter
    def verbosity(self, value: int) -> None:
        self._session("verbosity").verbosity = int(value)

    @property
    def min_loss_scale(self) -> float | None:
        scalers = self.loss_scalers
        return scalers[0]._min_loss_scale if scalers else None

    @property
    def max_loss_scale(self) -> float | None:
        scalers = self.loss_scalers
        return scalers[0]._max_loss_scale if scalers else None

    @property
    def handle(self) -> AmpHandle:
        """The O1 handle: exists while the current session casts torch functions (O1/O4), as in Apex."""
        session = self._session("handle")
        if session.properties.cast_dtype is None or not session.enabled:
            raise AttributeError("_amp_state has no 'handle': the current amp session does not cast functions (not O1)")
        return self.handle_for(session)

    def handle_for(self, session: AmpSession, verbose: bool = False) -> AmpHandle:
        from ampinit.compat.apex.amp.handle import AmpHandle

        handle = self._handles.get(session)
        if handle is None:
            handle = self._handles[session] = AmpHandle(session, verbose=verbose)
        return handle

    def __repr__(self) -> str:
        return f"_amp_state(session={ampinit.current_session()!r})"


_amp_state = AmpState()


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Apex's generator over the parameters ``optimizer`` updates (fp32 masters with O2)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Apex printed this when ``verbosity > 0``; ampinit logs it (logger ``ampinit``, level INFO)."""
    if _amp_state.verbosity > 0:
        logger.info(msg)


def warn_or_err(msg: str) -> None:
    """Apex raised (or printed, with ``hard_override``); ampinit always raises: a wrong option is a bug."""
    raise RuntimeError(msg)
