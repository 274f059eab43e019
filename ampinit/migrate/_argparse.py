"""``--to torch``: the levels an ``opt_level`` read from argparse (``args.opt_level``) can hold.

``--to torch`` has a native equivalent only for O0 and O1, so ``amp.initialize(..., opt_level=args.opt_level)``
migrates only when this file proves the value is one of those two: ``args`` is bound once, to the result of
``parser.parse_args()`` (or of a function of this file that returns it), and every ``add_argument`` of this file
whose destination is ``opt_level`` restricts it with ``choices=`` and a default among O0/O1 (argparse checks
given values against ``choices``; it does not check the default, so the default counts separately).
``set_defaults(opt_level=...)`` counts too. Whatever could add or change the value out of sight refuses, with
the reason: a parser handed to code outside this file (or built with ``parents=``), ``nargs``/``type``/an
action other than ``store``, a ``namespace=``, or ``args.opt_level``/``setattr``/``vars(args)`` writes.
"""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from ampinit.migrate import _cst
from ampinit.migrate._reach import Function, Scopes, declared_global

LEVELS = frozenset({"O0", "O1"})
PARSE = ("parse_args", "parse_known_args")
# add_argument keywords that do not change which values can arrive
HARMLESS = frozenset({"choices", "default", "dest", "help", "metavar", "required", "type", "action"})


def _string(node: cst.BaseExpression) -> str | None:
    return node.evaluated_value if isinstance(node, cst.SimpleString) else None  # type: ignore[return-value]


class _Calls(cst.CSTVisitor):
    def __init__(self) -> None:
        self.calls: list[cst.Call] = []
        self.returns: dict[str, list[cst.BaseExpression | None]] = {}  # module-level function -> its returns
        self.functions: set[str] = set()
        self.depth = 0
        self.current: str | None = None

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self.depth == 0:
            self.functions.add(node.name.value)
            self.current = node.name.value
        self.depth += 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.current = None

    def visit_Return(self, node: cst.Return) -> None:
        if self.current is not None:
            self.returns.setdefault(self.current, []).append(node.value)


def _is_parse(value: cst.BaseExpression, found: _Calls) -> str | None:
    """Why ``value`` is not the result of this file's argparse parse, or None when it is."""
    if not isinstance(value, cst.Call):
        return f"`{_cst.code(value)}` is not an argparse parse"
    if _cst.method_name(value) in PARSE:
        if _cst.keyword(value, "namespace") is not None:
            return "parse_args(namespace=...) starts from a namespace this file does not show"
        return None
    name = value.func.value if isinstance(value.func, cst.Name) else None
    if name is None or name not in found.functions:
        return f"`{_cst.code(value.func)}()` is not a function of this file that returns parse_args()"
    returns = found.returns.get(name, [])
    if not returns or any(
        r is None or _is_parse(r, found) is not None or _cst.method_name(r) != "parse_args" for r in returns
    ):
        return f"{name}() does not only return parser.parse_args()"
    return None


def _dest(call: cst.Call) -> str | None:
    """The destination argparse gives an ``add_argument`` call, or None when it cannot be read."""
    given = _cst.keyword(call, "dest")
    if given is not None:
        return _string(given)
    strings = [a.value for a in call.args if a.keyword is None]
    if any(a.star for a in call.args):
        return None
    names = [_string(s) for s in strings]
    if not names or any(n is None for n in names):
        return None
    options = [n for n in names if n is not None]
    if not options[0].startswith("-"):
        return options[0]
    long = next((o for o in options if o.startswith("--")), options[0])
    return long.lstrip("-").replace("-", "_")


def _argument_values(call: cst.Call) -> tuple[set[str] | None, str]:
    """The values one ``add_argument`` lets through, or None and why it could be any."""
    option = _cst.code(call.args[0].value) if call.args else "the argument"
    unknown = sorted({a.keyword.value for a in call.args if a.keyword is not None} - HARMLESS)
    if unknown:
        return None, f"{option} has {unknown[0]}=, which lets other values through"
    action = _cst.keyword(call, "action")
    if action is not None and _string(action) != "store":
        return None, f"{option} has action={_cst.code(action)}"
    kind = _cst.keyword(call, "type")
    if kind is not None and _cst.code(kind) != "str":
        return None, f"{option} has type={_cst.code(kind)}, which could turn a choice into another value"
    choices = _cst.keyword(call, "choices")
    if not isinstance(choices, (cst.List, cst.Tuple, cst.Set)):
        return None, f"{option} has no literal choices=, so it takes any level"
    allowed = {_string(e.value) for e in choices.elements}
    required = _cst.keyword(call, "required")
    default = _cst.keyword(call, "default")
    if default is None and not (isinstance(required, cst.Name) and required.value == "True"):
        return None, f"{option} has no default (None is no level)"
    if default is not None:
        allowed.add(_string(default))
    if None in allowed:
        return None, f"{option}'s choices or default are not all string literals"
    return {a for a in allowed if a is not None}, ""


def argparse_levels(
    module: cst.Module, scopes: Scopes, where: Function, node: cst.BaseExpression
) -> tuple[set[str] | None, str]:
    """The levels ``node`` (``args.opt_level``) can hold in ``where``, or None and why this file cannot tell."""
    if not isinstance(node, cst.Attribute) or not isinstance(node.value, cst.Name):
        return None, f"`{_cst.code(node)}` could hold any level"
    base, attr = node.value.value, node.attr.value
    found = _Calls()
    module.visit(found)
    binder = next((f for f in scopes.enclosing(where) if isinstance(f, cst.Module) or scopes.binds(f, base)), module)
    stores = [t for t in scopes.targets if _cst.code(t) == base and scopes.function_of(t) is binder]
    if not stores:
        owner = binder.name.value if isinstance(binder, cst.FunctionDef) else "<module>"
        text = _cst.code(node)
        return None, f"`{base}` is a parameter of {owner}(): where `{text}` comes from is not in this function"
    if len(stores) != 1:
        return None, f"`{base}` is assigned more than once"
    why = _parse_binding(scopes, stores[0], found)
    if why is not None:
        return None, f"`{_cst.code(node)}`: {why}, so it could hold any level"
    values, why = _destination_values(found.calls, attr, _cst.code(node))
    if values is None:
        return None, why
    why = _written(scopes, found.calls, base, attr) or _parsers_escape(module, found) or ""
    return (None, why) if why else (values, "")


