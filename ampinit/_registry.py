"""The ledger of live sessions: the package's one record of which session owns which model or optimizer.

Apex kept everything in a module-global ``_amp_state``. ampinit keeps its state in session objects and only
writes down, here, (a) the live sessions in the order they were opened, so that module-level functions act on
the most recent one as Apex's did, and (b) a weak map from each model and optimizer to its session, so that
``scale_loss(loss, optimizer)`` finds the session the optimizer belongs to.

The ledger sits below the session and knows nothing about it (entries are plain objects): ``initialize`` writes
a session in once it is built, and the session strikes itself out when it closes. Building an ``AmpSession``
therefore touches no module state; callers that need the session type check it where they read an entry.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

_live: list[object] = []
_owner: weakref.WeakKeyDictionary[object, object] = weakref.WeakKeyDictionary()


def register(session: object, owned: Iterable[object]) -> None:
    """Write ``session`` in as the most recent one, owning ``owned`` (its models and optimizers)."""
    _live.append(session)
    for obj in owned:
        _owner[obj] = session


def unregister(session: object) -> None:
    """Strike ``session`` out (a no-op when it was never written in)."""
    if session in _live:
        _live.remove(session)
    for obj, owner in list(_owner.items()):
        if owner is session:
            del _owner[obj]


def owner_of(obj: object) -> object | None:
    try:
        return _owner.get(obj)
    except TypeError:  # unhashable objects belong to nobody
        return None


def current() -> object | None:
    """The most recently registered session that is still open."""
    return _live[-1] if _live else None


def live_sessions() -> list[object]:
    return list(_live)
