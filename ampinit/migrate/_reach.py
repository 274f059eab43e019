"""``--to torch``: where the GradScaler lives, and whether the code that needs it can reach it.

``amp.initialize`` and the loop that uses amp (``scale_loss``, ``optimizer.step()``, ``master_params``,
``state_dict``, ``disable_casts``) are often in different functions of one file. Apex keeps its state in a
module global, so any function may use it; a GradScaler is an object that must be reachable by name where it is
used. Three homes make it so, each without changing what any function receives:

* ``module``: ``amp.initialize`` runs at module level; the GradScaler is a module-level name, which every function
  of the file reads (the fresh name is bound nowhere else);
* ``attribute``: ``amp.initialize`` runs in a method and binds ``self.<model>, self.<optimizer>``; the GradScaler
  is ``self.<scaler>``, which every method of the same class reads through its own ``self``;
* ``local``: it runs in a function; the GradScaler is a local of that function, which only functions nested in it
  can read.

A use elsewhere is refused with the reason. Wherever amp is used, the model and optimizer names must mean the
objects that ``amp.initialize`` returned: not rebound there (a parameter, a local), and not assigned again after
``amp.initialize`` anywhere in the file.

Apex raises when ``scale_loss``, ``state_dict``, ``load_state_dict`` or ``disable_casts`` run before
``initialize`` (reference §1, §9), so a path that reaches the GradScaler before it exists failed before the
migration too. With ``amp.initialize`` under ``if <flag>:`` a path with the flag off worked without amp; there
the function that creates the GradScaler must provably run first (``__init__``, or module level / the enclosing
function with nothing that could reach the loop called before it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import libcst as cst

from ampinit.migrate import _cst

Function = cst.FunctionDef | cst.Module


@dataclass(frozen=True)
class Home:
    """Where ``amp.initialize`` runs (``function``) and how the GradScaler is named for the whole file."""

    kind: Literal["module", "attribute", "local"]
    function: Function
    owner: str = ""  # the method's first parameter (``self``) for an attribute home

    def name(self, fresh: str) -> str:
        return f"{self.owner}.{fresh}" if self.kind == "attribute" else fresh

    def describe(self) -> str:
        if isinstance(self.function, cst.Module):
            return "module level"
        return f"{self.function.name.value}()"


class Scopes:
    """The functions of one module and what each binds, from the parents and assignment targets an analysis
    collected."""

    def __init__(self, parents: Mapping[cst.CSTNode, cst.CSTNode], assignments: Iterable[cst.BaseExpression]) -> None:
        self.parents = parents
        self.bound: dict[int, set[str]] = {}  # id(function) -> names it binds (params, targets)
        self.targets = list(assignments)
        for target in self.targets:
            function = self.function_of(target)
            if isinstance(target, cst.Name):
                self.bound.setdefault(id(function), set()).add(target.value)

    def function_of(self, node: cst.CSTNode) -> Function:
        return _cst.function_of(self.parents, node)

    def binds(self, function: Function, name: str) -> bool:
        if isinstance(function, cst.Module):
            return False
        params = function.params
        every = [*params.posonly_params, *params.params, *params.kwonly_params]
        every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
        return name in {p.name.value for p in every} or name in self.bound.get(id(function), set())

    def enclosing(self, function: Function) -> list[Function]:
        """``function`` and the functions around it, innermost first, up to the module."""
        out: list[Function] = [function]
        while not isinstance(out[-1], cst.Module):
            out.append(self.function_of(out[-1]))
        return out

    def class_of(self, function: Function) -> cst.ClassDef | None:
        """The class whose body defines ``function`` directly (a method), else None."""
        if isinstance(function, cst.Module):
            return None
        block = self.parents.get(function)
        owner = self.parents.get(block) if block is not None else None
        return owner if isinstance(owner, cst.ClassDef) else None


def first_param(function: Function) -> str | None:
    if isinstance(function, cst.Module):
        return None
    decorators = {_cst.dotted(d.decorator) for d in function.decorators}
    if decorators & {"staticmethod", "classmethod"} or not function.params.params:
        return None
    return function.params.params[0].name.value


def home_of(scopes: Scopes, init: cst.CSTNode, model: str, optimizer: str) -> Home:
    function = scopes.function_of(init)
    if isinstance(function, cst.Module):
        return Home("module", function)
    owner = first_param(function)
    if (
        owner is not None
        and scopes.class_of(function) is not None
        and all(name.startswith(f"{owner}.") for name in (model, optimizer))
    ):
        return Home("attribute", function, owner)
    return Home("local", function)


def unreachable(scopes: Scopes, home: Home, node: cst.CSTNode, model: str, optimizer: str) -> str | None:
    """Why the amp use at ``node`` could not reach the GradScaler (or the model and optimizer it must mean), or
    None when it can."""
    where = scopes.function_of(node)
    if where is home.function:
        return None
    name = "<module>" if isinstance(where, cst.Module) else f"{where.name.value}()"
    if home.kind == "attribute":
        if scopes.class_of(where) is not scopes.class_of(home.function) or first_param(where) != home.owner:
            return (
                f"{name} is not a method of the class whose {home.describe()} calls amp.initialize: it cannot reach "
                f"{home.owner}.<scaler>; pass a GradScaler there by hand, or use --to ampinit"
            )
        if home.owner in scopes.bound.get(id(where), set()):
            return f"{name} assigns `{home.owner}`: it may not be the object that holds the GradScaler"
        return None
    chain = scopes.enclosing(where)
    if home.function not in chain:
        return (
            f"the GradScaler would be a local of {home.describe()}, which {name} cannot reach: pass it there "
            "by hand (a parameter), or use --to ampinit"
        )
    inner = chain[: chain.index(home.function)]
    for base in sorted({dotted_base(model), dotted_base(optimizer)}):
        binder = next((f for f in inner if scopes.binds(f, base)), None)
        if binder is not None:
            bound = "<module>" if isinstance(binder, cst.Module) else f"{binder.name.value}()"
            return (
                f"`{base}` in {name} is {bound}'s own name (a parameter or a local), not the one amp.initialize "
                f"returned at {home.describe()}: it cannot be proven to be the initialized model/optimizer"
            )
    return None


def dotted_base(name: str) -> str:
    return name.split(".")[0]


def assigned_again(
    scopes: Scopes, home: Home, names: tuple[str, ...], after: int, line_of: Callable[[cst.CSTNode], int]
) -> str | None:
    """Why ``names`` (the model and optimizer amp.initialize returned) may mean other objects where amp is used
    in other functions: assigned again in the home function after line ``after``, or, for an attribute home, in
    another method of the class. None when they are not."""
    owner = scopes.class_of(home.function)
    for target in scopes.targets:
        code = _cst.code(target)
        if code not in names:
            continue
        function = scopes.function_of(target)
        later = function is home.function and line_of(target) > after
        elsewhere = (
            home.kind == "attribute"
            and function is not home.function
            and scopes.class_of(function) is owner
            and not set_before_home(scopes, home, target)
        )
        rebound = home.kind == "module" and function is not home.function and code in declared_global(function)
        if later or elsewhere or rebound:
            return (
                f"`{code}` is assigned again (line {line_of(target)}) after amp.initialize returned it: the "
                "functions that use amp could see another object"
            )
    return None


class _Globals(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Global(self, node: cst.Global) -> None:
        self.names.update(n.name.value for n in node.names)


def declared_global(function: Function) -> set[str]:
    """The names a function declares ``global`` (its assignments to them rebind the module's)."""
    if isinstance(function, cst.Module):
        return set()
    found = _Globals()
    function.visit(found)
    return found.names


class _Calls(cst.CSTVisitor):
    """The last name of every call (``f()``, ``self.f()``, ``C()``) under a node."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name):
            self.names.add(node.func.value)
        elif isinstance(node.func, cst.Attribute):
            self.names.add(node.func.attr.value)


def _called(node: cst.CSTNode) -> set[str]:
    calls = _Calls()
    node.visit(calls)
    return calls.names


class _Definitions(cst.CSTVisitor):
    """Every function and class of a module by name, with the names each calls (a class: its methods' calls, as
    calling it runs ``__init__``)."""

    def __init__(self) -> None:
        self.calls: dict[str, set[str]] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.calls.setdefault(node.name.value, set()).update(_called(node.body))

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.calls.setdefault(node.name.value, set()).update(_called(node.body))


def reaching(module: cst.Module, users: set[str]) -> set[str]:
    """The names of the functions in ``users`` and of every function or class of ``module`` that may call one of
    them, directly or not (by name: over-approximated, which only refuses more)."""
    definitions = _Definitions()
    module.visit(definitions)
    found = set(users)
    grown = True
    while grown:
        grown = False
        for name, calls in definitions.calls.items():
            if name not in found and calls & found:
                found.add(name)
                grown = True
    return found


class _Subclasses(cst.CSTVisitor):
    def __init__(self, base: str) -> None:
        self.base = base
        self.found: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if any(_cst.dotted(b.value) == self.base for b in node.bases):
            body = node.body.body if isinstance(node.body, cst.IndentedBlock) else []
            if any(isinstance(s, cst.FunctionDef) and s.name.value == "__init__" for s in body):
                self.found.append(node.name.value)


def _subclasses_with_init(module: cst.Module, base: str) -> list[str]:
    visitor = _Subclasses(base)
    module.visit(visitor)
    return visitor.found


def _listed(functions: set[str]) -> str:
    return ", ".join(f"{name}()" for name in sorted(functions))


class _SelfCalls(cst.CSTVisitor):
    """In ``__init__``, what could run a method of this instance: ``self.<method>()``, and ``self`` itself handed
    out (``register(self)``, ``super().__init__()``), after which any code may call back. ``self.model.train()``
    calls the model's method, not this object's."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.methods: set[str] = set()
        self.escapes: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == self.owner:
            self.methods.add(func.attr.value)
        if isinstance(func, cst.Name) and func.value == "super":
            self.escapes.append("super()")

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if not (isinstance(node.value, cst.Name) and node.value.value == self.owner):
            node.value.visit(self)  # `self.x` reads an attribute; `x.self` names one: neither hands `self` out
        return False

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == self.owner:
            self.escapes.append(f"`{self.owner}` itself")


def _reaches_self(statement: cst.CSTNode, owner: str, early: set[str]) -> str | None:
    calls = _SelfCalls(owner)
    statement.visit(calls)
    methods = sorted(calls.methods & early)
    if methods:
        return f"{owner}.{methods[0]}() is called"
    if calls.escapes:
        return f"{calls.escapes[0]} is handed to other code"
    return None


def _init_method(owner: cst.ClassDef) -> cst.FunctionDef | None:
    body = owner.body.body if isinstance(owner.body, cst.IndentedBlock) else []
    return next((s for s in body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)


def _is_init(function: Function) -> bool:
    return isinstance(function, cst.FunctionDef) and function.name.value == "__init__"


def set_before_home(scopes: Scopes, home: Home, target: cst.CSTNode) -> bool:
    """Whether ``target`` (an assignment) sits in the ``__init__`` of the class whose other method (a trainer's
    ``setup()``) calls amp.initialize, in a statement that runs before that method can: nothing in ``__init__``
    up to it calls a method that may reach the home method, or hands ``self`` out. ``__init__`` runs before any
    other method of its instance, so such an assignment is the value the home method starts from, not a change
    after it."""
    owner = scopes.class_of(home.function)
    if home.kind != "attribute" or owner is None or _is_init(home.function):
        return False
    init = _init_method(owner)
    if init is None or first_param(init) != home.owner or scopes.function_of(target) is not init:
        return False
    module = scopes.enclosing(init)[-1]
    assert isinstance(home.function, cst.FunctionDef) and isinstance(module, cst.Module)
    early = reaching(module, {home.function.name.value})
    for statement in init.body.body:
        if _reaches_self(statement, home.owner, early) is not None:
            return False
        if _holds(scopes, statement, target):
            return True
    return False


def _holds(scopes: Scopes, statement: cst.CSTNode, node: cst.CSTNode) -> bool:
    current: cst.CSTNode | None = node
    while current is not None and current is not statement:
        current = scopes.parents.get(current)
    return current is statement


class _Names(cst.CSTVisitor):
    """Every use of one name (not the names of definitions)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.count -= node.name.value == self.name  # visit_Name counts the definition's own name

    def visit_Name(self, node: cst.Name) -> None:
        self.count += node.value == self.name


def _uses(module: cst.Module, name: str) -> int:
    names = _Names(name)
    module.visit(names)
    return names.count


def _set_up_in_init(module: cst.Module, home: Home, owner: cst.ClassDef | None, users: set[str]) -> str | None:
    """A home method other than ``__init__`` (a trainer's ``setup()``) creates the GradScaler before any other
    method can run only where ``__init__`` calls it: once, as a statement of its own body, with nothing before
    that call that could reach the methods that use amp. Why not, or None."""
    assert isinstance(home.function, cst.FunctionDef)
    name = home.function.name.value
    refused = (
        f"amp.initialize sits under `if <flag>:` in {home.describe()}, and {_listed(users)} may run "
        "before it: with the flag off that worked without amp, after the rewrite it would find no GradScaler; "
        f"move amp.initialize to __init__ (or call {name}() once from __init__), or use --to ampinit"
    )
    init = _init_method(owner) if owner is not None else None
    if init is None or first_param(init) != home.owner:
        return refused
    call = f"{home.owner}.{name}()"
    calls = [
        s
        for s in init.body.body
        if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and _cst.code(s.body[0]) == call
    ]
    if len(calls) != 1:
        return refused
    if _uses(module, name) != 1:
        return (
            f"__init__() calls {name}(), whose `if <flag>:` creates the GradScaler, but {name} is named elsewhere "
            "in this file too: a second call would replace the GradScaler (and its scale) where Apex kept one "
            "amp state; rewrite by hand, or use --to ampinit"
        )
    early = reaching(module, users)
    for statement in init.body.body:
        if statement is calls[0]:
            return None
        why = _reaches_self(statement, home.owner, early)
        if why is not None:
            return (
                f"{why} in __init__() before it calls {name}(), whose `if <flag>:` creates the GradScaler, and "
                f"may reach {_listed(users)}: with the flag off that worked without amp, after the rewrite it "
                "would find no GradScaler"
            )
    return refused


def runs_first(
    module: cst.Module, home: Home, guard: cst.CSTNode, users: set[str], owner: cst.ClassDef | None = None
) -> str | None:
    """With ``amp.initialize`` under ``if <flag>:`` (``guard``), why the functions ``users`` that use amp might run
    before the GradScaler is created, or None. A flag-off path worked without amp before the migration; after
    it, it reads the GradScaler, so it must exist by then."""
    if home.kind == "attribute" and not _is_init(home.function):
        why = _set_up_in_init(module, home, owner, users)
        if why is not None:
            return why
    if home.kind == "attribute" and owner is not None:
        for subclass in _subclasses_with_init(module, owner.name.value):
            return (
                f"{subclass}, a subclass of {owner.name.value} in this file, defines its own __init__: where it "
                "does not run this one, the flag-off path would find no GradScaler"
            )
    statements = list(home.function.body if isinstance(home.function, cst.Module) else home.function.body.body)
    early = reaching(module, users)
    for statement in statements:
        if statement is guard:
            return None
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            continue
        if home.kind == "attribute":
            why = _reaches_self(statement, home.owner, early)
            if why is not None:
                return (
                    f"{why} before amp.initialize's `if <flag>:` in {home.describe()} and may reach "
                    f"{_listed(users)}: with the flag off that worked without amp, after the rewrite it would find "
                    "no GradScaler"
                )
            continue
        hit = sorted(_called(statement) & early)
        if hit:
            return (
                f"{hit[0]}() is called before amp.initialize's `if <flag>:` in {home.describe()} and may reach "
                f"{_listed(users)}: with the flag off that worked without amp, after the rewrite it "
                "would find no GradScaler"
            )
    return None


def same_binding(scopes: Scopes, home: Home, where: Function, name: str) -> bool:
    """Whether ``name`` read in ``where`` is the ``name`` that the home function reads: its own ``self`` in a
    method of the same class, a closure over the home function's local, or the module's name in both."""
    if home.kind == "attribute" and name == home.owner:
        return True
    chain = scopes.enclosing(where)
    if home.function in chain:
        return not any(scopes.binds(f, name) for f in chain[: chain.index(home.function)])
    return not scopes.binds(home.function, name) and not any(scopes.binds(f, name) for f in chain)