def _parse_binding(scopes: Scopes, target: cst.BaseExpression, found: _Calls) -> str | None:
    parent = scopes.parents.get(target)
    if isinstance(parent, cst.Element):  # `args, unknown = parser.parse_known_args()`
        holder = scopes.parents.get(parent)
        if not isinstance(holder, cst.Tuple) or holder.elements[0] is not parent:
            return f"`{_cst.code(target)}` is not the namespace of a parse"
        parent = scopes.parents.get(holder)
        statement = scopes.parents.get(parent) if isinstance(parent, cst.AssignTarget) else None
        if not isinstance(statement, cst.Assign) or _cst.method_name(statement.value) != "parse_known_args":
            return f"`{_cst.code(target)}` is not the namespace of parse_known_args()"
        return _is_parse(statement.value, found)
    statement = scopes.parents.get(parent) if isinstance(parent, cst.AssignTarget) else None
    if not isinstance(statement, cst.Assign) or len(statement.targets) != 1:
        return f"`{_cst.code(target)}` is not bound by a plain assignment"
    if _cst.method_name(statement.value) == "parse_known_args":
        return "parse_known_args() returns a (namespace, rest) pair"
    return _is_parse(statement.value, found)


def _written(scopes: Scopes, calls: Iterable[cst.Call], base: str, attr: str) -> str | None:
    for target in scopes.targets:
        if _cst.code(target) == f"{base}.{attr}":
            return f"`{base}.{attr}` is assigned in this file: it may hold another level there"
        function = scopes.function_of(target)
        if isinstance(function, cst.FunctionDef) and _cst.code(target) == base and base in declared_global(function):
            return f"`{base}` is assigned through `global {base}` in {function.name.value}()"
    for call in calls:
        name = _cst.dotted(call.func)
        first = call.args[0].value if call.args else None
        if name in ("setattr", "vars") and isinstance(first, cst.Name) and first.value == base:
            shown = f"setattr({base}, ...)" if name == "setattr" else f"vars({base})"
            return f"{shown} may change `{base}.{attr}`"
    return None


_MAKERS = ("ArgumentParser", "add_argument_group", "add_mutually_exclusive_group", "add_subparsers", "add_parser")


def _parsers_escape(module: cst.Module, found: _Calls) -> str | None:
    """Why code outside this file could add arguments to its parsers, or None. Parsers are followed by name
    (over-approximated: a name that is a parser anywhere counts everywhere): the names bound to a parser or a
    group, and the parameters of this file's functions that receive one."""
    definitions = {n.name.value: n for n in module.body if isinstance(n, cst.FunctionDef)}
    parsers: set[str] = set()
    for statement in _assignments(module):
        if isinstance(statement.value, cst.Call) and (_cst.dotted(statement.value.func) or "").endswith(_MAKERS):
            if _cst.keyword(statement.value, "parents") is not None:
                return "an ArgumentParser built with parents= takes arguments defined elsewhere"
            parsers |= {_cst.code(t.target) for t in statement.targets}
    grown = True
    while grown:
        grown = False
        for call in found.calls:
            for index, arg in enumerate(call.args):
                if not (isinstance(arg.value, cst.Name) and arg.value.value in parsers):
                    continue
                callee = definitions.get(call.func.value) if isinstance(call.func, cst.Name) else None
                if callee is None:
                    return (
                        f"`{arg.value.value}` is handed to {_cst.code(call.func)}(), outside this file: it may add "
                        "another destination for the level"
                    )
                params = callee.params.params
                name = arg.keyword.value if arg.keyword is not None else None
                if name is None and index < len(params):
                    name = params[index].name.value
                if name is None:
                    return f"`{arg.value.value}` reaches {callee.name.value}() through *args"
                if name not in parsers:
                    parsers.add(name)
                    grown = True
    return None


class _Assignments(cst.CSTVisitor):
    def __init__(self) -> None:
        self.found: list[cst.Assign] = []

    def visit_Assign(self, node: cst.Assign) -> None:
        self.found.append(node)


def _assignments(module: cst.Module) -> list[cst.Assign]:
    visitor = _Assignments()
    module.visit(visitor)
    return visitor.found


def _destination_values(calls: Iterable[cst.Call], attr: str, expression: str) -> tuple[set[str] | None, str]:
    values: set[str] = set()
    matched = False
    for call in calls:
        method = _cst.method_name(call)
        if method == "set_defaults":
            if any(a.star for a in call.args):
                return None, "set_defaults(**...) may set any default"
            given = _cst.keyword(call, attr)
            if given is not None:
                value = _string(given)
                if value is None:
                    return None, f"set_defaults({attr}=...) is not a string literal"
                values.add(value)
            continue
        if method != "add_argument":
            continue
        dest = _dest(call)
        if dest is None:
            return None, f"an add_argument with computed names ({_cst.code(call)[:60]}) could define {expression}"
        if dest != attr:
            continue
        matched = True
        allowed, why = _argument_values(call)
        if allowed is None:
            return None, f"{expression}: {why}"
        values |= allowed
    if not matched:
        return None, f"no add_argument in this file defines {expression}"
    return values, ""
