"""Does each call the migration kept or wrote bind to ampinit's signature? Checked statically, before a file is
reported clean: a file whose first ``amp.initialize(..., verbosity=args.rank == 0)`` raises is not clean.

Every call whose function is reached through an ``ampinit`` import of the migrated file is bound with
:func:`inspect.Signature.bind` (argument names and count), and each argument whose type the source states (a
literal, a comparison, ``not x``) is checked against the parameter's default: a bool where ampinit's strict core
takes an int (``verbosity``, ``num_losses``, ``loss_id``), a string where it takes a number. Arguments whose type
only the running program knows are not guessed at.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ampinit.migrate._report import Site

_NOT_BOUND = "does not bind to ampinit's signature, so it raises at its first call: "


def unbound_calls(source: str) -> list[Site]:
    """A needs-a-human site for each call into ampinit in ``source`` that cannot bind, with the reason."""
    module = cst.parse_module(source)
    locals_ = _ampinit_locals(module)
    if not locals_:
        return []
    checker = _Checker(locals_)
    MetadataWrapper(module).visit(checker)
    return checker.sites


def _ampinit_locals(module: cst.Module) -> dict[str, str]:
    found: dict[str, str] = {}
    for node in _imports(module):
        if isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
            base = cst.Module([]).code_for_node(node.module)
            if base.split(".")[0] != "ampinit" or isinstance(node.names, cst.ImportStar):
                continue
            for alias in node.names:
                name = cst.Module([]).code_for_node(alias.name)
                local = cst.Module([]).code_for_node(alias.asname.name) if alias.asname else name
                found[local] = f"{base}.{name}"
    return found


def _imports(module: cst.Module) -> list[cst.ImportFrom]:
    out: list[cst.ImportFrom] = []

    class Visitor(cst.CSTVisitor):
        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            out.append(node)

    module.visit(Visitor())
    return out


def _resolve(qualified: str) -> Any:
    """The object ``a.b.c`` names: the longest importable module prefix, then attributes; None if none."""
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part, None)
            if found is None:
                return None
        return found
    return None


def _stated_type(node: cst.BaseExpression) -> type | None:
    """The type an expression has whatever the program's state: literals, comparisons, ``not``."""
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return bool
    if isinstance(node, (cst.Comparison,)) or (
        isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not)
    ):
        return bool
    if isinstance(node, cst.Integer):
        return int
    if isinstance(node, cst.Float):
        return float
    if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
        return str
    return None


def _mismatch(given: type, default: object) -> bool:
    """Whether ampinit's strict core refuses a value of type ``given`` for a parameter with this default."""
    if default is inspect.Parameter.empty or default is None:
        return False
    if isinstance(default, bool):
        return False  # flags are tested for truth or read from "True"/"False"
    if isinstance(default, int):
        return given is bool or given is str  # _options refuses bools and strings as counts
    if isinstance(default, float):
        return given is bool or given is str
    return False


class _Checker(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, locals_: dict[str, str]) -> None:
        self.locals = locals_
        self.sites: list[Site] = []

    def visit_Call(self, node: cst.Call) -> None:
        try:
            name = cst.Module([]).code_for_node(node.func)
        except Exception:  # pragma: no cover - code_for_node takes any node
            return
        root, _, rest = name.partition(".")
        if root not in self.locals or not all(p.isidentifier() for p in name.split(".")):
            return
        target = _resolve(self.locals[root] + ("." + rest if rest else ""))
        if target is None or not callable(target) or any(a.star for a in node.args):
            return
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return
        positional = [a.value for a in node.args if a.keyword is None]
        named = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        try:
            bound = signature.bind(*positional, **named)
        except TypeError as error:
            self._flag(node, name, str(error))
            return
        self._historic(node, name, target, bound.arguments)
        for parameter, value in bound.arguments.items():
            given = _stated_type(value) if isinstance(value, cst.BaseExpression) else None
            default = signature.parameters[parameter].default
            if given is not None and _mismatch(given, default):
                code = cst.Module([]).code_for_node(value)
                self._flag(
                    node,
                    name,
                    f"{parameter}={code} is a {given.__name__}, where ampinit takes a {type(default).__name__} "
                    f"(the Apex aliases, ampinit.compat.apex, convert it as Apex did)",
                )

    def _historic(self, node: cst.Call, name: str, target: object, arguments: dict[str, Any]) -> None:
        """Apex's pre-2019-08 FusedAdam arguments (see ampinit.optimizers.fused_adam): reported, and flagged
        where ampinit refuses the value."""
        from ampinit.optimizers import FusedAdam

        if target is not FusedAdam:
            return
        line = int(self.get_metadata(PositionProvider, node).start.line)
        if "max_grad_norm" in arguments:
            self.sites.append(
                Site(line, f"{name}(max_grad_norm=...): Apex's pre-2019-08 per-group clipping, kept (FutureWarning)")
            )
        value = arguments.get("eps_inside_sqrt")
        if value is not None and not (isinstance(value, cst.Name) and value.value == "False"):
            self._flag(
                node,
                name,
                "eps_inside_sqrt: Apex dropped it in 2019-08 (commit 18062b69) and ampinit has no "
                "eps-inside-sqrt mode; drop it and retune eps, or keep Apex of before 2019-08-16",
            )

    def _flag(self, node: cst.Call, name: str, reason: str) -> None:
        line = int(self.get_metadata(PositionProvider, node).start.line)
        self.sites.append(Site(line, f"{name}(...) {_NOT_BOUND}{reason}", needs_human=True))
