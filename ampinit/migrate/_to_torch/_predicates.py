"""The facts ``--to torch``'s refusal rows test (:mod:`._refusals`): which nodes a row applies to, and the test
over one node that says whether the row applies there (a :class:`Hit`: where to report it, and its reason's values).

Split from the table so that the table reads alone: a row there names one selector and one test from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ampinit.migrate import _cst
from ampinit.migrate._reach import (
    assigned_again,
    declared_global,
    first_param,
    runs_first,
    same_binding,
    set_before_home,
    unreachable,
)
from ampinit.migrate._to_torch._analysis import (
    APEX_SIGNATURE,
    NOT_LITERAL,
    Analysis,
    call_args,
    imports_amp,
    literal,
    negates,
    prefixes,
)

CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_")
# the uses that the rewrite gives the GradScaler or the autocast device name
NEED_THE_SCALER = ("scale_loss", "master_params", "state_dict", "load_state_dict", "disable_casts", "_amp_state")
# the amp uses (besides initialize) that --to torch rewrites; any other has no native equivalent
REWRITTEN_USES = ("_amp_state", "scale_loss", "master_params", "state_dict", "load_state_dict", "disable_casts")


@dataclass(frozen=True)
class Hit:
    """A row applies: where to report it (``at``; the node tested when None) and its reason's values."""

    at: cst.CSTNode | None = None
    fields: Mapping[str, object] = field(default_factory=dict)


def hit(at: cst.CSTNode | None = None, **fields: object) -> Hit:
    return Hit(at, fields)


Nodes = Callable[[Analysis], Iterable[cst.CSTNode]]
Test = Callable[[Analysis, cst.CSTNode], "Hit | None"]


# -- the nodes rows apply to -----------------------------------------------------------------------------------------
def args_unknown(analysis: Analysis) -> bool:
    assert analysis.init_call is not None
    return call_args(analysis.init_call, APEX_SIGNATURE) is None


def file(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.module]


def optimizers_given(analysis: Analysis) -> bool:
    """Whether ``amp.initialize`` is given an optimizer (not ``None``, not left out); True where its arguments
    cannot be read (refused for that)."""
    assert analysis.init_call is not None
    args = call_args(analysis.init_call, APEX_SIGNATURE)
    return args is None or literal(args.get("optimizers")) is not None


def initialize(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.init] if analysis.init is not None else []


def readable_initialize(analysis: Analysis) -> list[cst.CSTNode]:
    """``amp.initialize`` called with arguments that can be read, one model and one optimizer."""
    return [analysis.init_call] if analysis.init_args is not None and analysis.init_call is not None else []


def uses_of(*names: str) -> Nodes:
    return lambda analysis: [node for name, node in analysis.uses if name in names]


def other_uses(analysis: Analysis) -> list[cst.CSTNode]:
    return [node for name, node in analysis.uses if name != "initialize"]


def readable_scale_loss(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.scale_loss[id(n)][0] for name, n in analysis.uses if id(n) in analysis.scale_loss]


def all_steps(analysis: Analysis) -> list[cst.CSTNode]:
    return list(analysis.optimizer_steps)


def amp_imports(analysis: Analysis) -> list[cst.CSTNode]:
    return [i for i in analysis.imports if imports_amp(i)]


def bare_uses(analysis: Analysis) -> list[cst.CSTNode]:
    """The amp name used as an object, but for the ``amp = None`` of an availability guard."""
    guards = {id(g) for g in analysis.guards}
    out: list[cst.CSTNode] = []
    for name in analysis.bare:
        current: cst.CSTNode | None = name
        while current is not None and not isinstance(current, cst.ExceptHandler):
            current = analysis.parents.get(current)
        handler = analysis.parents.get(current) if current is not None else None
        if handler is None or id(handler) not in guards:
            out.append(name)
    return out


def all_backwards(analysis: Analysis) -> list[cst.CSTNode]:
    return list(analysis.backwards)


def all_calls(analysis: Analysis) -> list[cst.CSTNode]:
    return list(analysis.calls)


def elsewhere(analysis: Analysis) -> list[cst.CSTNode]:
    """The uses that need the GradScaler and the steps outside ``amp.initialize``'s function (those not refused
    already: a use the GradScaler cannot reach, a step the rewrite cannot route)."""
    uses: list[cst.CSTNode] = [
        node
        for name, node in analysis.uses
        if name in NEED_THE_SCALER
        and "amp_use_unreachable" not in analysis.refused.get(id(node), set())
        and analysis.function_of(node) is not analysis.init_function
    ]
    steps = [
        s
        for s in analysis.optimizer_steps
        if not analysis.refused.get(id(s)) and analysis.function_of(s) is not analysis.init_function
    ]
    return uses + steps


