"""What code outside the session may use of it: its public methods, and a scan that keeps the rest private.

The Apex layer asks the session (``clear_cast_cache``, ``next_step_skipped``, ``grads_scaled``...) instead of
reading its private attributes or those of the engine objects it holds (optimizer records, the cast policy, the
loss scalers...), so that the engine can change shape without breaking the products built on it. The scan reads
the source (``ast``) of every module of the package.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest
import torch

import ampinit
from ampinit import _session, amp
from tests.conftest import make_problem

PACKAGE = Path(ampinit.__file__).resolve().parent
SELF_NAMES = ("self", "cls")


def _classes_named_in(module: ModuleType) -> set[type]:
    return {
        value for value in vars(module).values() if isinstance(value, type) and value.__module__.startswith("ampinit.")
    }


def watched_classes() -> list[type]:
    """The session, the engine classes it is built from (every ampinit class ``_session.py`` names) and the
    classes those are built from in turn (an optimizer record's grads, for one)."""
    held = _classes_named_in(_session)
    for cls in list(held):
        held |= _classes_named_in(importlib.import_module(cls.__module__))
    return sorted(held, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


def private_names(cls: type) -> set[str]:
    """The single-underscore names ``cls`` (or an ampinit base of it) defines: methods, class-level names and
    the attributes its methods set on ``self``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ampinit."):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.endswith("__")}


def home(cls: type) -> Path:
    """Where ``cls``'s privates may be read: its own file for a module at the package root, else its whole
    folder (a wing such as ``_casting/`` shares its privates among its files)."""
    path = Path(inspect.getsourcefile(cls) or "").resolve()
    return path if path.parent == PACKAGE else path.parent


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in SELF_NAMES


def _read_names(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, attribute name, source) of every attribute read off something other than ``self``/``cls``,
    including ``getattr(obj, "_name")``."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not _is_self(node.value):
            reads.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            reads.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return reads


def private_reaches(package: Path, classes: list[type]) -> list[str]:
    """Each read, in ``package``, of a private name of a class in ``classes`` from outside that class's home.
    A name several classes define counts as a reach only where none of them lives."""
    homes: dict[str, list[Path]] = {}
    for cls in classes:
        for name in private_names(cls):
            homes.setdefault(name, []).append(home(cls))
    found = []
    for path in sorted(package.rglob("*.py")):
        for line, name, source in sorted(_read_names(ast.parse(path.read_text()))):
            where = homes.get(name, [])
            if where and not any(path == h or h in path.parents for h in where):
                found.append(f"{path.relative_to(package.parent)}:{line}: {source}")
    return found


def test_the_scan_watches_the_session_and_the_engine_objects_it_holds() -> None:
    names = {cls.__name__ for cls in watched_classes()}
    assert {"AmpSession", "OptimizerRecord", "OptimizerGrads", "CastPolicy", "LossScaler", "OverflowDecisions"} <= names
    assert {"_records", "_cast_policy", "_record_of"} <= private_names(_session.AmpSession)


def test_the_scan_finds_a_private_reach(tmp_path: Path) -> None:
    """The scan itself, on a package written here: reads off another object count, ``self``'s do not."""
    (tmp_path / "outside.py").write_text(
        "def f(session):\n"
        "    session._cast_policy.clear_cache()\n"
        "    return getattr(session, '_records')\n"
        "class Own:\n"
        "    def g(self):\n"
        "        return self._record_of\n"
    )
    assert private_reaches(tmp_path, [_session.AmpSession]) == [
        f"{tmp_path.name}/outside.py:2: session._cast_policy",
        f"{tmp_path.name}/outside.py:3: getattr(session, '_records')",
    ]


def test_no_module_reads_a_private_of_the_session_or_its_engine_objects() -> None:
    assert private_reaches(PACKAGE, watched_classes()) == []


# -- the public methods that replaced the reaches ------------------------------------------------------------


def _open(level: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, ampinit.AmpSession]:
    model, x, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    session = ampinit.session_of(opt)
    assert session is not None
    return model, opt, x, session


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grads_scaled_while_delay_unscale_keeps_them_scaled(level: str) -> None:
    model, opt, x, session = _open(level)
    try:
        assert not session.grads_scaled(opt)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt, delay_unscale=True) as scaled:
            scaled.backward()
        assert session.grads_scaled(opt)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        assert not session.grads_scaled(opt)
    finally:
        session.close()


@pytest.mark.parametrize("sync_free", [False, True])
def test_next_step_skipped_foretells_the_skip(sync_free: bool) -> None:
    model, x, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, sync_free=sync_free)
    session = ampinit.session_of(opt)
    assert session is not None
    try:
        with amp.scale_loss(model(x).float().pow(2).mean() * float("inf"), opt) as scaled:
            scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        assert session.next_step_skipped(opt)
        opt.step()
        assert session.step_was_skipped(opt) and not session.next_step_skipped(opt)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        assert not session.next_step_skipped(opt)
        opt.step()
        assert not session.step_was_skipped(opt)
    finally:
        session.close()


def test_an_optimizer_of_no_session_is_neither_scaled_nor_skipped() -> None:
    _, _, _, session = _open("O2")
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        assert not session.next_step_skipped(stranger) and not session.grads_scaled(stranger)
    finally:
        session.close()


def test_clear_cast_cache_makes_an_in_place_weight_change_visible() -> None:
    """Within one cached region a weight changed in place reads its old cast (Apex's caveat) until the cache is
    cleared; the reference is the forward of the changed weight in fp32."""
    _, _, _, session = _open("O1")
    weight = torch.nn.Parameter(torch.ones(4, 4))
    x = torch.ones(2, 4)
    try:
        session.cache_casts_outside_forwards()
        first = torch.nn.functional.linear(x, weight)
        with torch.no_grad():
            weight.mul_(2)
        assert torch.equal(torch.nn.functional.linear(x, weight), first)
        session.clear_cast_cache()
        assert torch.equal(torch.nn.functional.linear(x, weight).float(), x @ weight.detach().t())
    finally:
        session.close()


@pytest.mark.parametrize("method", ["cache_casts_outside_forwards", "follow_apex_tensor_rules"])
def test_a_closed_session_refuses_to_change_its_casts(method: str) -> None:
    _, _, _, session = _open("O1")
    session.close()
    with pytest.raises(RuntimeError, match="This amp session has been closed"):
        getattr(session, method)()
