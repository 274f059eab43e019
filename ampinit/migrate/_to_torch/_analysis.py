"""What a file does with amp, collected once: every amp use, step, backward, clipping, ``.grad``, import, ``if``
and assignment, and what follows from them (the one ``amp.initialize``: its options, model, optimizer, level,
the ``if <flag>:`` that guards it, where the GradScaler would live). No verdict here: the refusals
(:mod:`._refusals`) and the rewrite (:mod:`._rewrite`) both read these facts.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ampinit.compat.apex.amp import frontend as apex_frontend
from ampinit.compat.apex.amp import handle as apex_handle
from ampinit.migrate import _cst
from ampinit.migrate._argparse import argparse_levels
from ampinit.migrate._reach import Home, Scopes, home_of

# Apex's parameter names, in order, read from the Apex layer that reproduces its signatures (one source of truth).
# Apex's own parameters: the ampinit-only keywords the Apex layer also takes (keyword-only) are not Apex's.
APEX_SIGNATURE = tuple(
    name
    for name, parameter in inspect.signature(apex_frontend.initialize).parameters.items()
    if parameter.kind is not inspect.Parameter.KEYWORD_ONLY
)
SCALE_LOSS_SIGNATURE = tuple(inspect.signature(apex_handle.scale_loss).parameters)
NOT_LITERAL = object()

_GUARDS: dict[type, str] = {
    cst.If: "if",
    cst.Else: "else",
    cst.Try: "try",
    cst.ExceptHandler: "except",
    cst.Finally: "finally",
    cst.For: "for",
    cst.While: "while",
    cst.With: "with",
}


def call_args(call: cst.Call, signature: tuple[str, ...]) -> dict[str, cst.BaseExpression] | None:
    """Argument values by Apex parameter name; None if ``*args``/``**kwargs`` make that impossible."""
    found = _cst.arguments(call, signature)
    return None if found is None else {name: arg.value for name, arg in found.items()}


def literal(node: cst.BaseExpression | None) -> Any:
    """The value of a string, number, ``None``/``True``/``False``; :data:`NOT_LITERAL` for anything else."""
    if node is None:
        return None
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value
    if isinstance(node, cst.Name) and node.value in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[node.value]
    if isinstance(node, (cst.Integer, cst.Float)):
        return node.evaluated_value
    return NOT_LITERAL


def negates(test: cst.BaseExpression, flag: str) -> bool:
    negated = isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not)
    return negated and _cst.dotted(test.expression) == flag  # type: ignore[attr-defined]


def imports_amp(statement: cst.CSTNode) -> bool:
    """Whether an import statement binds ``apex.amp`` (``from apex import amp``, ``import apex.amp``), as opposed
    to another Apex name (``from apex import pyprof``), which the later ``--to torch`` pass reports by name."""
    if isinstance(statement, cst.ImportFrom) and not isinstance(statement.names, cst.ImportStar):
        return any(_cst.dotted(a.name) == "amp" for a in statement.names)
    return isinstance(statement, cst.Import) and any(_cst.dotted(a.name) == "apex.amp" for a in statement.names)


_MISSING = ("ImportError", "ModuleNotFoundError")


def availability_guard(node: cst.CSTNode, amp: str) -> bool:
    """``try: from apex import amp`` / ``except ImportError: amp = None`` (or ``pass``): the guard code written for
    machines without Apex. Its ``try`` body is the amp import alone, and each handler catches a failed import only
    and binds nothing but ``amp = None``; torch.amp cannot be missing, so the rewrite drops the whole statement."""
    if not isinstance(node, cst.Try) or node.orelse is not None or node.finalbody is not None:
        return False
    body = node.body.body
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or len(body[0].body) != 1:
        return False
    imported = body[0].body[0]
    if not isinstance(imported, (cst.Import, cst.ImportFrom)) or not imports_amp(imported):
        return False
    if len(imported.names) != 1:  # type: ignore[arg-type]
        return False
    return all(_fallback(handler, amp) for handler in node.handlers)


def _fallback(handler: cst.ExceptHandler, amp: str) -> bool:
    caught = handler.type
    if caught is None or handler.name is not None:
        return False
    names = [e.value for e in caught.elements] if isinstance(caught, cst.Tuple) else [caught]
    if not all(_cst.dotted(n) in _MISSING for n in names):
        return False
    for statement in handler.body.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            return False
        for small in statement.body:
            none = cst.Name("None")
            bound = isinstance(small, cst.Assign) and len(small.targets) == 1
            if isinstance(small, cst.Pass):
                continue
            if not (bound and _cst.code(small.targets[0].target) == amp and small.value.deep_equals(none)):  # type: ignore[attr-defined]
                return False
    return True


def prefixes(flag: str) -> set[str]:
    """``a.b.c`` -> {``a``, ``a.b``, ``a.b.c``}: assigning any of them may change the flag."""
    parts = flag.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


class _Collect(cst.CSTVisitor):
    """One pass over the file: the raw material of :class:`Analysis`."""

    def __init__(self, analysis: Analysis) -> None:
        self.analysis = analysis

    def visit_If(self, node: cst.If) -> None:
        self.analysis.ifs.append(node)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._assigned(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._assigned(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._assigned(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._assigned(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._assigned(node.name)

    def _assigned(self, target: cst.BaseExpression) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._assigned(element.value)
        elif isinstance(target, cst.StarredElement):
            self._assigned(target.value)
        else:
            self.analysis.assignments.append(target)

    def visit_Name(self, node: cst.Name) -> None:
        self.analysis.names.add(node.value)
        parent = self.analysis.parents.get(node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return  # `torch.cuda.amp`: an attribute, not the name
        if isinstance(parent, cst.Arg) and parent.keyword is node:
            return
        if node.value == self.analysis.amp:
            self.analysis.references += 1
            if not (isinstance(parent, cst.Attribute) and parent.value is node):
                self.analysis.bare.append(node)

    def visit_Try(self, node: cst.Try) -> None:
        if availability_guard(node, self.analysis.amp):
            self.analysis.guards.append(node)

    def visit_Import(self, node: cst.Import) -> bool:
        if any(_cst.dotted(a.name) in ("apex", "apex.amp") for a in node.names):
            self.analysis.imports.append(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.module is not None and not node.relative and _cst.dotted(node.module) == "apex":
            self.analysis.imports.append(node)
        return False

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value == self.analysis.amp:
            self.analysis.uses.append((node.attr.value, node))

    def visit_Call(self, node: cst.Call) -> None:
        name = _cst.method_name(node)
        if name == "step":
            self.analysis.steps.append(node)
        if name == "backward":
            self.analysis.backwards.append(node)
        self.analysis.calls.append(node)

    def leave_Attribute(self, original_node: cst.Attribute) -> None:
        if original_node.attr.value == "grad":
            self.analysis.grads.append(original_node)


class Analysis:
    """The facts about one file's amp (``amp`` is the local name of ``apex.amp``). With other than one
    ``amp.initialize`` only the collected nodes are filled in: nothing follows from them."""

    def __init__(self, wrapper: MetadataWrapper, amp: str) -> None:
        self.amp = amp
        self.module = wrapper.module
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.positions = wrapper.resolve(PositionProvider)
        self.uses: list[tuple[str, cst.Attribute]] = []  # (attribute name, node) of every `amp.<name>`
        self.steps: list[cst.Call] = []  # every `<x>.step(...)`
        self.backwards: list[cst.Call] = []
        self.calls: list[cst.Call] = []
        self.grads: list[cst.Attribute] = []  # `p.grad`: read or changed between scale_loss and step
        self.imports: list[cst.Import | cst.ImportFrom] = []  # of apex / apex.amp
        self.ifs: list[cst.If] = []
        self.assignments: list[cst.BaseExpression] = []  # every assignment target, to prove a flag stable
        self.references = 0  # uses of the amp name outside its imports
        self.bare: list[cst.Name] = []  # the amp name used as an object (`amp is None`, `{"amp": amp}`)
        self.guards: list[cst.Try] = []  # the availability guards around the amp import (availability_guard)
        self.names: set[str] = set()  # every name in the file, to pick fresh ones
        # what follows from the one amp.initialize
        self.inits: list[cst.Attribute] = []
        self.init: cst.Attribute | None = None
        self.init_call: cst.Call | None = None
        self.init_args: dict[str, cst.BaseExpression] | None = None  # read statically: one model, one optimizer
        self.init_function: cst.CSTNode | None = None
        self.model = ""
        self.model_list = False  # the model given is a variable last bound to a list of models (see _is_a_list)
        self.optimizer = ""
        self.level = "O1"
        self.level_value: Any = "O1"  # the literal opt_level, or NOT_LITERAL (with level_why)
        self.level_why = ""
        self.level_switch: str | None = None  # `level == "O1"` when opt_level is a variable that holds O0 or O1
        self.enabled: str | None = None  # Apex's enabled= argument
        self.scopes: Scopes | None = None
        self.home: Home | None = None  # where the GradScaler lives (see ampinit.migrate._reach)
        # amp.initialize under `if <flag>:` (Tacotron2's `if hparams.fp16_run:`): the GradScaler is created before
        # that `if` with enabled=<flag>, so the same calls are right on both paths
        self.flag: str | None = None  # the test of a plain `if` right around amp.initialize
        self.flag_if: cst.If | None = None
        self.flag_changes: list[str] = []  # assignments to the flag after that `if`, in its function
        self.condition: str | None = None
        self.guard_if: cst.If | None = None
        self.enabled_bodies: set[int] = set()  # blocks that run only when the condition holds
        self.disabled_bodies: set[int] = set()  # blocks that run only when it does not
        self.scale_loss: dict[int, tuple[cst.Call, cst.With, dict[str, cst.BaseExpression]]] = {}
        self.scale_blocks: list[cst.With] = []  # the scale_loss blocks the rewrite understands
        self.optimizer_steps: list[cst.Call] = []  # the steps of the initialized optimizer
        self.refused: dict[int, set[str]] = {}  # id(node) -> the refusals found for it (see _refusals.run)
        wrapper.module.visit(_Collect(self))
        self.inits = [node for name, node in self.uses if name == "initialize"]
        if len(self.inits) == 1:
            self._initialized(self.inits[0])

    # -- where a node is ---------------------------------------------------------------------------------------------
    def line(self, node: cst.CSTNode) -> int:
        return 1 if isinstance(node, cst.Module) else _cst.line(self.positions, node)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode:
        return self.parents[node]

    def function_of(self, node: cst.CSTNode) -> cst.CSTNode:
        return _cst.function_of(self.parents, node)

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        return _cst.statement_of(self.parents, node)

    def blocks(self, node: cst.CSTNode) -> list[int]:
        """The blocks that hold ``node``, innermost first, up to its function's body: one path through the code."""
        out: list[int] = []
        current: cst.CSTNode | None = self.parents.get(node)
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            if isinstance(current, cst.IndentedBlock):
                out.append(id(current))
            current = self.parents.get(current)
        return out

    def path(self, node: cst.CSTNode) -> list[int]:
        """:meth:`blocks` on the path where amp is enabled: the bodies of `if <condition>:` are always entered, and
        so are those of `with` statements (``with Nvtx("backward"):``), which the path does not branch on."""
        return [b for b in self.blocks(node) if b not in self.enabled_bodies and b not in self._with_bodies]

    @functools.cached_property
    def _with_bodies(self) -> set[int]:
        return {id(n.body) for n in self.parents if isinstance(n, cst.With)}

    def guard(self, node: cst.CSTNode) -> str | None:
        """The compound statement under which ``node`` runs only on some paths (``if``, ``try``, ``for``...), if any:
        ``None`` when it sits directly in its function's body (or the module's)."""
        current: cst.CSTNode | None = self.parents.get(node)
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            if isinstance(current, tuple(_GUARDS)):
                return _GUARDS[type(current)]
            current = self.parents.get(current)
        return None

    def alone_on_its_line(self, node: cst.CSTNode) -> bool:
        """Whether ``node``'s statement is a line of its own: a ``SimpleStatementLine`` with one statement. The
        rewrite inserts statements around such lines only; on ``a; b`` or ``if c: a`` it would leave them
        unrewritten."""
        statement = self.statement_of(node)
        return isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1

    def in_scale_loss_block(self, node: cst.CSTNode) -> bool:
        current: cst.CSTNode | None = self.parents.get(node)
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            if isinstance(current, cst.With) and any(
                _cst.method_call(i.item, self.amp, "scale_loss") for i in current.items
            ):
                return True
            current = self.parents.get(current)
        return False

    def after_a_block_before_a_step(self, node: cst.CSTNode, steps: list[cst.Call]) -> bool:
        """Whether ``node`` comes after a scale_loss block and before one of ``steps``, in one function: where Apex
        has unscaled the gradients (and updated the scale) and a GradScaler has not yet."""
        line, function = self.line(node), self.function_of(node)
        after_block = any(
            self.function_of(b) is function and self.positions[b].end.line < line for b in self.scale_blocks
        )
        return after_block and any(self.function_of(s) is function and self.line(s) > line for s in steps)

    # -- what follows from the one amp.initialize --------------------------------------------------------------------
    @property
    def enabled_expression(self) -> str | None:
        """What turns the GradScaler and autocast on: the guarding condition, Apex's ``enabled=``, and an
        ``opt_level`` variable that is O1 or O0."""
        parts = [p for p in (self.condition, self.enabled, self.level_switch) if p is not None]
        if not parts or parts == [self.enabled]:
            return self.enabled
        return f"bool({' and '.join(parts)})"

    def _initialized(self, init: cst.Attribute) -> None:
        self.init = init
        self._read_initialize(init)
        self.init_function = self.function_of(init)
        self.scopes = Scopes(self.parents, self.assignments)
        self.home = home_of(self.scopes, init, self.model, self.optimizer)
        self._read_flag(init)
        self.optimizer_steps = [
            s for s in self.steps if isinstance(s.func, cst.Attribute) and _cst.dotted(s.func.value) == self.optimizer
        ]
        for name, node in self.uses:
            if name == "scale_loss":
                self._read_scale_loss(node)

    def _read_initialize(self, attribute: cst.Attribute) -> None:
        call = self.parent(attribute)
        if not isinstance(call, cst.Call):
            return
        self.init_call = call
        args = call_args(call, APEX_SIGNATURE)
        if args is None:
            return
        models, optimizers = args.get("models"), args.get("optimizers")
        if not isinstance(models, (cst.Name, cst.Attribute)) or not isinstance(optimizers, (cst.Name, cst.Attribute)):
            return
        self.init_args = args
        level = literal(args.get("opt_level")) if "opt_level" in args else "O1"
        if level is NOT_LITERAL:
            level, self.level_why = self._variable_level(call, args["opt_level"])
        self.level_value = level
        self.level = level if isinstance(level, str) else "O1"
        if "enabled" in args:
            self.enabled = _boolean_code(args["enabled"])
        self.optimizer = _cst.code(optimizers)
        self.model = _cst.code(models)
        self.model_list = self._is_a_list(call, self.model)
        statement = self.parent(call)
        if isinstance(statement, cst.Assign):
            target = statement.targets[0].target
            if isinstance(target, cst.Tuple) and len(target.elements) == 2:
                self.model, self.optimizer = (_cst.code(e.value) for e in target.elements)

    def _is_a_list(self, call: cst.Call, name: str) -> bool:
        """Whether ``name`` (amp.initialize's models) was last bound, before the call in its function, to a list
        display or comprehension: Apex takes a list of models, and the GradScaler's device is then the first
        one's (a list has no ``.parameters()``)."""
        function, line = self.function_of(call), self.line(call)
        stores = [
            t
            for t in self.assignments
            if _cst.code(t) == name and self.function_of(t) is function and self.line(t) < line
        ]
        if not stores:
            return False
        target = self.parent(max(stores, key=self.line))
        assign = self.parent(target) if isinstance(target, cst.AssignTarget) else None
        return isinstance(assign, cst.Assign) and isinstance(assign.value, (cst.List, cst.ListComp))

    def _variable_level(self, call: cst.Call, node: cst.BaseExpression) -> tuple[Any, str]:
        """The level an ``opt_level`` expression holds at ``amp.initialize``, and why not when it cannot be known:
        a variable the function assigns once, before the call, from literals (``level = 'O1' if fp16 else 'O0'``)
        or from argparse, or argparse's ``args.opt_level`` itself (:mod:`ampinit.migrate._argparse`). That literal,
        or ``"O1"`` with the GradScaler switched by ``<expression> == "O1"`` when it can be O0 or O1;
        ``NOT_LITERAL`` otherwise."""
        function = self.function_of(call)
        values: set[Any] | None = None
        why = ""
        source = node
        if isinstance(node, cst.Name) and node.value in _parameters(function):
            assert isinstance(function, cst.FunctionDef)
            return (
                NOT_LITERAL,
                f"`{node.value}` is a parameter of {function.name.value}(): its callers may pass any level",
            )
        if isinstance(node, cst.Name):
            stores = [t for t in self.assignments if _cst.code(t) == node.value and self.function_of(t) is function]
            if len(stores) != 1 or self.line(stores[0]) >= self.line(call):
                return NOT_LITERAL, f"`{node.value}` is not assigned once in this function before amp.initialize"
            target = self.parent(stores[0])
            assign = self.parent(target) if isinstance(target, cst.AssignTarget) else None
            if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
                return NOT_LITERAL, f"`{node.value}` is not bound by a plain assignment"
            values = _literal_choices(assign.value)
            source = assign.value
        if values is None and isinstance(source, cst.Attribute):
            scopes = Scopes(self.parents, self.assignments)
            found, why = argparse_levels(self.module, scopes, scopes.function_of(call), source)
            values = set(found) if found is not None else None
        if values is None and not why:
            why = (
                f"`{_cst.code(source)}` is neither a literal nor an argparse value (a config?): it could hold any level"
            )
        if values is None or not values <= {"O0", "O1"}:
            return NOT_LITERAL, why or f"`{_cst.code(source)}` could hold {sorted(map(str, values or ()))}"
        if len(values) == 1:
            return next(iter(values)), ""
        self.level_switch = f'{_cst.code(node)} == "O1"'
        return "O1", ""

    def _read_flag(self, init: cst.Attribute) -> None:
        """``amp.initialize`` directly under a plain `if <flag>:` (no `else`, in its function's body): the flag,
        and whether the function assigns it afterwards. A flag that holds gives the enabled and disabled bodies."""
        if self.guard(init) is None:
            return
        block = self.parent(self.statement_of(init))
        guard_if = self.parent(block)
        flag = _cst.dotted(guard_if.test) if isinstance(guard_if, cst.If) else None
        if not (
            isinstance(guard_if, cst.If)
            and block is guard_if.body
            and guard_if.orelse is None
            and self.guard(guard_if) is None
            and flag is not None
        ):
            return
        self.flag, self.flag_if = flag, guard_if
        start = self.line(guard_if)
        self.flag_changes = [
            _cst.code(target)
            for target in self.assignments
            if _cst.code(target) in prefixes(flag)
            and self.line(target) > start
            and self.function_of(target) is self.init_function
        ]
        if self.flag_changes:
            return
        self.condition, self.guard_if = flag, guard_if
        for node in self.ifs:  # other functions' ifs count once the refusals prove the flag is the same there
            if _cst.dotted(node.test) == flag:
                self.enabled_bodies.add(id(node.body))
                if isinstance(node.orelse, cst.Else):
                    self.disabled_bodies.add(id(node.orelse.body))
            elif negates(node.test, flag):
                self.disabled_bodies.add(id(node.body))

    def _read_scale_loss(self, attribute: cst.Attribute) -> None:
        """A ``with amp.scale_loss(loss, ...) as name:`` block with its body on lines of their own and arguments
        that can be read: the one shape the rewrite understands (see the ``scale_loss_*`` refusals)."""
        call = self.parent(attribute)
        item = self.parent(call) if isinstance(call, cst.Call) else None
        block = self.parent(item) if isinstance(item, cst.WithItem) else None
        if not isinstance(call, cst.Call) or not isinstance(block, cst.With) or len(block.items) != 1:
            return
        if not isinstance(item, cst.WithItem) or item.asname is None or not isinstance(item.asname.name, cst.Name):
            return
        args = call_args(call, SCALE_LOSS_SIGNATURE)
        if not isinstance(block.body, cst.IndentedBlock) or args is None or "loss" not in args:
            return
        self.scale_loss[id(attribute)] = (call, block, args)
        self.scale_blocks.append(block)


def _parameters(function: cst.CSTNode) -> set[str]:
    if not isinstance(function, cst.FunctionDef):
        return set()
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    return {p.name.value for p in every}


def _literal_choices(node: cst.BaseExpression) -> set[Any] | None:
    if isinstance(node, cst.IfExp):
        body, orelse = _literal_choices(node.body), _literal_choices(node.orelse)
        return None if body is None or orelse is None else body | orelse
    value = literal(node)
    return None if value is NOT_LITERAL else {value}


def _boolean_code(node: cst.BaseExpression) -> str:
    """Apex's ``enabled=`` as a bool: Apex only tested its truth (``if not enabled:``), so real code passes an int
    (``enabled=args.fp16``), ``None`` or a string, but ``torch.autocast`` takes a bool only (it raises
    ``TypeError`` on an int), and a GradScaler's ``is_enabled()`` hands the value on as given."""
    code = _cst.code(node)
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return code
    if isinstance(node, cst.Comparison):
        return code
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        return code
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "bool":
        return code
    return f"bool({code})"
