"""``--to torch``: O0/O1 code with one model, one optimizer and one loss, rewritten to native torch.amp.

``amp.initialize`` becomes a ``torch.amp.GradScaler``; the forward pass and loss (the statements just before
each ``scale_loss`` block, back to the last ``zero_grad``/``step``) go under ``torch.autocast``; the
``scale_loss`` block becomes ``scaler.scale(loss).backward()``; ``optimizer.step()`` becomes
``scaler.step(optimizer); scaler.update()``; clipping ``amp.master_params(optimizer)`` becomes
``scaler.unscale_(optimizer)`` and clipping the optimizer's parameters; ``amp.state_dict()`` becomes
``scaler.state_dict()`` and ``amp.load_state_dict(s)`` loads either format through a function written into the file.

``amp.initialize`` directly under ``if <flag>:``, or with an ``opt_level`` variable (or argparse value, see
:mod:`ampinit.migrate._argparse`) that holds O0 or O1, gets a GradScaler created on every path with ``enabled=``
that flag (a disabled GradScaler is a pass-through, so the same calls are right on both paths). The loop may sit in
another function or method of the file where the GradScaler is reachable (:mod:`ampinit.migrate._reach`).
Helper modules that only use ``float_function``/``disable_casts``, and an unused amp import, are handled by
:mod:`ampinit.migrate._helper_modules` and here.

Anything without a native equivalent is refused with a reason per site (O2/O3 master weights or half models,
several models, optimizers or losses, ``delay_unscale``, static loss scales, loss-scale bounds, Apex internals),
and then the file is left unchanged: ``--to ampinit`` handles it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ampinit.compat.apex.amp import frontend as apex_frontend
from ampinit.compat.apex.amp import handle as apex_handle
from ampinit.migrate._argparse import argparse_levels
from ampinit.migrate._helper_modules import GRAD_SCALER_STATE, HELPER_USES, add_definitions, migrate_helper_module
from ampinit.migrate._reach import (
    Home,
    Scopes,
    assigned_again,
    declared_global,
    home_of,
    runs_first,
    same_binding,
    unreachable,
)
from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import add_comments, apex_bindings, dotted

Block = cst.Module | cst.IndentedBlock
CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_")
# Apex's parameter names, in order, read from the Apex layer that reproduces its signatures (one source of truth).
APEX_SIGNATURE = tuple(inspect.signature(apex_frontend.initialize).parameters)
SCALE_LOSS_SIGNATURE = tuple(inspect.signature(apex_handle.scale_loss).parameters)
NO_NATIVE = {
    "cast_model_type": "cast_model_type casts the model's weights (O2/O3): torch.amp has no half model",
    "patch_torch_functions": "patch_torch_functions is O1's switch: keep the default",
    "keep_batchnorm_fp32": "keep_batchnorm_fp32 describes a cast model (O2/O3): no native equivalent",
    "master_weights": "fp32 master weights (O2) have no native equivalent",
    "cast_model_outputs": "cast_model_outputs has no native equivalent: cast the outputs by hand",
    "min_loss_scale": "GradScaler has no loss-scale floor",
    "max_loss_scale": "GradScaler has no loss-scale ceiling",
}


def _call_args(call: cst.Call, signature: tuple[str, ...]) -> dict[str, cst.BaseExpression] | None:
    """Arguments by Apex parameter name; None if ``*args``/``**kwargs`` make that impossible."""
    found: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is not None:
            found[arg.keyword.value] = arg.value
        elif index < len(signature):
            found[signature[index]] = arg.value
    return found


def _literal(node: cst.BaseExpression | None) -> Any:
    if node is None:
        return None
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value
    if isinstance(node, cst.Name) and node.value in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[node.value]
    if isinstance(node, (cst.Integer, cst.Float)):
        return node.evaluated_value
    return _NOT_LITERAL


_NOT_LITERAL = object()


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


@dataclass
class _Plan:
    amp: str
    model: str = ""
    optimizer: str = ""
    level: str = "O1"
    enabled: str | None = None
    init_function: cst.CSTNode | None = None
    home: Home | None = None  # where the GradScaler lives (see ampinit.migrate._reach)
    shared: bool = False  # amp is used in other functions than amp.initialize's
    refusals: list[Site] = field(default_factory=list)
    notes: list[Site] = field(default_factory=list)
    # (id of block, first index, last index) of the statements to run under autocast
    autocast: list[tuple[int, int, int]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    # amp.initialize under `if <condition>:` (Tacotron2's `if hparams.fp16_run:`): the GradScaler is created before
    # that `if` with enabled=<condition>, so the same calls are right on both paths
    condition: str | None = None
    level_switch: str | None = None  # `level == "O1"` when opt_level is a variable that holds O0 or O1
    guard_if: cst.If | None = None
    loads_state: int = 0  # the line of amp.load_state_dict: checkpoints of either format go through a helper
    scale_reads: list[int] = field(default_factory=list)  # lines of amp._amp_state.loss_scalers[0].loss_scale()
    enabled_bodies: set[int] = field(default_factory=set)  # blocks that run only when the condition holds
    disabled_bodies: set[int] = field(default_factory=set)  # blocks that run only when it does not

    @property
    def enabled_expression(self) -> str | None:
        """What turns the GradScaler and autocast on: the guarding condition, Apex's ``enabled=``, and an
        ``opt_level`` variable that is O1 or O0."""
        parts = [p for p in (self.condition, self.enabled, self.level_switch) if p is not None]
        if not parts or parts == [self.enabled]:
            return self.enabled
        return f"bool({' and '.join(parts)})"


class _Analysis(cst.CSTVisitor):
    def __init__(self, plan: _Plan, wrapper: MetadataWrapper) -> None:
        self.plan = plan
        self.module = wrapper.module
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.positions = wrapper.resolve(PositionProvider)
        self.init_calls: list[cst.Call] = []
        self.scale_blocks: list[cst.With] = []
        self.uses: list[tuple[str, cst.Attribute]] = []
        self.steps: list[cst.Call] = []
        self.backwards: list[cst.Call] = []
        self.calls: list[cst.Call] = []
        self.grads: list[cst.Attribute] = []  # `p.grad`: read or changed between scale_loss and step, see below
        self.imports: list[cst.CSTNode] = []
        self.ifs: list[cst.If] = []
        self.assignments: list[cst.BaseExpression] = []  # every assignment target, to prove a flag stable
        self.references = 0  # uses of the amp name outside its imports

    def visit_If(self, node: cst.If) -> None:
        self.ifs.append(node)

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
            self.assignments.append(target)

    def line(self, node: cst.CSTNode) -> int:
        return int(self.positions[node].start.line)

    def refuse(self, node: cst.CSTNode, reason: str) -> None:
        self.plan.refusals.append(Site(self.line(node), reason, needs_human=True))

    def parent(self, node: cst.CSTNode) -> cst.CSTNode:
        return self.parents[node]

    def function_of(self, node: cst.CSTNode) -> cst.CSTNode | None:
        current: cst.CSTNode | None = node
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            current = self.parents.get(current)
        return current

    def visit_Name(self, node: cst.Name) -> None:
        self.plan.names.add(node.value)
        parent = self.parents.get(node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return  # `torch.cuda.amp`: an attribute, not the name
        if isinstance(parent, cst.Arg) and parent.keyword is node:
            return
        if node.value == self.plan.amp:
            self.references += 1

    def path(self, node: cst.CSTNode) -> list[int]:
        """:meth:`blocks` on the path where amp is enabled: the bodies of `if <condition>:` are always entered."""
        return [b for b in self.blocks(node) if b not in self.plan.enabled_bodies]

    def blocks(self, node: cst.CSTNode) -> list[int]:
        """The blocks that hold ``node``, innermost first, up to its function's body: one path through the code."""
        out: list[int] = []
        current: cst.CSTNode | None = self.parents.get(node)
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            if isinstance(current, cst.IndentedBlock):
                out.append(id(current))
            current = self.parents.get(current)
        return out

    def guard(self, node: cst.CSTNode) -> str | None:
        """The compound statement under which ``node`` runs only on some paths (``if``, ``try``, ``for``...), if any:
        ``None`` when it sits directly in its function's body (or the module's)."""
        current: cst.CSTNode | None = self.parents.get(node)
        while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
            if isinstance(current, tuple(_GUARDS)):
                return _GUARDS[type(current)]
            current = self.parents.get(current)
        return None

    def visit_Import(self, node: cst.Import) -> bool:
        if any(dotted(a.name) in ("apex", "apex.amp") for a in node.names):
            self.imports.append(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.module is not None and not node.relative and dotted(node.module) == "apex":
            self.imports.append(node)
        return False

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value == self.plan.amp:
            self.uses.append((node.attr.value, node))

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "step":
            self.steps.append(node)
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "backward":
            self.backwards.append(node)
        self.calls.append(node)

    def leave_Attribute(self, original_node: cst.Attribute) -> None:
        if original_node.attr.value == "grad":
            self.grads.append(original_node)


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


def _analyse(wrapper: MetadataWrapper, amp_local: str) -> tuple[_Plan, _Analysis]:
    plan = _Plan(amp_local)
    analysis = _Analysis(plan, wrapper)
    wrapper.module.visit(analysis)
    inits = [node for name, node in analysis.uses if name == "initialize"]
    if len(inits) != 1:
        if inits:
            analysis.refuse(
                inits[1], "amp.initialize is called more than once: one GradScaler per call is a human's call"
            )
        else:
            plan.refusals.append(Site(1, "no amp.initialize call found", needs_human=True))
        return plan, analysis
    _check_initialize(analysis, inits[0])
    plan.init_function = analysis.function_of(inits[0])
    scopes = Scopes(analysis.parents, analysis.assignments)
    plan.home = home = home_of(scopes, inits[0], plan.model, plan.optimizer)
    _check_init_guard(analysis, inits[0])
    _check_imports(analysis)
    elsewhere = _check_uses(analysis, scopes, home)  # amp uses and steps in other functions than initialize's
    steps = _check_steps(analysis, scopes, home, elsewhere)
    if elsewhere:
        _check_elsewhere(analysis, scopes, inits[0], elsewhere)
    _check_paths(analysis, inits[0], steps)
    _check_other_clipping(analysis, steps)
    _check_gradients_by_hand(analysis, steps)
    _check_one_unscale(analysis)
    _check_unscale_then_step(analysis, steps)
    return plan, analysis


def _check_unscale_then_step(analysis: _Analysis, steps: list[cst.Call]) -> None:
    """The ``scaler.unscale_(optimizer)`` put before an ``amp.master_params`` clipping must be followed by
    ``scaler.step()``/``update()`` whenever it runs: a clipping on every micro-batch with a step every second one
    would call ``unscale_`` twice before ``update()``, which GradScaler refuses. So a step must come after it in the
    same block (the bodies of amp's `if <flag>:` count as that block). Checked last, only in a file not refused
    for another reason: it over-refuses a step in another branch of the same path."""
    if analysis.plan.refusals:
        return
    for name, node in analysis.uses:
        if name != "master_params":
            continue
        function, line, path = analysis.function_of(node), analysis.line(node), analysis.path(node)
        if not any(
            analysis.function_of(s) is function and analysis.line(s) > line and analysis.path(s) == path for s in steps
        ):
            analysis.refuse(
                node,
                "amp.master_params clipped where no optimizer.step() of the same block follows (gradient "
                "accumulation?): the scaler.unscale_(optimizer) put before it would run again before update(), "
                "which GradScaler refuses; clip only on stepping iterations, by hand",
            )
            return


def _check_one_unscale(analysis: _Analysis) -> None:
    """Each ``amp.master_params`` clipping gets a ``scaler.unscale_(optimizer)`` before it, and GradScaler raises
    on a second ``unscale_`` before ``update()``: more than one in a function (a norm measured, then a clip) is
    refused."""
    seen: set[int] = set()
    for name, node in analysis.uses:
        if name != "master_params":
            continue
        function = id(analysis.function_of(node))
        if function in seen:
            analysis.refuse(
                node,
                "amp.master_params clipped twice in one function: each would get a scaler.unscale_(optimizer), "
                "and GradScaler raises on the second before update(); keep one unscale_ by hand",
            )
            return
        seen.add(function)


def _check_imports(analysis: _Analysis) -> None:
    for statement in analysis.imports:
        guard = analysis.guard(statement)
        if guard is not None and not _in_guard_if(analysis, statement) and not _in_enabled_body(analysis, statement):
            analysis.refuse(
                statement,
                f"the Apex import sits under `{guard}` (an availability guard or a switch): after the rewrite the "
                "import could not fail or be skipped any more, so the code's other path would change; rewrite the "
                "guard by hand, or use --to ampinit",
            )


def _check_uses(analysis: _Analysis, scopes: Scopes, home: Home) -> list[cst.CSTNode]:
    """Check every amp use but ``initialize``; return those outside ``initialize``'s function that need the scaler."""
    plan = analysis.plan
    elsewhere: list[cst.CSTNode] = []
    for name, node in analysis.uses:
        if name == "initialize":
            continue
        if name in _NEED_THE_SCALER:
            reason = unreachable(scopes, home, node, plan.model, plan.optimizer)
            if reason is not None:
                analysis.refuse(node, f"amp.{name}: {reason}")
            elif analysis.function_of(node) is not plan.init_function:
                elsewhere.append(node)
        handler = _USE_CHECKS.get(name)
        if handler is None:
            analysis.refuse(node, f"amp.{name} has no native torch.amp equivalent")
        else:
            handler(analysis, node)
    return elsewhere


def _check_steps(analysis: _Analysis, scopes: Scopes, home: Home, elsewhere: list[cst.CSTNode]) -> list[cst.Call]:
    """The optimizer's ``step()`` calls, checked; those outside ``initialize``'s function join ``elsewhere``."""
    plan = analysis.plan
    steps = [s for s in analysis.steps if isinstance(s.func, cst.Attribute) and dotted(s.func.value) == plan.optimizer]
    if not steps and plan.optimizer:
        plan.refusals.append(Site(1, f"no {plan.optimizer}.step() found to route through scaler.step()", True))
    for step in steps:
        reason = unreachable(scopes, home, step, plan.model, plan.optimizer)
        if step.args:
            analysis.refuse(step, "optimizer.step(closure): GradScaler.step with a closure is not supported")
        elif not isinstance(analysis.parent(step), (cst.Expr, cst.Assign)):
            analysis.refuse(step, "optimizer.step() inside an expression: rewrite to scaler.step(...) by hand")
        elif not _alone_on_its_line(analysis, step):
            analysis.refuse(step, f"optimizer.step() {_NOT_ALONE}: rewrite to scaler.step(...) by hand")
        elif _in_scale_loss_block(analysis, step):
            analysis.refuse(
                step,
                "optimizer.step() inside the scale_loss block: Apex unscales when the block exits, so this step ran "
                "on the scaled gradients; scaler.step() would unscale them first; move the step after the block "
                "by hand (that changes the training), or use --to ampinit",
            )
        elif reason is not None:
            analysis.refuse(step, f"optimizer.step(): {reason}")
        elif analysis.function_of(step) is not plan.init_function:
            elsewhere.append(step)
    return steps


def _check_elsewhere(analysis: _Analysis, scopes: Scopes, init: cst.Attribute, uses: list[cst.CSTNode]) -> None:
    """amp used in other functions than amp.initialize's: they must mean the objects it returned, and with
    amp.initialize under `if <flag>:`, the GradScaler must exist before any of them can run."""
    plan = analysis.plan
    assert plan.home is not None
    plan.shared = True
    statement = _statement_of(analysis, init)
    owner = scopes.class_of(plan.home.function)
    if plan.home.kind == "attribute" and owner is not None and "__slots__" in _class_names(owner):
        analysis.refuse(
            statement,
            f"{owner.name.value} defines __slots__: the GradScaler cannot be kept as an attribute of its instances",
        )
    again = assigned_again(scopes, plan.home, (plan.model, plan.optimizer), analysis.line(statement), analysis.line)
    if again is not None:
        analysis.refuse(statement, again)
    if plan.condition is not None:
        _check_flag_elsewhere(analysis, scopes, plan.condition, uses)
    if plan.guard_if is not None:
        users = {f.name.value for f in (scopes.function_of(u) for u in uses) if isinstance(f, cst.FunctionDef)}
        early = runs_first(analysis.module, plan.home, plan.guard_if, users, owner)
        if early is not None:
            analysis.refuse(plan.guard_if, early)


def _class_names(owner: cst.ClassDef) -> set[str]:
    """The names a class body assigns directly (``__slots__ = ...``)."""
    body = owner.body.body if isinstance(owner.body, cst.IndentedBlock) else []
    return {
        _code(t.target)
        for statement in body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.Assign)
        for t in small.targets
    }


