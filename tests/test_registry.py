"""``ampinit._registry``: a ledger below the session; building a session writes nothing in it."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import ampinit
from ampinit import _registry, amp
from ampinit._options import resolve_options
from ampinit._session import AmpSession
from tests.conftest import SmallNet
from tests.test_options import _DEFAULTS


def test_the_registry_imports_nothing_of_ampinit() -> None:
    source = Path(_registry.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported == {"__future__", "weakref", "collections.abc"}


def test_building_a_session_has_no_global_side_effect() -> None:
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = AmpSession([model], [opt], resolve_options(**{**_DEFAULTS, "opt_level": "O2", "verbosity": 0}))
    try:
        assert _registry.live_sessions() == [] and ampinit.current_session() is None
        assert ampinit.session_of(opt) is None
    finally:
        session.close()
    assert all(p.dtype == torch.float32 for p in model.parameters()) and "step" not in vars(opt)


def test_initialize_writes_the_session_in_and_close_strikes_it_out() -> None:
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    session = ampinit.current_session()
    assert session is not None and _registry.live_sessions() == [session]
    assert ampinit.session_of(model) is session and ampinit.session_of(opt) is session
    session.close()
    assert _registry.live_sessions() == [] and ampinit.session_of(opt) is None and ampinit.current_session() is None
