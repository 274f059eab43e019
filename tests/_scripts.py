"""Running a legacy script and its migrated version side by side in the test process (the migrate tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ampinit
from ampinit import _registry
from ampinit.compat import apex


@contextlib.contextmanager
def as_apex_code(apex_aliases: bool) -> Iterator[None]:
    """Inside, with ``apex_aliases``, ``apex`` imports resolve to ampinit's Apex layer, as ``ampinit run`` runs a
    legacy script. On the way out the aliases go, and so does every amp session the code left open."""
    if apex_aliases:
        apex.install()
    try:
        yield
    finally:
        if apex_aliases:
            apex.uninstall()
        while _registry.current() is not None:
            ampinit.deinitialize()


def exec_source(source: str, filename: str) -> dict[str, object]:
    """Execute ``source`` as a script (``__name__ == "__main__"``) and return its namespace."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace
