"""The package's one piece of module-level mutable state: which live session owns which model or optimizer.

Apex kept everything in a module-global ``_amp_state``. ampinit keeps its state in session objects and only
remembers, here, (a) the live sessions in creation order, so that module-level functions act on the most
recent one as Apex's did, and (b) a weak map from each model and optimizer to its session, so that
``scale_loss(loss, optimizer)`` finds the session the optimizer belongs to.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampinit._session import AmpSession

_live: list[AmpSession] = []
_owner: weakref.WeakKeyDictionary[object, AmpSession] = weakref.WeakKeyDictionary()


def register(session: AmpSession, owned: list[object]) -> None:
    _live.append(session)
    for obj in owned:
        _owner[obj] = session


def unregister(session: AmpSession) -> None:
    if session in _live:
        _live.remove(session)
    for obj, owner in list(_owner.items()):
        if owner is session:
            del _owner[obj]


def owner_of(obj: object) -> AmpSession | None:
    try:
        return _owner.get(obj)
    except TypeError:  # unhashable objects belong to nobody
        return None


def current() -> AmpSession | None:
    """The most recently created session that is still open."""
    return _live[-1] if _live else None


def live_sessions() -> list[AmpSession]:
    return list(_live)