def _check_flag_elsewhere(analysis: _Analysis, scopes: Scopes, flag: str, uses: list[cst.CSTNode]) -> None:
    """`if <flag>:` in another function means amp.initialize's flag only where the flag's name means the same
    object there, and only if no other function assigns the flag's attribute."""
    plan = analysis.plan
    assert plan.home is not None
    base = flag.split(".")[0]
    tests = {id(analysis.function_of(i)) for i in analysis.ifs if dotted(i.test) == flag or _negates(i.test, flag)}
    for use in uses:
        where = scopes.function_of(use)
        if id(where) in tests and not same_binding(scopes, plan.home, where, base):
            name = where.name.value if isinstance(where, cst.FunctionDef) else "<module>"
            analysis.refuse(
                use,
                f"`{base}` in {name}() is not the `{base}` of amp.initialize's `if {flag}:` in "
                f"{plan.home.describe()} (a parameter or a local there): the flag could differ",
            )
            return
    for target in analysis.assignments:
        code, function = _code(target), scopes.function_of(target)
        rebinds = "." in code or code in declared_global(function)  # a bare name elsewhere is that function's own
        if rebinds and code in _prefixes(flag) and function is not plan.init_function:
            analysis.refuse(
                target,
                f"the flag `{flag}` that guards amp.initialize is assigned in another function ({code}): the "
                "GradScaler's enabled= could not follow it; rewrite by hand, or use --to ampinit",
            )
            return


