"""The libcst vocabulary every codemod of ``ampinit migrate`` speaks: source text of a node, dotted names,
import aliases, call arguments by parameter name, lines and enclosing statements, fresh names.

One copy each, so that two codemods cannot disagree on what ``amp.initialize(model, opt, "O1")`` binds to
``opt_level`` or on which name ``from apex import amp as a`` binds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import libcst as cst

#: A node's position, as ``PositionProvider`` resolves it (its ``start.line`` is what a site reports).
Positions = Mapping[cst.CSTNode, Any]
Parents = Mapping[cst.CSTNode, cst.CSTNode]


def code(node: cst.CSTNode) -> str:
    """The source text of ``node`` alone."""
    return cst.Module([]).code_for_node(node)


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def local_name(alias: cst.ImportAlias) -> str:
    """The name an import alias is known by in the file: its ``as`` name, else the imported (dotted) name."""
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return dotted(alias.name) or ""


def without_aliases(node: Any, drop: Iterable[cst.ImportAlias]) -> Any:
    """``node`` (an ``Import``/``ImportFrom``) without the aliases in ``drop``: unchanged when none of them is
    there, ``RemoveFromParent`` when nothing is left, else the rest with the last one's trailing comma dropped."""
    dropped = {id(alias) for alias in drop}
    rest = [alias for alias in node.names if id(alias) not in dropped]
    if len(rest) == len(node.names):
        return node
    if not rest:
        return cst.RemoveFromParent()
    return node.with_changes(names=last_comma_dropped(rest))


def last_comma_dropped(items: Sequence[Any]) -> list[Any]:
    """An argument or import list with the trailing comma of its last item dropped (after items were removed)."""
    fixed = list(items)
    if fixed:
        fixed[-1] = fixed[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return fixed


def imports_torch(module: cst.Module) -> bool:
    """Whether a module-level ``import torch`` binds the name ``torch`` (``import torch as th`` does not), which
    the lines a codemod writes use."""
    return any(
        isinstance(statement, cst.SimpleStatementLine)
        and any(
            isinstance(small, cst.Import) and any(dotted(a.name) == "torch" and a.asname is None for a in small.names)
            for small in statement.body
        )
        for statement in module.body
    )


def arguments(call: cst.Call, signature: Sequence[str]) -> dict[str, cst.Arg] | None:
    """The arguments of ``call`` by parameter name (positional ones named from ``signature``); None where a
    ``*args``/``**kwargs`` argument, or a positional one past the signature, makes the names unknowable."""
    found: dict[str, cst.Arg] = {}
    for index, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is not None:
            found[arg.keyword.value] = arg
        elif index < len(signature):
            found[signature[index]] = arg
        else:
            return None
    return found


def keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    """The value of the keyword argument ``name`` of ``call``, if given."""
    return next((a.value for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def method_call(node: cst.CSTNode | None, owner: str, name: str) -> cst.Call | None:
    """``node`` if it is a call ``<owner>.<name>(...)`` (``owner`` a dotted name), else None."""
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == name
        and dotted(node.func.value) == owner
    ):
        return node
    return None


def method_name(node: cst.CSTNode) -> str | None:
    """``m`` of a call ``x.m(...)``; None for anything else."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        return node.func.attr.value
    return None


def line(positions: Positions, node: cst.CSTNode) -> int:
    """The line ``node`` starts on, the one a site reports."""
    return int(positions[node].start.line)


def statement_of(parents: Parents, node: cst.CSTNode) -> cst.SimpleStatementLine | cst.BaseCompoundStatement:
    """The statement (a simple line or a compound statement) that holds ``node``."""
    current = node
    while not isinstance(current, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        current = parents[current]
    return current


def function_of(parents: Parents, node: cst.CSTNode) -> cst.FunctionDef | cst.Module:
    """The innermost function around ``node``, or the module."""
    current: cst.CSTNode | None = parents.get(node)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
        current = parents.get(current)
    assert current is not None, "every node sits in a module"
    return current


def fresh_name(preferred: Sequence[str], used: set[str]) -> str:
    """The first of ``preferred`` that the file does not use (the last one with ``_`` appended if all are)."""
    for name in preferred:
        if name not in used:
            return name
    return preferred[-1] + "_"