def when_shared(analysis: Analysis) -> list[cst.CSTNode]:
    """amp used in other functions than amp.initialize's: they must mean the objects it returned, and with
    amp.initialize under `if <flag>:`, the GradScaler must exist before any of them can run."""
    return [analysis.module] if elsewhere(analysis) else []


# -- the tests -------------------------------------------------------------------------------------------------------
def when(predicate: Callable[[Analysis, cst.CSTNode], bool]) -> Test:
    return lambda analysis, node: hit() if predicate(analysis, node) else None


def option(name: str) -> Test:
    def test(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
        args = analysis.init_args or {}
        return hit() if name in args and literal(args[name]) is not None else None

    return test


def level_half(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    level = analysis.level_value
    return hit(level=repr(level)) if level not in ("O0", "O1") and level is not NOT_LITERAL else None


def level_unknown(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    if analysis.level_value is not NOT_LITERAL:
        return None
    return hit(why=f" ({analysis.level_why})" if analysis.level_why else "")


def static_scale(analysis: Analysis, call: cst.CSTNode) -> bool:
    scale = literal((analysis.init_args or {}).get("loss_scale"))
    return scale not in (None, "dynamic") and not (analysis.level == "O0" and scale == 1.0)


def not_unpacked(analysis: Analysis, call: cst.CSTNode) -> bool:
    statement = analysis.parent(call)
    if not isinstance(statement, cst.Assign):
        return False
    target = statement.targets[0].target
    return not (isinstance(target, cst.Tuple) and len(target.elements) == 2)


def on_some_paths(analysis: Analysis, init: cst.CSTNode) -> Hit | None:
    guard = analysis.guard(init)
    return hit(guard=guard) if guard is not None and analysis.flag is None else None


def flag_reassigned(analysis: Analysis, init: cst.CSTNode) -> Hit | None:
    if not analysis.flag_changes:
        return None
    return hit(analysis.flag_if, flag=analysis.flag, changed=analysis.flag_changes[0])


def guarded_import(analysis: Analysis, statement: cst.CSTNode) -> Hit | None:
    guard = analysis.guard(statement)
    if guard is None or in_guard_if(analysis, statement) or in_enabled_body(analysis, statement):
        return None
    if any(analysis.parent(analysis.parent(analysis.parent(statement))) is g for g in analysis.guards):
        return None  # `try: from apex import amp / except ImportError: amp = None`: the rewrite drops it
    return hit(guard=guard)


def in_enabled_body(analysis: Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of an `if <flag>:` with amp.initialize's flag: an amp import
    there only ran where amp was on, and the rewrite removes it."""
    return id(analysis.parent(analysis.statement_of(node))) in analysis.enabled_bodies


def in_guard_if(analysis: Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of the `if <condition>:` that guards amp.initialize."""
    guard_if = analysis.guard_if
    return guard_if is not None and analysis.parent(analysis.parent(analysis.statement_of(node))) is guard_if


def unreachable_use(analysis: Analysis, node: cst.CSTNode) -> Hit | None:
    assert isinstance(node, cst.Attribute) and analysis.home is not None and analysis.scopes is not None
    if node.attr.value not in NEED_THE_SCALER:
        return None
    why = unreachable(analysis.scopes, analysis.home, node, analysis.model, analysis.optimizer)
    return None if why is None else hit(name=node.attr.value, why=why)


def not_rewritten(analysis: Analysis, node: cst.CSTNode) -> Hit | None:
    assert isinstance(node, cst.Attribute)
    return None if node.attr.value in REWRITTEN_USES else hit(name=node.attr.value)


def scale_loss_shape(analysis: Analysis, attribute: cst.CSTNode) -> tuple[object, object, object]:
    call = analysis.parent(attribute)
    item = analysis.parent(call) if isinstance(call, cst.Call) else None
    block = analysis.parent(item) if isinstance(item, cst.WithItem) else None
    return call, item, block


def scale_loss_not_in_with(analysis: Analysis, attribute: cst.CSTNode) -> bool:
    call, _, block = scale_loss_shape(analysis, attribute)
    return not isinstance(call, cst.Call) or not isinstance(block, cst.With) or len(block.items) != 1


def scale_loss_without_as(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    call, item, _ = scale_loss_shape(analysis, attribute)
    named = isinstance(item, cst.WithItem) and item.asname is not None and isinstance(item.asname.name, cst.Name)
    return None if named else hit(call)  # type: ignore[arg-type]


def scale_loss_one_line(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    call, _, block = scale_loss_shape(analysis, attribute)
    assert isinstance(block, cst.With)
    return None if isinstance(block.body, cst.IndentedBlock) else hit(call)  # type: ignore[arg-type]


def scale_loss_unreadable(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    return None if id(attribute) in analysis.scale_loss else hit(analysis.parent(attribute))


def scale_loss_argument(name: str, allowed: tuple[object, ...]) -> Test:
    def test(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
        args = next(a for c, _, a in analysis.scale_loss.values() if c is call)
        return None if literal(args.get(name)) in allowed else hit()

    return test


def other_optimizer(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    optimizers = next(a for c, _, a in analysis.scale_loss.values() if c is call).get("optimizers")
    if not analysis.optimizer:  # amp.initialize's own arguments could not be read: refused for that
        return None
    if optimizers is not None and _cst.code(optimizers) == analysis.optimizer:
        return None
    return hit(optimizer=analysis.optimizer or "unknown")


def clipping(analysis: Analysis, attribute: cst.CSTNode) -> cst.Call | None:
    call = analysis.parent(attribute)
    arg = analysis.parent(call) if isinstance(call, cst.Call) else None
    clip = analysis.parent(arg) if isinstance(arg, cst.Arg) else None
    name = _cst.dotted(clip.func) if isinstance(clip, cst.Call) else None
    return clip if name is not None and name.endswith(CLIP_FUNCTIONS) else None  # type: ignore[return-value]


def master_params_of_other(analysis: Analysis, attribute: cst.CSTNode) -> bool:
    call = analysis.parent(attribute)
    return not isinstance(call, cst.Call) or len(call.args) != 1 or _cst.code(call.args[0].value) != analysis.optimizer


def not_called(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    assert isinstance(attribute, cst.Attribute)
    return None if isinstance(analysis.parent(attribute), cst.Call) else hit(name=attribute.attr.value)


def load_arguments(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    call = analysis.parent(attribute)
    if isinstance(call, cst.Call) and (len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star):
        return hit(call)
    return None


def loss_scale_read(amp: str) -> m.Call:
    """``amp._amp_state.loss_scalers[0].loss_scale()``: Apex's one loss scaler's current scale, which is
    GradScaler's ``get_scale()``."""
    state = m.Attribute(value=m.Name(amp), attr=m.Name("_amp_state"))
    scalers = m.Subscript(
        value=m.Attribute(value=state, attr=m.Name("loss_scalers")),
        slice=[m.SubscriptElement(slice=m.Index(value=m.Integer(value="0")))],
    )
    return m.Call(func=m.Attribute(value=scalers, attr=m.Name("loss_scale")), args=[])


def loss_scale_call(analysis: Analysis, attribute: cst.CSTNode) -> cst.Call | None:
    """The call ``attribute`` (``amp._amp_state``) starts, if it is :func:`loss_scale_read`."""
    node: cst.CSTNode | None = attribute
    for _ in range(4):  # .loss_scalers, [0], .loss_scale, ()
        node = analysis.parents.get(node) if node is not None else None
    if isinstance(node, cst.Call) and m.matches(node, loss_scale_read(analysis.amp)):
        return node
    return None


def scale_read_early(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    """Apex updates its scale when the scale_loss block exits, GradScaler at ``scaler.update()`` after the step,
    so the two differ between the block and the step of an overflowing iteration."""
    call = loss_scale_call(analysis, attribute)
    if call is None or not analysis.after_a_block_before_a_step(call, analysis.steps):
        return None
    return hit(call)


def no_step(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    return hit(optimizer=analysis.optimizer) if not analysis.optimizer_steps and analysis.optimizer else None


def unreachable_step(analysis: Analysis, step: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    why = unreachable(analysis.scopes, analysis.home, step, analysis.model, analysis.optimizer)
    return None if why is None else hit(why=why)


def init_statement(analysis: Analysis) -> cst.CSTNode:
    assert analysis.init is not None
    return analysis.statement_of(analysis.init)


def slots(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    owner = analysis.scopes.class_of(analysis.home.function)
    if analysis.home.kind == "attribute" and owner is not None and "__slots__" in class_names(owner):
        return hit(init_statement(analysis), owner=owner.name.value)
    return None


def class_names(owner: cst.ClassDef) -> set[str]:
    """The names a class body assigns directly (``__slots__ = ...``)."""
    body = owner.body.body if isinstance(owner.body, cst.IndentedBlock) else []
    return {
        _cst.code(t.target)
        for statement in body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.Assign)
        for t in small.targets
    }


def reassigned(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    statement = init_statement(analysis)
    # the model is not: autocast casts whatever module runs under it (a DataParallel wrapper too), as Apex's O1
    # patched every function, and neither keeps the model; the GradScaler steps the optimizer it is given
    names = (analysis.optimizer,)
    why = assigned_again(analysis.scopes, analysis.home, names, analysis.line(statement), analysis.line)
    return None if why is None else hit(statement, why=why)


def flag_differs(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    """`if <flag>:` in another function means amp.initialize's flag only where the flag's name means the same
    object there."""
    flag, home, scopes = analysis.condition, analysis.home, analysis.scopes
    if flag is None or home is None or scopes is None:
        return None
    base = flag.split(".")[0]
    tests = {id(analysis.function_of(i)) for i in analysis.ifs if _cst.dotted(i.test) == flag or negates(i.test, flag)}
    for use in elsewhere(analysis):
        where = scopes.function_of(use)
        if id(where) in tests and not same_binding(scopes, home, where, base):
            name = where.name.value if isinstance(where, cst.FunctionDef) else "<module>"
            return hit(use, base=base, function=name, flag=flag, home=home.describe())
    return None


def flag_assigned_elsewhere(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    """No other function may assign the flag's attribute (or the flag, declared global)."""
    flag, scopes = analysis.condition, analysis.scopes
    if flag is None or scopes is None:
        return None
    for target in analysis.assignments:
        code, function = _cst.code(target), scopes.function_of(target)
        rebinds = "." in code or code in declared_global(function)  # a bare name elsewhere is that function's own
        before = analysis.home is not None and set_before_home(scopes, analysis.home, target)
        if rebinds and code in prefixes(flag) and function is not analysis.init_function and not before:
            return hit(target, flag=flag, code=code)
    return None


def runs_late(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    if analysis.guard_if is None or analysis.home is None or analysis.scopes is None:
        return None
    scopes = analysis.scopes
    users = {
        f.name.value for f in (scopes.function_of(u) for u in elsewhere(analysis)) if isinstance(f, cst.FunctionDef)
    }
    owner = scopes.class_of(analysis.home.function)
    early = runs_first(analysis.module, analysis.home, analysis.guard_if, users, owner)
    return None if early is None else hit(analysis.guard_if, why=early)


def step_before_initialize(analysis: Analysis, step: cst.CSTNode) -> bool:
    assert analysis.init is not None
    start, where = analysis.positions[analysis.init].start, analysis.positions[step].start
    return analysis.function_of(step) is analysis.init_function and (where.line, where.column) < (
        start.line,
        start.column,
    )


def step_without_scale_loss(analysis: Analysis, step: cst.CSTNode) -> bool:
    function, path = analysis.function_of(step), analysis.path(step)
    blocks = [b for b in analysis.scale_blocks if analysis.function_of(b) is function]
    before = [b for b in blocks if analysis.positions[b].start.line < analysis.positions[step].start.line]
    return not before or any(analysis.path(b)[::-1] != path[::-1][: len(analysis.path(b))] for b in before)


def unscaled_backward(analysis: Analysis, call: cst.CSTNode) -> bool:
    stepping = {id(analysis.function_of(s)) for s in analysis.optimizer_steps} | {id(analysis.init_function)}
    if id(analysis.function_of(call)) not in stepping:
        return False
    scaled = {id(b) for b in analysis.scale_blocks}
    current: cst.CSTNode | None = call
    while current is not None and id(current) not in scaled:
        current = analysis.parents.get(current)
    return current is None and not set(analysis.blocks(call)) & analysis.disabled_bodies


def other_clipping(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    assert isinstance(call, cst.Call)
    name = _cst.dotted(call.func)
    looping = {id(analysis.function_of(s)) for s in analysis.optimizer_steps}
    looping |= {id(analysis.function_of(b)) for b in analysis.scale_blocks}
    if name is None or not name.endswith(CLIP_FUNCTIONS) or id(analysis.function_of(call)) not in looping:
        return None
    first = call.args[0].value if call.args else None
    if _cst.method_call(first, analysis.amp, "master_params") is not None:
        return None
    return None if set(analysis.blocks(call)) & analysis.disabled_bodies else hit(name=name)


def grads_by_hand(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    for use in analysis.grads:
        scaled = analysis.after_a_block_before_a_step(use, analysis.optimizer_steps)
        if scaled and not set(analysis.blocks(use)) & analysis.disabled_bodies:
            return hit(use)
    return None


def master_params_twice(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    seen: set[int] = set()
    for name, node in analysis.uses:
        if name != "master_params":
            continue
        function = id(analysis.function_of(node))
        if function in seen:
            return hit(node)
        seen.add(function)
    return None


def _step_follows(analysis: Analysis, node: cst.CSTNode) -> bool:
    """Whether an optimizer step follows ``node`` in its function, in the same block (on every path it takes)."""
    function, line, path = analysis.function_of(node), analysis.line(node), analysis.path(node)
    return any(
        analysis.function_of(s) is function and analysis.line(s) > line and analysis.path(s) == path
        for s in analysis.optimizer_steps
    )


def clipping_helper(analysis: Analysis, node: cst.CSTNode) -> cst.FunctionDef | None:
    """The function around an ``amp.master_params`` clipping that neither steps nor scales a loss (a trainer's
    ``clip_gradients()``): whether its scaler.unscale_() runs once per step depends on its callers."""
    function = analysis.function_of(node)
    if not isinstance(function, cst.FunctionDef) or _step_follows(analysis, node):
        return None
    inside = {id(analysis.function_of(n)) for n in [*analysis.optimizer_steps, *analysis.scale_blocks]}
    return None if id(function) in inside else function


def master_params_without_step(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    for name, node in analysis.uses:
        if name == "master_params" and clipping_helper(analysis, node) is None and not _step_follows(analysis, node):
            return hit(node)
    return None


def helper_unproven(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    """A clipping helper is migrated when each of its runs is one clipping between a scale_loss block and the
    step it precedes: outside loops in the helper, called (and named) only as ``self.<helper>()`` or
    ``<helper>()`` on a line of its own, once per function, after a scale_loss block and followed by the step in
    the same block. Then the scaler.unscale_() put before the clipping runs once before each scaler.step()."""
    for name, node in analysis.uses:
        helper = clipping_helper(analysis, node) if name == "master_params" else None
        why = None if helper is None else _helper_why(analysis, helper, node)
        if why is not None:
            assert helper is not None
            return hit(node, helper=helper.name.value, why=why)
    return None


def _helper_why(analysis: Analysis, helper: cst.FunctionDef, clipping: cst.CSTNode) -> str | None:
    name = helper.name.value
    current: cst.CSTNode | None = clipping
    while current is not None and current is not helper:
        if isinstance(current, (cst.For, cst.While)):
            return "it clips in a loop"
        current = analysis.parents.get(current)
    owner = first_param(helper) if analysis.scopes and analysis.scopes.class_of(helper) else None
    callers: set[int] = set()
    for reference in analysis.parents:
        if not isinstance(reference, cst.Name) or reference.value != name or reference is helper.name:
            continue
        called = _called_as_helper(analysis, reference, owner)
        line = analysis.line(reference)
        if called is None:
            return f"`{name}` is used other than by a call on a line of its own (line {line})"
        caller = analysis.function_of(called)
        if id(caller) in callers or any(
            analysis.function_of(n) is caller for u, n in analysis.uses if u == "master_params"
        ):
            return f"it may run twice before one step (line {line})"
        if not analysis.after_a_block_before_a_step(called, analysis.optimizer_steps) or not _step_follows(
            analysis, called
        ):
            return f"its call at line {line} is not between a scale_loss block and an optimizer step of the same block"
        callers.add(id(caller))
    return None if callers else "it is not called in this file"


def _called_as_helper(analysis: Analysis, reference: cst.Name, owner: str | None) -> cst.Call | None:
    """The call ``reference`` names, if it is ``<owner>.<helper>()`` (``<helper>()`` for a plain function) and
    the whole statement of its line."""
    parent = analysis.parent(reference)
    func: cst.CSTNode = reference
    if owner is not None:
        if not (isinstance(parent, cst.Attribute) and parent.attr is reference and _cst.code(parent.value) == owner):
            return None
        func, parent = parent, analysis.parent(parent)
    if not isinstance(parent, cst.Call) or parent.func is not func or parent.args:
        return None
    expression = analysis.parent(parent)
    return parent if isinstance(expression, cst.Expr) and analysis.alone_on_its_line(parent) else None