# the uses that the rewrite gives the GradScaler or the autocast device name
_NEED_THE_SCALER = ("scale_loss", "master_params", "state_dict", "load_state_dict", "disable_casts", "_amp_state")


def _statement_of(analysis: _Analysis, node: cst.CSTNode) -> cst.CSTNode:
    current = node
    while not isinstance(current, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        current = analysis.parent(current)
    return current


_NOT_ALONE = (
    "shares its line with other statements, or is the one-line body of an `if`/`for`/`with` "
    "(`if cond: optimizer.step()`), which the rewrite does not handle"
)


def _alone_on_its_line(analysis: _Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node``'s statement is a line of its own: a ``SimpleStatementLine`` with one statement. The rewrite
    inserts statements around such lines only; on ``a; b`` or ``if c: a`` it would leave them unrewritten."""
    statement = _statement_of(analysis, node)
    return isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1


def _in_enabled_body(analysis: _Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of an `if <flag>:` with amp.initialize's flag: an amp import
    there only ran where amp was on, and the rewrite removes it."""
    return id(analysis.parent(_statement_of(analysis, node))) in analysis.plan.enabled_bodies


def _in_guard_if(analysis: _Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of the `if <condition>:` that guards amp.initialize."""
    guard_if = analysis.plan.guard_if
    return guard_if is not None and analysis.parent(analysis.parent(_statement_of(analysis, node))) is guard_if


def _check_init_guard(analysis: _Analysis, init: cst.Attribute) -> None:
    """``amp.initialize`` may sit directly under `if <flag>:` (no `else`, in its function's body) when the flag is a
    name or attribute that the function does not assign afterwards: the GradScaler is then created before the `if`
    with enabled=<flag>. Disabled, GradScaler.scale/unscale_/update do nothing and step() is optimizer.step(), so
    every rewritten call is right on both paths; a plain backward() is allowed where the flag is known false."""
    plan = analysis.plan
    if analysis.guard(init) is None:
        return
    statement = _statement_of(analysis, init)
    block = analysis.parent(statement)
    guard_if = analysis.parent(block)
    flag = dotted(guard_if.test) if isinstance(guard_if, cst.If) else None
    if not (
        isinstance(guard_if, cst.If)
        and block is guard_if.body
        and guard_if.orelse is None
        and analysis.guard(guard_if) is None
        and flag is not None
    ):
        guard = analysis.guard(init)
        analysis.refuse(
            init,
            f"amp.initialize runs only on some paths (it sits under `{guard}`, not directly under a plain "
            "`if <flag>:`): on the others the rewritten scaler.step()/scaler.scale() would have no GradScaler; "
            "create the GradScaler unconditionally with enabled=<the condition> by hand, or use --to ampinit",
        )
        return
    start = analysis.line(guard_if)
    changed = [
        _code(target)
        for target in analysis.assignments
        if _code(target) in _prefixes(flag)
        and analysis.line(target) > start
        and analysis.function_of(target) is plan.init_function
    ]
    if changed:
        analysis.refuse(
            guard_if,
            f"the flag `{flag}` that guards amp.initialize is assigned again later ({changed[0]}): the GradScaler's "
            "enabled= could not follow it; rewrite by hand, or use --to ampinit",
        )
        return
    plan.condition, plan.guard_if = flag, guard_if
    for node in analysis.ifs:  # other functions' ifs count once _check_elsewhere proves the flag is the same
        test = node.test
        if dotted(test) == flag:
            plan.enabled_bodies.add(id(node.body))
            if isinstance(node.orelse, cst.Else):
                plan.disabled_bodies.add(id(node.orelse.body))
        elif _negates(test, flag):
            plan.disabled_bodies.add(id(node.body))


def _negates(test: cst.BaseExpression, flag: str) -> bool:
    negated = isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not)
    return negated and dotted(test.expression) == flag  # type: ignore[attr-defined]


def _prefixes(flag: str) -> set[str]:
    """``a.b.c`` -> {``a``, ``a.b``, ``a.b.c``}: assigning any of them may change the flag."""
    parts = flag.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


def _check_paths(analysis: _Analysis, init: cst.Attribute, steps: list[cst.Call]) -> None:
    """Refuse unless the rewrite is equivalent on every path through each function that steps the optimizer:
    ``amp.initialize`` runs before (it creates the GradScaler that every ``scaler.step()`` needs; in another
    function, see :mod:`ampinit.migrate._reach`), and every ``optimizer.step()`` comes after a ``scale_loss``
    block of the same function that runs whenever the step runs (GradScaler.step needs a scaled backward), with
    no unscaled ``backward()`` beside them."""
    plan = analysis.plan
    start = analysis.positions[init].start
    stepping = {id(analysis.function_of(s)) for s in steps} | {id(plan.init_function)}
    scaled = {id(b) for b in analysis.scale_blocks}
    for step in steps:
        function = analysis.function_of(step)
        where = analysis.positions[step].start
        if function is plan.init_function and (where.line, where.column) < (start.line, start.column):
            analysis.refuse(step, "optimizer.step() comes before amp.initialize: it would run without a GradScaler")
            continue
        path = analysis.path(step)
        blocks = [b for b in analysis.scale_blocks if analysis.function_of(b) is function]
        before = [b for b in blocks if analysis.positions[b].start.line < where.line]
        if not before or any(analysis.path(b)[::-1] != path[::-1][: len(analysis.path(b))] for b in before):
            analysis.refuse(
                step,
                "optimizer.step() can run on a path without amp.scale_loss before it (scale_loss is conditional, "
                "or missing): GradScaler.step needs a scaled backward on every path",
            )
    for call in analysis.backwards:
        if id(analysis.function_of(call)) not in stepping:
            continue
        current: cst.CSTNode | None = call
        while current is not None and id(current) not in scaled:
            current = analysis.parents.get(current)
        if current is None and not set(analysis.blocks(call)) & plan.disabled_bodies:
            analysis.refuse(
                call,
                "a backward() outside amp.scale_loss in a function that steps the optimizer: on that path "
                "scaler.step() would see no scaled gradients",
            )


def _check_initialize(analysis: _Analysis, attribute: cst.Attribute) -> None:
    plan = analysis.plan
    call = analysis.parent(attribute)
    if not isinstance(call, cst.Call):
        analysis.refuse(attribute, "amp.initialize is used without being called")
        return
    args = _call_args(call, APEX_SIGNATURE)
    if args is None:
        analysis.refuse(call, "amp.initialize(*args/**kwargs): the options cannot be read statically")
        return
    models, optimizers = args.get("models"), args.get("optimizers")
    if not isinstance(models, (cst.Name, cst.Attribute)) or not isinstance(optimizers, (cst.Name, cst.Attribute)):
        analysis.refuse(call, "amp.initialize needs exactly one model and one optimizer (no lists) for --to torch")
        return
    level = _literal(args.get("opt_level")) if "opt_level" in args else "O1"
    why = ""
    if level is _NOT_LITERAL:
        level, why = _variable_level(analysis, call, args["opt_level"])
    if level not in ("O0", "O1"):
        reason = (
            f"opt_level={level!r} keeps a half-precision model (and fp32 master weights for O2): no native equivalent"
            if level is not _NOT_LITERAL
            else "opt_level is not a literal: the native equivalent exists only for O0 and O1"
            + (f" ({why})" if why else "")
        )
        analysis.refuse(call, reason)
    plan.level = level if isinstance(level, str) else "O1"
    for name, reason in NO_NATIVE.items():
        if name in args and _literal(args[name]) is not None:
            analysis.refuse(call, reason)
    if _literal(args.get("num_losses")) not in (None, 1):
        analysis.refuse(call, "num_losses > 1: GradScaler has one scale for all losses, not one per loss")
    scale = _literal(args.get("loss_scale"))
    if scale not in (None, "dynamic") and not (plan.level == "O0" and scale == 1.0):
        analysis.refuse(call, "a static loss_scale: GradScaler only scales dynamically (and skips steps on inf)")
    if "enabled" in args:
        plan.enabled = _code(args["enabled"])
    statement = analysis.parent(call)
    if not isinstance(statement, (cst.Assign, cst.Expr)):
        analysis.refuse(call, "amp.initialize inside an expression: rewrite it by hand")
    elif not _alone_on_its_line(analysis, call):
        analysis.refuse(call, f"amp.initialize {_NOT_ALONE}: put it on a line of its own")
    plan.optimizer = _code(optimizers)
    plan.model = _code(models)
    if isinstance(statement, cst.Assign):
        target = statement.targets[0].target
        if isinstance(target, cst.Tuple) and len(target.elements) == 2:
            plan.model, plan.optimizer = (_code(e.value) for e in target.elements)
        else:
            analysis.refuse(call, "amp.initialize's result is not unpacked into (model, optimizer)")


def _variable_level(analysis: _Analysis, call: cst.Call, node: cst.BaseExpression) -> tuple[Any, str]:
    """The level an ``opt_level`` expression holds at ``amp.initialize``, and why not when it cannot be known: a
    variable the function assigns once, before the call, from literals (``level = 'O1' if fp16 else 'O0'``) or
    from argparse, or argparse's ``args.opt_level`` itself (:mod:`ampinit.migrate._argparse`). That literal, or
    ``"O1"`` with the GradScaler switched by ``<expression> == "O1"`` when it can be O0 or O1; ``_NOT_LITERAL``
    otherwise."""
    function = analysis.function_of(call)
    values: set[Any] | None = None
    why = ""
    source = node
    if isinstance(node, cst.Name):
        stores = [t for t in analysis.assignments if _code(t) == node.value and analysis.function_of(t) is function]
        if len(stores) != 1 or analysis.line(stores[0]) >= analysis.line(call):
            return _NOT_LITERAL, f"`{node.value}` is not assigned once in this function before amp.initialize"
        target = analysis.parent(stores[0])
        assign = analysis.parent(target) if isinstance(target, cst.AssignTarget) else None
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
            return _NOT_LITERAL, f"`{node.value}` is not bound by a plain assignment"
        values = _literal_choices(assign.value)
        source = assign.value
    if values is None and isinstance(source, cst.Attribute):
        scopes = Scopes(analysis.parents, analysis.assignments)
        found, why = argparse_levels(analysis.module, scopes, scopes.function_of(call), source)
        values = set(found) if found is not None else None
    if values is None and not why:
        why = f"`{_code(source)}` is neither a literal nor an argparse value (a config?): it could hold any level"
    if values is None or not values <= {"O0", "O1"}:
        return _NOT_LITERAL, why or f"`{_code(source)}` could hold {sorted(map(str, values or ()))}"
    if len(values) == 1:
        return next(iter(values)), ""
    analysis.plan.level_switch = f'{_code(node)} == "O1"'
    return "O1", ""


def _literal_choices(node: cst.BaseExpression) -> set[Any] | None:
    if isinstance(node, cst.IfExp):
        body, orelse = _literal_choices(node.body), _literal_choices(node.orelse)
        return None if body is None or orelse is None else body | orelse
    value = _literal(node)
    return None if value is _NOT_LITERAL else {value}


def _check_scale_loss(analysis: _Analysis, attribute: cst.Attribute) -> None:
    plan = analysis.plan
    call = analysis.parent(attribute)
    item = analysis.parent(call) if isinstance(call, cst.Call) else None
    block = analysis.parent(item) if isinstance(item, cst.WithItem) else None
    if not isinstance(call, cst.Call) or not isinstance(block, cst.With) or len(block.items) != 1:
        analysis.refuse(attribute, "amp.scale_loss outside a single-item `with` statement")
        return
    if not isinstance(item, cst.WithItem) or item.asname is None or not isinstance(item.asname.name, cst.Name):
        analysis.refuse(call, "`with amp.scale_loss(...)` without `as name`")
        return
    if not isinstance(block.body, cst.IndentedBlock):
        analysis.refuse(call, "`with amp.scale_loss(...) as s: s.backward()` on one line: put the body on its own line")
        return
    args = _call_args(call, SCALE_LOSS_SIGNATURE)
    if args is None or "loss" not in args:
        analysis.refuse(call, "amp.scale_loss(*args/**kwargs): the arguments cannot be read statically")
        return
    _check_scale_loss_arguments(analysis, call, args)
    analysis.scale_blocks.append(block)
    if plan.level != "O0":
        _wrap_forward_before(analysis, block, args["loss"])


def _check_scale_loss_arguments(analysis: _Analysis, call: cst.Call, args: dict[str, cst.BaseExpression]) -> None:
    plan = analysis.plan
    optimizers = args.get("optimizers")
    if optimizers is None or _code(optimizers) != plan.optimizer:
        analysis.refuse(
            call, f"amp.scale_loss is given another optimizer than the initialized one ({plan.optimizer or 'unknown'})"
        )
    if _literal(args.get("loss_id")) not in (None, 0):
        analysis.refuse(call, "loss_id selects one of several loss scalers: GradScaler has one scale")
    if _literal(args.get("delay_unscale")) not in (None, False):
        analysis.refuse(
            call,
            "delay_unscale=True: with GradScaler, accumulate with scaler.scale(loss).backward() and call "
            "scaler.step()/update() only on stepping iterations",
        )
    if _literal(args.get("delay_overflow_check")) not in (None, False):
        analysis.refuse(call, "delay_overflow_check has no native equivalent")


def _wrap_forward_before(analysis: _Analysis, block: cst.With, loss: cst.BaseExpression) -> None:
    """Plan autocast around the statements that compute ``loss`` before the ``scale_loss`` block, or note why not."""
    plan = analysis.plan
    anchor: cst.CSTNode = block
    container = analysis.parent(block)
    while id(container) in plan.enabled_bodies and isinstance(container, cst.IndentedBlock):
        if container.body[0] is not anchor:
            break
        anchor = analysis.parent(container)  # `if <flag>: with amp.scale_loss(...)`: the forward is before the if
        container = analysis.parent(anchor)
    if not isinstance(container, (cst.Module, cst.IndentedBlock)) or not isinstance(loss, cst.Name):
        plan.notes.append(Site(analysis.line(block), _AUTOCAST_NOTE, True))
        return
    body = list(container.body)
    end = body.index(anchor) - 1  # type: ignore[arg-type]
    while end >= 0 and not _assigns(body[end], loss.value):
        end -= 1
    if end < 0:
        plan.notes.append(Site(analysis.line(block), _AUTOCAST_NOTE, True))
        return
    start = end
    while (
        start > 0
        and isinstance(body[start - 1], cst.SimpleStatementLine)
        and not _ends_forward(body[start - 1], plan.amp)
    ):
        start -= 1
    plan.autocast.append((id(container), start, end))
    if _forward_left_out(body[:start], plan.amp, plan.model):
        plan.notes.append(Site(analysis.line(body[start - 1]), _FORWARD_LEFT_OUT, True))


def _forward_left_out(before: list[Any], amp: str, model: str) -> bool:
    """Whether a compound statement between the last zero_grad/step and the autocast range calls the model (the
    forward in an `if`/`else` before the loss line): it stays outside the autocast range, in fp32, where Apex's O1
    cast it."""
    for statement in reversed(before):
        if _ends_forward(statement, amp):
            return False
        if not isinstance(statement, cst.SimpleStatementLine) and f"{model}(" in _code(statement):
            return True
    return False


_FORWARD_LEFT_OUT = (
    "the model is called in a compound statement before the loss, outside the "
    "`with torch.autocast(...)` placed after it (Apex's O1 cast it): move it under that autocast"
)
_AUTOCAST_NOTE = (
    "run the forward pass and the loss under `with torch.autocast(amp_device, dtype=torch.float16):` "
    "(it could not be located next to this block)"
)


def _assigns(statement: cst.CSTNode, name: str) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine):
        return False
    for small in statement.body:
        if isinstance(small, cst.Assign) and any(_code(t.target) == name for t in small.targets):
            return True
        if isinstance(small, (cst.AugAssign, cst.AnnAssign)) and _code(small.target) == name:
            return True
    return False


def _ends_forward(statement: cst.BaseStatement, amp: str) -> bool:
    """A statement the forward pass starts after: zeroing or stepping, or any use of amp (whatever its local name:
    ``amp.initialize`` must not move under the autocast that reads the device it defines)."""
    code = _code(statement)
    uses_amp = bool(m.findall(statement, m.Name(amp)))
    return "zero_grad" in code or ".step(" in code or "amp." in code or uses_amp


def _check_master_params(analysis: _Analysis, attribute: cst.Attribute) -> None:
    call = analysis.parent(attribute)
    arg = analysis.parent(call) if isinstance(call, cst.Call) else None
    clip = analysis.parent(arg) if isinstance(arg, cst.Arg) else None
    name = dotted(clip.func) if isinstance(clip, cst.Call) else None
    if name is None or not name.endswith(CLIP_FUNCTIONS):
        analysis.refuse(attribute, "amp.master_params outside gradient clipping: unscale with scaler.unscale_() first")
        return
    if not isinstance(call, cst.Call) or len(call.args) != 1 or _code(call.args[0].value) != analysis.plan.optimizer:
        analysis.refuse(attribute, "amp.master_params of another optimizer than the initialized one")
    elif not _alone_on_its_line(analysis, attribute):
        analysis.refuse(attribute, f"clipping amp.master_params {_NOT_ALONE}: scaler.unscale_() could not go before it")
    elif _in_scale_loss_block(analysis, attribute):
        analysis.refuse(
            attribute,
            "amp.master_params clipped inside the scale_loss block: Apex clips the still-scaled gradients there, "
            "after scaler.unscale_() they would be unscaled; move the clipping after the block by hand",
        )


def _in_scale_loss_block(analysis: _Analysis, node: cst.CSTNode) -> bool:
    current: cst.CSTNode | None = analysis.parents.get(node)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
        if isinstance(current, cst.With) and any(
            isinstance(i.item, cst.Call)
            and isinstance(i.item.func, cst.Attribute)
            and i.item.func.attr.value == "scale_loss"
            and dotted(i.item.func.value) == analysis.plan.amp
            for i in current.items
        ):
            return True
        current = analysis.parents.get(current)
    return False


def _check_gradients_by_hand(analysis: _Analysis, steps: list[cst.Call]) -> None:
    """``.grad`` used between a scale_loss block and a step of the same function (a hand-rolled clamp, a gradient
    norm, a histogram): Apex had unscaled the gradients when the block exited, a GradScaler keeps them scaled
    until ``scaler.unscale_()``/``scaler.step()``, so the code would see them 65536 times too large."""
    plan = analysis.plan
    for use in analysis.grads:
        function = analysis.function_of(use)
        line = analysis.line(use)
        after_block = any(
            analysis.function_of(b) is function and analysis.positions[b].end.line < line for b in analysis.scale_blocks
        )
        before_step = any(analysis.function_of(s) is function and analysis.line(s) > line for s in steps)
        if after_block and before_step and not set(analysis.blocks(use)) & plan.disabled_bodies:
            analysis.refuse(
                use,
                "`.grad` used between the scale_loss block and optimizer.step(): Apex had unscaled the gradients "
                "there, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) before it "
                "by hand, or use --to ampinit",
            )
            return


def _check_other_clipping(analysis: _Analysis, steps: list[cst.Call]) -> None:
    """Gradient clipping of anything but ``amp.master_params(optimizer)`` where the loop scales the loss: Apex
    unscales the gradients when the scale_loss block exits (under O1 into the model's own ``.grad``, so
    ``clip_grad_norm_(model.parameters(), n)`` clips true gradients), a GradScaler keeps them scaled until
    ``scaler.unscale_()``/``scaler.step()``: clipping there would clip gradients 65536 times too large."""
    plan = analysis.plan
    looping = {id(analysis.function_of(s)) for s in steps}
    looping |= {id(analysis.function_of(b)) for b in analysis.scale_blocks}
    for call in analysis.calls:
        name = dotted(call.func)
        if name is None or not name.endswith(CLIP_FUNCTIONS) or id(analysis.function_of(call)) not in looping:
            continue
        first = call.args[0].value if call.args else None
        through_amp = (
            isinstance(first, cst.Call)
            and isinstance(first.func, cst.Attribute)
            and first.func.attr.value == "master_params"
            and dotted(first.func.value) == plan.amp
        )
        if through_amp or set(analysis.blocks(call)) & plan.disabled_bodies:
            continue
        analysis.refuse(
            call,
            f"{name}() of gradients not taken through amp.master_params: Apex unscaled them when the scale_loss "
            "block exited, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) "
            "before the clipping by hand, or use --to ampinit",
        )


def _check_plain_call(analysis: _Analysis, attribute: cst.Attribute) -> None:
    if not isinstance(analysis.parent(attribute), cst.Call):
        analysis.refuse(attribute, f"amp.{attribute.attr.value} used without being called")


def _check_load_state_dict(analysis: _Analysis, attribute: cst.Attribute) -> None:
    _check_plain_call(analysis, attribute)
    call = analysis.parent(attribute)
    if isinstance(call, cst.Call) and (len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star):
        analysis.refuse(call, "amp.load_state_dict with other arguments than one state: rewrite it by hand")
    analysis.plan.loads_state = analysis.line(attribute)


def _loss_scale_read(amp: str) -> m.Call:
    """``amp._amp_state.loss_scalers[0].loss_scale()``: Apex's one loss scaler's current scale, which is
    GradScaler's ``get_scale()``."""
    state = m.Attribute(value=m.Name(amp), attr=m.Name("_amp_state"))
    scalers = m.Subscript(
        value=m.Attribute(value=state, attr=m.Name("loss_scalers")),
        slice=[m.SubscriptElement(slice=m.Index(value=m.Integer(value="0")))],
    )
    return m.Call(func=m.Attribute(value=scalers, attr=m.Name("loss_scale")), args=[])


def _loss_scale_call(analysis: _Analysis, attribute: cst.CSTNode) -> cst.Call | None:
    """The call ``attribute`` (``amp._amp_state``) starts, if it is :func:`_loss_scale_read`."""
    node: cst.CSTNode | None = attribute
    for _ in range(4):  # .loss_scalers, [0], .loss_scale, ()
        node = analysis.parents.get(node) if node is not None else None
    if isinstance(node, cst.Call) and m.matches(node, _loss_scale_read(analysis.plan.amp)):
        return node
    return None


def _check_amp_state(analysis: _Analysis, attribute: cst.Attribute) -> None:
    """``amp._amp_state.loss_scalers[0].loss_scale()`` (logging the scale) becomes ``scaler.get_scale()``: both are
    the current scale as a float, 1.0 where amp is off (O0, a disabled GradScaler). Apex updates its scale when the
    scale_loss block exits, GradScaler at ``scaler.update()`` after the step, so the two differ between the block
    and the step of an overflowing iteration: a read there is refused. Any other use of Apex's internals too."""
    call = _loss_scale_call(analysis, attribute)
    if call is None:
        analysis.refuse(
            attribute,
            "amp._amp_state has no native torch.amp equivalent (only amp._amp_state.loss_scalers[0].loss_scale() "
            "has: scaler.get_scale())",
        )
        return
    line, function = analysis.line(call), analysis.function_of(call)
    after_block = any(
        analysis.function_of(b) is function and analysis.positions[b].end.line < line for b in analysis.scale_blocks
    )
    before_step = any(analysis.function_of(s) is function and analysis.line(s) > line for s in analysis.steps)
    if after_block and before_step:
        analysis.refuse(
            call,
            "amp._amp_state.loss_scalers[0].loss_scale() read between the scale_loss block and optimizer.step(): "
            "Apex has updated the scale there, GradScaler updates it after the step; read scaler.get_scale() "
            "after scaler.update() by hand, or use --to ampinit",
        )
        return
    analysis.plan.scale_reads.append(line)


_USE_CHECKS = {
    "_amp_state": _check_amp_state,
    "scale_loss": _check_scale_loss,
    "master_params": _check_master_params,
    "state_dict": _check_plain_call,
    "load_state_dict": _check_load_state_dict,
    "disable_casts": _check_plain_call,
}


class _WrapAutocast(cst.CSTTransformer):
    """First pass, over the original tree: the autocast blocks, and the notes as comments on their statements."""

    def __init__(
        self, ranges: list[tuple[int, int, int]], header: str, notes: list[Site], positions: Mapping[Any, Any]
    ) -> None:
        super().__init__()
        self.ranges = ranges
        self.header = header
        self.positions = positions
        self.notes: dict[int, list[str]] = {}
        for note in notes:
            self.notes.setdefault(note.line, []).append(note.message)

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode) -> Any:
        result = super().on_leave(original_node, updated_node)
        if isinstance(original_node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            position = self.positions.get(original_node)
            messages = self.notes.pop(position.start.line, None) if position is not None else None
            if messages:
                result = add_comments(result, messages)
        return result

    def _wrap(self, original: Block, updated: Block) -> Block:
        spans = _merged(sorted((s, e) for block, s, e in self.ranges if block == id(original)))
        if not spans:
            return updated
        body = list(updated.body)
        for start, end in reversed(spans):
            first: Any = body[start]
            inner = [first.with_changes(leading_lines=[]), *body[start + 1 : end + 1]]
            wrapped = cst.With(
                items=[cst.WithItem(cst.parse_expression(self.header))],
                body=cst.IndentedBlock(body=inner),
                leading_lines=first.leading_lines,
            )
            body[start : end + 1] = [wrapped]
        return updated.with_changes(body=body)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        result = self._wrap(original_node, updated_node)
        assert isinstance(result, cst.Module)
        return result

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        return self._wrap(original_node, updated_node)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``(first, last)`` ranges with the overlapping ones joined: two losses computed before their two
    scale_loss blocks give ranges that share statements, and wrapping each would nest one autocast in the other
    around the first backward. Each range is simple statements only, so their union is too."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


class _Rewrite(cst.CSTTransformer):
    def __init__(self, plan: _Plan, scaler: str, device: str, has_torch: bool, state_helper: str = "") -> None:
        super().__init__()
        self.plan = plan
        self.state_helper = state_helper
        self.scaler = scaler
        self.device = device
        self.has_torch = has_torch
        self.depth = 0  # indented blocks around the current statement: 0 at module level

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.depth += 1

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        self.depth -= 1
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.has_torch:
            return updated_node
        body = list(updated_node.body)
        index = 0
        while index < len(body) and _is_docstring_or_future(body[index]):
            index += 1
        body.insert(index, cst.parse_statement("import torch"))
        return updated_node.with_changes(body=body)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> Any:
        """The `if <flag>:` that guarded amp.initialize: the GradScaler is created before it, on every path."""
        if self.plan.condition is None:
            return updated_node
        calls = [self._init_call(s) for s in original_node.body.body]
        call = next((c for c in calls if c is not None), None)
        if call is None:
            return updated_node
        init = next(s for s in original_node.body.body if self._init_call(s) is not None)
        assert isinstance(init, cst.SimpleStatementLine)
        created = self._create_scaler([*original_node.leading_lines, *init.leading_lines], init.trailing_whitespace)
        if not updated_node.body.body:
            return cst.FlattenSentinel(created)
        return cst.FlattenSentinel([*created, updated_node.with_changes(leading_lines=[])])

    def _init_call(self, statement: cst.CSTNode) -> cst.Call | None:
        if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
            return None
        small = statement.body[0]
        value = small.value if isinstance(small, (cst.Assign, cst.Expr)) else None
        return self._amp_call(value, "initialize") if value is not None else None

    def _amp_call(self, node: cst.BaseExpression, name: str) -> cst.Call | None:
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == name
            and dotted(node.func.value) == self.plan.amp
        ):
            return node
        return None

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        if len(updated_node.body) != 1:
            return updated_node
        small = updated_node.body[0]
        lines = updated_node.leading_lines
        if (
            isinstance(small, cst.ImportFrom)
            and not small.relative
            and small.module is not None
            and dotted(small.module) == "apex"
            and not isinstance(small.names, cst.ImportStar)
        ):
            rest = [a for a in small.names if dotted(a.name) != "amp"]
            if len(rest) != len(small.names):
                return self._replace_import(updated_node, small, rest)
        if isinstance(small, cst.Import):
            rest = [a for a in small.names if dotted(a.name) != "apex.amp"]
            if len(rest) != len(small.names):
                return self._replace_import(updated_node, small, rest)
        value = small.value if isinstance(small, (cst.Assign, cst.Expr)) else None
        if value is not None and self._amp_call(value, "initialize") is not None:
            renamed = self._renamed_models(small)
            if self.plan.condition is not None:  # the GradScaler is created before the `if` (leave_If)
                return cst.FlattenSentinel(renamed) if renamed else cst.RemoveFromParent()
            created = [*renamed, *self._create_scaler([], updated_node.trailing_whitespace)]
            created[0] = created[0].with_changes(leading_lines=lines)
            return cst.FlattenSentinel(created)
        if value is not None and _is_step(value, self.plan.optimizer):
            step = small.with_changes(value=cst.parse_expression(f"{self.scaler}.step({self.plan.optimizer})"))
            update = cst.parse_statement(f"{self.scaler}.update()")
            return cst.FlattenSentinel([updated_node.with_changes(body=[step]), update])
        if f"{self.plan.amp}.master_params(" in _code(original_node):
            unscale = cst.parse_statement(f"{self.scaler}.unscale_({self.plan.optimizer})")
            assert isinstance(unscale, cst.SimpleStatementLine)
            return cst.FlattenSentinel(
                [unscale.with_changes(leading_lines=lines), updated_node.with_changes(leading_lines=[])]
            )
        return updated_node

    def _replace_import(self, statement: cst.SimpleStatementLine, small: Any, rest: list[Any]) -> Any:
        out: list[cst.SimpleStatementLine] = []
        if rest:
            rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            out.append(statement.with_changes(body=[small.with_changes(names=rest)]))
        if not self.has_torch and self.depth == 0:  # in a function, `import torch` would make torch a local name
            self.has_torch = True
            out.append(cst.parse_statement("import torch"))  # type: ignore[arg-type]
        if not out:
            return cst.RemoveFromParent()
        out[0] = out[0].with_changes(
            leading_lines=statement.leading_lines, trailing_whitespace=statement.trailing_whitespace
        )
        return cst.FlattenSentinel(out)

    def _renamed_models(self, small: cst.BaseSmallStatement) -> list[cst.BaseStatement]:
        """``new_model, new_opt = model, opt`` where amp.initialize's result was bound to other names."""
        plan = self.plan
        args = _call_args(small.value, APEX_SIGNATURE) or {}  # type: ignore[attr-defined]
        given = (_code(args["models"]), _code(args["optimizers"]))
        if (plan.model, plan.optimizer) == given:
            return []
        return [cst.parse_statement(f"{plan.model}, {plan.optimizer} = {given[0]}, {given[1]}")]

    def _create_scaler(self, lines: Any, trailing: cst.TrailingWhitespace | None = None) -> list[cst.BaseStatement]:
        """The device and GradScaler lines, with ``lines`` (comments) above and ``trailing`` (the replaced
        ``amp.initialize`` line's comment) on the GradScaler's line."""
        plan = self.plan
        enabled = "False" if plan.level == "O0" else plan.enabled_expression
        options = f", enabled={enabled}" if enabled is not None else ""
        out: list[cst.BaseStatement] = [
            cst.parse_statement(f"{self.device} = {_device_of(plan.model)}"),
            cst.parse_statement(f"{self.scaler} = torch.amp.GradScaler({self.device}{options})"),
        ]
        out[0] = out[0].with_changes(leading_lines=lines)
        if trailing is not None and trailing.comment is not None:
            out[1] = out[1].with_changes(trailing_whitespace=trailing)
        return out

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> Any:
        item = updated_node.items[0] if len(updated_node.items) == 1 else None
        call = self._amp_call(item.item, "scale_loss") if item is not None else None
        if item is None or call is None or item.asname is None:
            return updated_node
        loss = _code((_call_args(call, SCALE_LOSS_SIGNATURE) or {})["loss"])
        name = _code(item.asname.name)
        body = list(updated_node.body.body) if isinstance(updated_node.body, cst.IndentedBlock) else []
        scaled = f"{self.scaler}.scale({loss})"
        if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
            expr = body[0].body[0]
            if isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call):
                func = expr.value.func
                if isinstance(func, cst.Attribute) and func.attr.value == "backward" and _code(func.value) == name:
                    new_call = expr.value.with_changes(func=func.with_changes(value=cst.parse_expression(scaled)))
                    new = body[0].with_changes(body=[expr.with_changes(value=new_call)])
                    lines = [*updated_node.leading_lines, *_header_comment(updated_node, new), *new.leading_lines]
                    return _with_header_comment(updated_node, new).with_changes(leading_lines=lines)
        assign = cst.parse_statement(f"{name} = {scaled}")
        assert isinstance(assign, cst.SimpleStatementLine)
        assign = _with_header_comment(updated_node, assign).with_changes(leading_lines=updated_node.leading_lines)
        return cst.FlattenSentinel([assign, *body])

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self._amp_call(updated_node, "master_params") is not None:
            # Apex's master_params(optimizer) under O0/O1: the optimizer's parameters, which need not be all of
            # the model's (an optimizer over the head only)
            return cst.parse_expression(f'(p for group in {self.plan.optimizer}.param_groups for p in group["params"])')
        if self._amp_call(updated_node, "state_dict") is not None:
            return updated_node.with_changes(func=cst.parse_expression(f"{self.scaler}.state_dict"))
        if self._amp_call(updated_node, "load_state_dict") is not None:
            state = updated_node.args[0].with_changes(
                value=cst.Call(func=cst.Name(self.state_helper), args=[cst.Arg(updated_node.args[0].value)])
            )
            return updated_node.with_changes(func=cst.parse_expression(f"{self.scaler}.load_state_dict"), args=[state])
        if self._amp_call(updated_node, "disable_casts") is not None:
            return cst.parse_expression(f"torch.autocast({self.device}, enabled=False)")
        if m.matches(original_node, _loss_scale_read(self.plan.amp)):  # the reads _check_amp_state accepted
            return cst.parse_expression(f"{self.scaler}.get_scale()")
        return updated_node


def _device_of(models: str) -> str:
    """The device type autocast and the GradScaler work on: the model's, as ampinit's own O1 takes it from the
    model's parameters (``torch.cuda.is_available()`` says nothing about where a model lives). Of a list of
    models, the first's."""
    node = cst.parse_expression(models)
    if isinstance(node, (cst.List, cst.Tuple)) and node.elements:
        models = _code(node.elements[0].value)
    return f"next({models}.parameters()).device.type"


def _header_trailing(block: cst.With) -> cst.TrailingWhitespace | None:
    body = block.body
    return body.header if isinstance(body, cst.IndentedBlock) and body.header.comment is not None else None


def _with_header_comment(block: cst.With, line: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """``line`` (what replaced a ``with amp.scale_loss(...) as s:`` block) with the header's trailing comment, if
    it has none of its own; otherwise :func:`_header_comment` puts that comment on a line above it."""
    header = _header_trailing(block)
    if header is None or line.trailing_whitespace.comment is not None:
        return line
    return line.with_changes(trailing_whitespace=header)


def _header_comment(block: cst.With, line: cst.SimpleStatementLine) -> list[cst.EmptyLine]:
    header = _header_trailing(block)
    if header is None or header.comment is None or line.trailing_whitespace.comment is None:
        return []
    return [cst.EmptyLine(indent=True, comment=header.comment)]


def _is_docstring_or_future(statement: cst.BaseStatement) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return False
    small = statement.body[0]
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString):
        return True
    return isinstance(small, cst.ImportFrom) and dotted(small.module or cst.Name("")) == "__future__"


def _is_step(value: cst.BaseExpression, optimizer: str) -> bool:
    return (
        isinstance(value, cst.Call)
        and not value.args
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "step"
        and _code(value.func.value) == optimizer
    )


def _fresh(preferred: list[str], used: set[str]) -> str:
    for name in preferred:
        if name not in used:
            return name
    return preferred[-1] + "_"


def migrate_module_to_torch(source: str) -> tuple[str, list[Site], bool]:
    """Rewrite the amp part of one module to torch.amp. Returns (source, sites, refused)."""
    module = cst.parse_module(source)
    bindings = apex_bindings(module)
    amp_locals = [local for local, q in bindings.items() if q == "apex.amp"]
    packages = [local for local, q in bindings.items() if q == "apex"]
    if not amp_locals:
        if packages and "apex.amp" in source:
            return source, [Site(1, "apex.amp is used through `import apex`: use --to ampinit", True)], True
        return source, [], False
    if len(amp_locals) > 1:
        return source, [Site(1, "apex.amp is imported under several names: use --to ampinit", True)], True
    wrapper = MetadataWrapper(module)
    plan, analysis = _analyse(wrapper, amp_locals[0])
    uses = {name for name, _ in analysis.uses}
    if uses and uses <= HELPER_USES and analysis.references == len(analysis.uses):
        line = min((analysis.line(i) for i in analysis.imports), default=1)
        code, sites = migrate_helper_module(
            module, amp_locals[0], uses, _fresh(["amp_float_function", "_amp_float_function"], plan.names), line
        )
        return code, sites, False
    if analysis.references == 0:
        unused = module.visit(_Rewrite(plan, "", "", has_torch=True))
        lines = sorted(analysis.line(i) for i in analysis.imports) or [1]
        return unused.code, [Site(lines[0], "amp is imported but never used here: the import is removed")], False
    if plan.refusals:
        return source, sorted(plan.refusals, key=lambda s: s.line), True
    return _rewrite_to_torch(module, wrapper, plan, analysis)


def _rewrite_to_torch(
    module: cst.Module, wrapper: MetadataWrapper, plan: _Plan, analysis: _Analysis
) -> tuple[str, list[Site], bool]:
    """The accepted plan, written: autocast around the forward, the GradScaler, its state helper if needed."""
    assert plan.home is not None
    # an attribute only where other methods need it; a distinctive name there, as base classes may hold `scaler`
    attribute = plan.shared and plan.home.kind == "attribute"
    scaler = _fresh(["amp_scaler", "_amp_scaler"] if attribute else ["scaler", "grad_scaler"], plan.names)
    device = _fresh(["amp_device"], plan.names)
    if attribute:
        scaler, device = plan.home.name(scaler), plan.home.name(device)
    enabled = f", enabled={plan.enabled_expression}" if plan.enabled_expression is not None else ""
    if enabled and plan.shared:  # the flag's names may not be readable where the loop is; the GradScaler is
        enabled = f", enabled={scaler}.is_enabled()"
    header = f"torch.autocast({device}, dtype=torch.float16{enabled})"
    wrapped = wrapper.module.visit(_WrapAutocast(plan.autocast, header, plan.notes, analysis.positions))
    has_torch = any(
        isinstance(s, cst.SimpleStatementLine)
        # `import torch as th` does not bind `torch`, which the rewritten lines use
        and any(
            isinstance(x, cst.Import) and any(dotted(a.name) == "torch" and a.asname is None for a in x.names)
            for x in s.body
        )
        for s in module.body
    )
    state_helper = _fresh(["grad_scaler_state", "_grad_scaler_state"], plan.names)
    rewritten = wrapped.visit(_Rewrite(plan, scaler, device, has_torch, state_helper))
    if plan.loads_state:
        rewritten = add_definitions(rewritten, [], [GRAD_SCALER_STATE.format(name=state_helper)])
    return rewritten.code, _rewrite_sites(plan, analysis, scaler, state_helper), False


def _rewrite_sites(plan: _Plan, analysis: _Analysis, scaler: str, state_helper: str) -> list[Site]:
    level = plan.level if plan.level_switch is None else f"O0 or O1: {plan.level_switch}"
    sites = [Site(1, f"amp ({level}) -> torch.autocast + torch.amp.GradScaler ({scaler})")]
    if plan.loads_state:
        sites.append(
            Site(
                plan.loads_state,
                f"amp.load_state_dict(s) -> {scaler}.load_state_dict({state_helper}(s)): loads either format",
            )
        )
    sites += [
        Site(analysis.line(b), "scale_loss block -> scaler.scale(loss).backward()") for b in analysis.scale_blocks
    ]
    sites += [
        Site(line, f"amp._amp_state.loss_scalers[0].loss_scale() -> {scaler}.get_scale()") for line in plan.scale_reads
    ]
    sites += [
        Site(analysis.line(s), "optimizer.step() -> scaler.step(optimizer); scaler.update()")
        for s in analysis.steps
        if isinstance(s.func, cst.Attribute) and dotted(s.func.value) == plan.optimizer
    ]
    sites += plan.notes
    return sorted(sites, key=lambda s: s.line)
