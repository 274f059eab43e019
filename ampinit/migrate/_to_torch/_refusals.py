"""Every reason ``--to torch`` leaves a file to ``--to ampinit``, as a table: one :class:`Refusal` a row, run in
one loop (:func:`run`) over the facts of :class:`~._analysis.Analysis`.

A row names the nodes it applies to, a test over one of them (which says where to report it and the values its
reason text is filled with), the reason text, and a file that exactly this row refuses (``example``; the tests run
every row's example). Rows of one ``chain`` are alternatives for a node, in order: the first that applies is
reported (a call that is not there cannot also have the wrong arguments). The order of the rows is the order of
the reasons on one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ampinit.migrate import _cst
from ampinit.migrate._reach import assigned_again, declared_global, runs_first, same_binding, unreachable
from ampinit.migrate._report import Site
from ampinit.migrate._to_torch import _examples as ex
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
NO_NATIVE = {
    "cast_model_type": "cast_model_type casts the model's weights (O2/O3): torch.amp has no half model",
    "patch_torch_functions": "patch_torch_functions is O1's switch: keep the default",
    "keep_batchnorm_fp32": "keep_batchnorm_fp32 describes a cast model (O2/O3): no native equivalent",
    "master_weights": "fp32 master weights (O2) have no native equivalent",
    "cast_model_outputs": "cast_model_outputs has no native equivalent: cast the outputs by hand",
    "min_loss_scale": "GradScaler has no loss-scale floor",
    "max_loss_scale": "GradScaler has no loss-scale ceiling",
}
NOT_ALONE = (
    "shares its line with other statements, or is the one-line body of an `if`/`for`/`with` "
    "(`if cond: optimizer.step()`), which the rewrite does not handle"
)


@dataclass(frozen=True)
class Hit:
    """A row applies: where to report it (``at``; the node tested when None) and its reason's values."""

    at: cst.CSTNode | None = None
    fields: Mapping[str, object] = field(default_factory=dict)


def hit(at: cst.CSTNode | None = None, **fields: object) -> Hit:
    return Hit(at, fields)


Nodes = Callable[[Analysis], Iterable[cst.CSTNode]]
Test = Callable[[Analysis, cst.CSTNode], "Hit | None"]


@dataclass(frozen=True)
class Refusal:
    """One reason to refuse: ``reason`` (a ``str.format`` text over the hit's fields) is reported at every node of
    ``applies_to`` that ``test`` hits. ``alone``: tested only in a file no earlier row refused (the row
    over-refuses where another reason already stands)."""

    name: str
    applies_to: Nodes
    test: Test
    reason: str
    example: str
    chain: str = ""
    alone: bool = False
    needs_initialize: bool = True  # tested only in a file with exactly one amp.initialize


@dataclass(frozen=True)
class Found:
    refusal: Refusal
    site: Site


def run(analysis: Analysis, table: Iterable[Refusal]) -> list[Found]:
    """Every row of ``table`` over ``analysis``, in order; sorted by line (stable: one line keeps the rows' order)."""
    found: list[Found] = []
    chains: set[tuple[str, int]] = set()
    for row in table:
        if (row.needs_initialize and analysis.init is None) or (row.alone and found):
            continue
        for node in row.applies_to(analysis):
            if row.chain and (row.chain, id(node)) in chains:
                continue
            result = row.test(analysis, node)
            if result is None:
                continue
            if row.chain:
                chains.add((row.chain, id(node)))
            analysis.refused.setdefault(id(node), set()).add(row.name)
            at = node if result.at is None else result.at
            found.append(Found(row, Site(analysis.line(at), row.reason.format(**result.fields), needs_human=True)))
    return sorted(found, key=lambda f: f.site.line)


# -- the nodes rows apply to -----------------------------------------------------------------------------------------
def _args_unknown(analysis: Analysis) -> bool:
    assert analysis.init_call is not None
    return call_args(analysis.init_call, APEX_SIGNATURE) is None


def _file(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.module]


def _optimizers_given(analysis: Analysis) -> bool:
    """Whether ``amp.initialize`` is given an optimizer (not ``None``, not left out); True where its arguments
    cannot be read (refused for that)."""
    assert analysis.init_call is not None
    args = call_args(analysis.init_call, APEX_SIGNATURE)
    return args is None or literal(args.get("optimizers")) is not None


def _initialize(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.init] if analysis.init is not None else []


def _readable_initialize(analysis: Analysis) -> list[cst.CSTNode]:
    """``amp.initialize`` called with arguments that can be read, one model and one optimizer."""
    return [analysis.init_call] if analysis.init_args is not None and analysis.init_call is not None else []


def _uses(*names: str) -> Nodes:
    return lambda analysis: [node for name, node in analysis.uses if name in names]


def _other_uses(analysis: Analysis) -> list[cst.CSTNode]:
    return [node for name, node in analysis.uses if name != "initialize"]


def _readable_scale_loss(analysis: Analysis) -> list[cst.CSTNode]:
    return [analysis.scale_loss[id(n)][0] for name, n in analysis.uses if id(n) in analysis.scale_loss]


def _steps(analysis: Analysis) -> list[cst.CSTNode]:
    return list(analysis.optimizer_steps)


def _amp_imports(analysis: Analysis) -> list[cst.CSTNode]:
    return [i for i in analysis.imports if imports_amp(i)]


def _bare(analysis: Analysis) -> list[cst.CSTNode]:
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


def _backwards(analysis: Analysis) -> list[cst.CSTNode]:
    return list(analysis.backwards)


def _calls(analysis: Analysis) -> list[cst.CSTNode]:
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


def _when_shared(analysis: Analysis) -> list[cst.CSTNode]:
    """amp used in other functions than amp.initialize's: they must mean the objects it returned, and with
    amp.initialize under `if <flag>:`, the GradScaler must exist before any of them can run."""
    return [analysis.module] if elsewhere(analysis) else []


# -- the tests -------------------------------------------------------------------------------------------------------
def _when(predicate: Callable[[Analysis, cst.CSTNode], bool]) -> Test:
    return lambda analysis, node: hit() if predicate(analysis, node) else None


def _option(name: str) -> Test:
    def test(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
        args = analysis.init_args or {}
        return hit() if name in args and literal(args[name]) is not None else None

    return test


def _level_half(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    level = analysis.level_value
    return hit(level=repr(level)) if level not in ("O0", "O1") and level is not NOT_LITERAL else None


def _level_unknown(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    if analysis.level_value is not NOT_LITERAL:
        return None
    return hit(why=f" ({analysis.level_why})" if analysis.level_why else "")


def _static_scale(analysis: Analysis, call: cst.CSTNode) -> bool:
    scale = literal((analysis.init_args or {}).get("loss_scale"))
    return scale not in (None, "dynamic") and not (analysis.level == "O0" and scale == 1.0)


def _not_unpacked(analysis: Analysis, call: cst.CSTNode) -> bool:
    statement = analysis.parent(call)
    if not isinstance(statement, cst.Assign):
        return False
    target = statement.targets[0].target
    return not (isinstance(target, cst.Tuple) and len(target.elements) == 2)


def _on_some_paths(analysis: Analysis, init: cst.CSTNode) -> Hit | None:
    guard = analysis.guard(init)
    return hit(guard=guard) if guard is not None and analysis.flag is None else None


def _flag_reassigned(analysis: Analysis, init: cst.CSTNode) -> Hit | None:
    if not analysis.flag_changes:
        return None
    return hit(analysis.flag_if, flag=analysis.flag, changed=analysis.flag_changes[0])


def _guarded_import(analysis: Analysis, statement: cst.CSTNode) -> Hit | None:
    guard = analysis.guard(statement)
    if guard is None or _in_guard_if(analysis, statement) or _in_enabled_body(analysis, statement):
        return None
    if any(analysis.parent(analysis.parent(analysis.parent(statement))) is g for g in analysis.guards):
        return None  # `try: from apex import amp / except ImportError: amp = None`: the rewrite drops it
    return hit(guard=guard)


def _in_enabled_body(analysis: Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of an `if <flag>:` with amp.initialize's flag: an amp import
    there only ran where amp was on, and the rewrite removes it."""
    return id(analysis.parent(analysis.statement_of(node))) in analysis.enabled_bodies


def _in_guard_if(analysis: Analysis, node: cst.CSTNode) -> bool:
    """Whether ``node`` sits directly in the body of the `if <condition>:` that guards amp.initialize."""
    guard_if = analysis.guard_if
    return guard_if is not None and analysis.parent(analysis.parent(analysis.statement_of(node))) is guard_if


def _unreachable_use(analysis: Analysis, node: cst.CSTNode) -> Hit | None:
    assert isinstance(node, cst.Attribute) and analysis.home is not None and analysis.scopes is not None
    if node.attr.value not in NEED_THE_SCALER:
        return None
    why = unreachable(analysis.scopes, analysis.home, node, analysis.model, analysis.optimizer)
    return None if why is None else hit(name=node.attr.value, why=why)


def _not_rewritten(analysis: Analysis, node: cst.CSTNode) -> Hit | None:
    assert isinstance(node, cst.Attribute)
    return None if node.attr.value in REWRITTEN_USES else hit(name=node.attr.value)


def _scale_loss_shape(analysis: Analysis, attribute: cst.CSTNode) -> tuple[object, object, object]:
    call = analysis.parent(attribute)
    item = analysis.parent(call) if isinstance(call, cst.Call) else None
    block = analysis.parent(item) if isinstance(item, cst.WithItem) else None
    return call, item, block


def _scale_loss_not_in_with(analysis: Analysis, attribute: cst.CSTNode) -> bool:
    call, _, block = _scale_loss_shape(analysis, attribute)
    return not isinstance(call, cst.Call) or not isinstance(block, cst.With) or len(block.items) != 1


def _scale_loss_without_as(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    call, item, _ = _scale_loss_shape(analysis, attribute)
    named = isinstance(item, cst.WithItem) and item.asname is not None and isinstance(item.asname.name, cst.Name)
    return None if named else hit(call)  # type: ignore[arg-type]


def _scale_loss_one_line(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    call, _, block = _scale_loss_shape(analysis, attribute)
    assert isinstance(block, cst.With)
    return None if isinstance(block.body, cst.IndentedBlock) else hit(call)  # type: ignore[arg-type]


def _scale_loss_unreadable(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    return None if id(attribute) in analysis.scale_loss else hit(analysis.parent(attribute))


def _scale_loss_argument(name: str, allowed: tuple[object, ...]) -> Test:
    def test(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
        args = next(a for c, _, a in analysis.scale_loss.values() if c is call)
        return None if literal(args.get(name)) in allowed else hit()

    return test


def _other_optimizer(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
    optimizers = next(a for c, _, a in analysis.scale_loss.values() if c is call).get("optimizers")
    if not analysis.optimizer:  # amp.initialize's own arguments could not be read: refused for that
        return None
    if optimizers is not None and _cst.code(optimizers) == analysis.optimizer:
        return None
    return hit(optimizer=analysis.optimizer or "unknown")


def _clipping(analysis: Analysis, attribute: cst.CSTNode) -> cst.Call | None:
    call = analysis.parent(attribute)
    arg = analysis.parent(call) if isinstance(call, cst.Call) else None
    clip = analysis.parent(arg) if isinstance(arg, cst.Arg) else None
    name = _cst.dotted(clip.func) if isinstance(clip, cst.Call) else None
    return clip if name is not None and name.endswith(CLIP_FUNCTIONS) else None  # type: ignore[return-value]


def _master_params_of_other(analysis: Analysis, attribute: cst.CSTNode) -> bool:
    call = analysis.parent(attribute)
    return not isinstance(call, cst.Call) or len(call.args) != 1 or _cst.code(call.args[0].value) != analysis.optimizer


def _not_called(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    assert isinstance(attribute, cst.Attribute)
    return None if isinstance(analysis.parent(attribute), cst.Call) else hit(name=attribute.attr.value)


def _load_arguments(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
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


def _scale_read_early(analysis: Analysis, attribute: cst.CSTNode) -> Hit | None:
    """Apex updates its scale when the scale_loss block exits, GradScaler at ``scaler.update()`` after the step,
    so the two differ between the block and the step of an overflowing iteration."""
    call = loss_scale_call(analysis, attribute)
    if call is None or not analysis.after_a_block_before_a_step(call, analysis.steps):
        return None
    return hit(call)


def _no_step(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    return hit(optimizer=analysis.optimizer) if not analysis.optimizer_steps and analysis.optimizer else None


def _unreachable_step(analysis: Analysis, step: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    why = unreachable(analysis.scopes, analysis.home, step, analysis.model, analysis.optimizer)
    return None if why is None else hit(why=why)


def _init_statement(analysis: Analysis) -> cst.CSTNode:
    assert analysis.init is not None
    return analysis.statement_of(analysis.init)


def _slots(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    owner = analysis.scopes.class_of(analysis.home.function)
    if analysis.home.kind == "attribute" and owner is not None and "__slots__" in _class_names(owner):
        return hit(_init_statement(analysis), owner=owner.name.value)
    return None


def _class_names(owner: cst.ClassDef) -> set[str]:
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


def _assigned_again(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    assert analysis.home is not None and analysis.scopes is not None
    statement = _init_statement(analysis)
    # the model is not: autocast casts whatever module runs under it (a DataParallel wrapper too), as Apex's O1
    # patched every function, and neither keeps the model; the GradScaler steps the optimizer it is given
    names = (analysis.optimizer,)
    why = assigned_again(analysis.scopes, analysis.home, names, analysis.line(statement), analysis.line)
    return None if why is None else hit(statement, why=why)


def _flag_differs(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
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


def _flag_assigned_elsewhere(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    """No other function may assign the flag's attribute (or the flag, declared global)."""
    flag, scopes = analysis.condition, analysis.scopes
    if flag is None or scopes is None:
        return None
    for target in analysis.assignments:
        code, function = _cst.code(target), scopes.function_of(target)
        rebinds = "." in code or code in declared_global(function)  # a bare name elsewhere is that function's own
        if rebinds and code in prefixes(flag) and function is not analysis.init_function:
            return hit(target, flag=flag, code=code)
    return None


def _runs_late(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    if analysis.guard_if is None or analysis.home is None or analysis.scopes is None:
        return None
    scopes = analysis.scopes
    users = {
        f.name.value for f in (scopes.function_of(u) for u in elsewhere(analysis)) if isinstance(f, cst.FunctionDef)
    }
    owner = scopes.class_of(analysis.home.function)
    early = runs_first(analysis.module, analysis.home, analysis.guard_if, users, owner)
    return None if early is None else hit(analysis.guard_if, why=early)


def _step_before_initialize(analysis: Analysis, step: cst.CSTNode) -> bool:
    assert analysis.init is not None
    start, where = analysis.positions[analysis.init].start, analysis.positions[step].start
    return analysis.function_of(step) is analysis.init_function and (where.line, where.column) < (
        start.line,
        start.column,
    )


def _step_without_scale_loss(analysis: Analysis, step: cst.CSTNode) -> bool:
    function, path = analysis.function_of(step), analysis.path(step)
    blocks = [b for b in analysis.scale_blocks if analysis.function_of(b) is function]
    before = [b for b in blocks if analysis.positions[b].start.line < analysis.positions[step].start.line]
    return not before or any(analysis.path(b)[::-1] != path[::-1][: len(analysis.path(b))] for b in before)


def _unscaled_backward(analysis: Analysis, call: cst.CSTNode) -> bool:
    stepping = {id(analysis.function_of(s)) for s in analysis.optimizer_steps} | {id(analysis.init_function)}
    if id(analysis.function_of(call)) not in stepping:
        return False
    scaled = {id(b) for b in analysis.scale_blocks}
    current: cst.CSTNode | None = call
    while current is not None and id(current) not in scaled:
        current = analysis.parents.get(current)
    return current is None and not set(analysis.blocks(call)) & analysis.disabled_bodies


def _other_clipping(analysis: Analysis, call: cst.CSTNode) -> Hit | None:
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


def _grads_by_hand(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    for use in analysis.grads:
        scaled = analysis.after_a_block_before_a_step(use, analysis.optimizer_steps)
        if scaled and not set(analysis.blocks(use)) & analysis.disabled_bodies:
            return hit(use)
    return None


def _master_params_twice(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    seen: set[int] = set()
    for name, node in analysis.uses:
        if name != "master_params":
            continue
        function = id(analysis.function_of(node))
        if function in seen:
            return hit(node)
        seen.add(function)
    return None


def _master_params_without_step(analysis: Analysis, module: cst.CSTNode) -> Hit | None:
    for name, node in analysis.uses:
        if name != "master_params":
            continue
        function, line, path = analysis.function_of(node), analysis.line(node), analysis.path(node)
        if not any(
            analysis.function_of(s) is function and analysis.line(s) > line and analysis.path(s) == path
            for s in analysis.optimizer_steps
        ):
            return hit(node)
    return None


REFUSALS: tuple[Refusal, ...] = (
    # -- one amp.initialize ------------------------------------------------------------------------------------------
    Refusal(
        "initialize_twice",
        lambda a: a.inits[1:2],
        _when(lambda a, n: True),
        "amp.initialize is called more than once: one GradScaler per call is a human's call",
        ex.INITIALIZE_TWICE,
        needs_initialize=False,
    ),
    Refusal(
        "no_initialize",
        _file,
        _when(lambda a, n: not a.inits),
        "no amp.initialize call found",
        ex.NO_INITIALIZE,
        needs_initialize=False,
    ),
    # -- its arguments -----------------------------------------------------------------------------------------------
    Refusal(
        "initialize_not_called",
        _initialize,
        _when(lambda a, n: a.init_call is None),
        "amp.initialize is used without being called",
        ex.INITIALIZE_NOT_CALLED,
    ),
    Refusal(
        "initialize_star_args",
        _initialize,
        lambda a, n: hit(a.init_call) if a.init_call is not None and _args_unknown(a) else None,
        "amp.initialize(*args/**kwargs): the options cannot be read statically",
        ex.INITIALIZE_STAR_ARGS,
    ),
    Refusal(
        "initialize_not_one_model",
        _initialize,
        lambda a, n: (
            hit(a.init_call)
            if a.init_call is not None and a.init_args is None and not _args_unknown(a) and _optimizers_given(a)
            else None
        ),
        "amp.initialize needs exactly one model and one optimizer (no lists) for --to torch",
        ex.INITIALIZE_LISTS,
    ),
    Refusal(
        "initialize_without_optimizer",
        _initialize,
        lambda a, n: hit(a.init_call) if a.init_call is not None and not _optimizers_given(a) else None,
        "amp.initialize without an optimizer prepares a model for inference only: there is no loop for a "
        "GradScaler; put its forward passes under torch.autocast by hand, or use --to ampinit",
        ex.INITIALIZE_WITHOUT_OPTIMIZER,
    ),
    Refusal(
        "opt_level_half",
        _readable_initialize,
        _level_half,
        "opt_level={level} keeps a half-precision model (and fp32 master weights for O2): no native equivalent",
        ex.OPT_LEVEL_HALF,
    ),
    Refusal(
        "opt_level_unknown",
        _readable_initialize,
        _level_unknown,
        "opt_level is not a literal: the native equivalent exists only for O0 and O1{why}",
        ex.OPT_LEVEL_UNKNOWN,
    ),
    *(
        Refusal(f"initialize_{name}", _readable_initialize, _option(name), reason, ex.initialize_with(name))
        for name, reason in NO_NATIVE.items()
    ),
    Refusal(
        "num_losses",
        _readable_initialize,
        _when(lambda a, n: literal((a.init_args or {}).get("num_losses")) not in (None, 1)),
        "num_losses > 1: GradScaler has one scale for all losses, not one per loss",
        ex.NUM_LOSSES,
    ),
    Refusal(
        "static_loss_scale",
        _readable_initialize,
        _when(_static_scale),
        "a static loss_scale: GradScaler only scales dynamically (and skips steps on inf)",
        ex.STATIC_LOSS_SCALE,
    ),
    Refusal(
        "initialize_in_expression",
        _readable_initialize,
        _when(lambda a, n: not isinstance(a.parent(n), (cst.Assign, cst.Expr))),
        "amp.initialize inside an expression: rewrite it by hand",
        ex.INITIALIZE_IN_EXPRESSION,
    ),
    Refusal(
        "initialize_not_alone",
        _readable_initialize,
        _when(lambda a, n: isinstance(a.parent(n), (cst.Assign, cst.Expr)) and not a.alone_on_its_line(n)),
        f"amp.initialize {NOT_ALONE}: put it on a line of its own",
        ex.INITIALIZE_NOT_ALONE,
    ),
    Refusal(
        "initialize_not_unpacked",
        _readable_initialize,
        _when(_not_unpacked),
        "amp.initialize's result is not unpacked into (model, optimizer)",
        ex.INITIALIZE_NOT_UNPACKED,
    ),
    # -- the `if <flag>:` around it ----------------------------------------------------------------------------------
    Refusal(
        "initialize_on_some_paths",
        _initialize,
        _on_some_paths,
        "amp.initialize runs only on some paths (it sits under `{guard}`, not directly under a plain "
        "`if <flag>:`): on the others the rewritten scaler.step()/scaler.scale() would have no GradScaler; "
        "create the GradScaler unconditionally with enabled=<the condition> by hand, or use --to ampinit",
        ex.INITIALIZE_ON_SOME_PATHS,
    ),
    Refusal(
        "flag_assigned_again",
        _initialize,
        _flag_reassigned,
        "the flag `{flag}` that guards amp.initialize is assigned again later ({changed}): the GradScaler's "
        "enabled= could not follow it; rewrite by hand, or use --to ampinit",
        ex.FLAG_ASSIGNED_AGAIN,
    ),
    Refusal(
        "apex_import_guarded",
        _amp_imports,
        _guarded_import,
        "the Apex import sits under `{guard}` (an availability guard or a switch): after the rewrite the "
        "import could not fail or be skipped any more, so the code's other path would change; rewrite the "
        "guard by hand, or use --to ampinit",
        ex.APEX_IMPORT_GUARDED,
    ),
    # -- each amp use ------------------------------------------------------------------------------------------------
    Refusal(
        "amp_use_unreachable",
        _other_uses,
        _unreachable_use,
        "amp.{name}: {why}",
        ex.AMP_USE_UNREACHABLE,
    ),
    Refusal(
        "amp_as_object",
        _bare,
        lambda a, n: hit(a.statement_of(n), code=_cst.code(a.statement_of(n)).strip().splitlines()[0]),
        "the amp module is used as an object (`{code}`), not through its functions: after the rewrite the name "
        "would be unbound, and no native object stands in for it; rewrite it by hand, or use --to ampinit",
        ex.AMP_AS_OBJECT,
    ),
    Refusal(
        "amp_use_not_native",
        _other_uses,
        _not_rewritten,
        "amp.{name} has no native torch.amp equivalent",
        ex.AMP_USE_NOT_NATIVE,
    ),
    Refusal(
        "scale_loss_not_in_with",
        _uses("scale_loss"),
        _when(_scale_loss_not_in_with),
        "amp.scale_loss outside a single-item `with` statement",
        ex.SCALE_LOSS_NOT_IN_WITH,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_without_as",
        _uses("scale_loss"),
        _scale_loss_without_as,
        "`with amp.scale_loss(...)` without `as name`",
        ex.SCALE_LOSS_WITHOUT_AS,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_one_line",
        _uses("scale_loss"),
        _scale_loss_one_line,
        "`with amp.scale_loss(...) as s: s.backward()` on one line: put the body on its own line",
        ex.SCALE_LOSS_ONE_LINE,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_star_args",
        _uses("scale_loss"),
        _scale_loss_unreadable,
        "amp.scale_loss(*args/**kwargs): the arguments cannot be read statically",
        ex.SCALE_LOSS_STAR_ARGS,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_other_optimizer",
        _readable_scale_loss,
        _other_optimizer,
        "amp.scale_loss is given another optimizer than the initialized one ({optimizer})",
        ex.SCALE_LOSS_OTHER_OPTIMIZER,
    ),
    Refusal(
        "loss_id",
        _readable_scale_loss,
        _scale_loss_argument("loss_id", (None, 0)),
        "loss_id selects one of several loss scalers: GradScaler has one scale",
        ex.LOSS_ID,
    ),
    Refusal(
        "delay_unscale",
        _readable_scale_loss,
        _scale_loss_argument("delay_unscale", (None, False)),
        "delay_unscale=True: with GradScaler, accumulate with scaler.scale(loss).backward() and call "
        "scaler.step()/update() only on stepping iterations",
        ex.DELAY_UNSCALE,
    ),
    Refusal(
        "delay_overflow_check",
        _readable_scale_loss,
        _scale_loss_argument("delay_overflow_check", (None, False)),
        "delay_overflow_check has no native equivalent",
        ex.DELAY_OVERFLOW_CHECK,
    ),
    Refusal(
        "master_params_outside_clipping",
        _uses("master_params"),
        _when(lambda a, n: _clipping(a, n) is None),
        "amp.master_params outside gradient clipping: unscale with scaler.unscale_() first",
        ex.MASTER_PARAMS_OUTSIDE_CLIPPING,
        chain="master_params",
    ),
    Refusal(
        "master_params_other_optimizer",
        _uses("master_params"),
        _when(_master_params_of_other),
        "amp.master_params of another optimizer than the initialized one",
        ex.MASTER_PARAMS_OTHER_OPTIMIZER,
        chain="master_params",
    ),
    Refusal(
        "master_params_not_alone",
        _uses("master_params"),
        _when(lambda a, n: not a.alone_on_its_line(n)),
        f"clipping amp.master_params {NOT_ALONE}: scaler.unscale_() could not go before it",
        ex.MASTER_PARAMS_NOT_ALONE,
        chain="master_params",
    ),
    Refusal(
        "master_params_in_scale_loss",
        _uses("master_params"),
        _when(lambda a, n: a.in_scale_loss_block(n)),
        "amp.master_params clipped inside the scale_loss block: Apex clips the still-scaled gradients there, "
        "after scaler.unscale_() they would be unscaled; move the clipping after the block by hand",
        ex.MASTER_PARAMS_IN_SCALE_LOSS,
        chain="master_params",
    ),
    Refusal(
        "amp_call_not_called",
        _uses("state_dict", "load_state_dict", "disable_casts"),
        _not_called,
        "amp.{name} used without being called",
        ex.AMP_CALL_NOT_CALLED,
    ),
    Refusal(
        "load_state_dict_arguments",
        _uses("load_state_dict"),
        _load_arguments,
        "amp.load_state_dict with other arguments than one state: rewrite it by hand",
        ex.LOAD_STATE_DICT_ARGUMENTS,
    ),
    Refusal(
        "amp_state_internals",
        _uses("_amp_state"),
        _when(lambda a, n: loss_scale_call(a, n) is None),
        "amp._amp_state has no native torch.amp equivalent (only amp._amp_state.loss_scalers[0].loss_scale() "
        "has: scaler.get_scale())",
        ex.AMP_STATE_INTERNALS,
    ),
    Refusal(
        "loss_scale_read_before_step",
        _uses("_amp_state"),
        _scale_read_early,
        "amp._amp_state.loss_scalers[0].loss_scale() read between the scale_loss block and optimizer.step(): "
        "Apex has updated the scale there, GradScaler updates it after the step; read scaler.get_scale() "
        "after scaler.update() by hand, or use --to ampinit",
        ex.LOSS_SCALE_READ_BEFORE_STEP,
    ),
    # -- the optimizer's steps ---------------------------------------------------------------------------------------
    Refusal(
        "no_step",
        _file,
        _no_step,
        "no {optimizer}.step() found to route through scaler.step()",
        ex.NO_STEP,
    ),
    Refusal(
        "step_with_closure",
        _steps,
        _when(lambda a, n: bool(n.args)),  # type: ignore[attr-defined]
        "optimizer.step(closure): GradScaler.step with a closure is not supported",
        ex.STEP_WITH_CLOSURE,
        chain="step",
    ),
    Refusal(
        "step_in_expression",
        _steps,
        _when(lambda a, n: not isinstance(a.parent(n), (cst.Expr, cst.Assign))),
        "optimizer.step() inside an expression: rewrite to scaler.step(...) by hand",
        ex.STEP_IN_EXPRESSION,
        chain="step",
    ),
    Refusal(
        "step_not_alone",
        _steps,
        _when(lambda a, n: not a.alone_on_its_line(n)),
        f"optimizer.step() {NOT_ALONE}: rewrite to scaler.step(...) by hand",
        ex.STEP_NOT_ALONE,
        chain="step",
    ),
    Refusal(
        "step_in_scale_loss",
        _steps,
        _when(lambda a, n: a.in_scale_loss_block(n)),
        "optimizer.step() inside the scale_loss block: Apex unscales when the block exits, so this step ran "
        "on the scaled gradients; scaler.step() would unscale them first; move the step after the block "
        "by hand (that changes the training), or use --to ampinit",
        ex.STEP_IN_SCALE_LOSS,
        chain="step",
    ),
    Refusal(
        "step_unreachable",
        _steps,
        _unreachable_step,
        "optimizer.step(): {why}",
        ex.STEP_UNREACHABLE,
        chain="step",
    ),
    # -- amp used in other functions than amp.initialize's -----------------------------------------------------------
    Refusal(
        "scaler_attribute_slots",
        _when_shared,
        _slots,
        "{owner} defines __slots__: the GradScaler cannot be kept as an attribute of its instances",
        ex.SCALER_ATTRIBUTE_SLOTS,
    ),
    Refusal(
        "optimizer_assigned_again",
        _when_shared,
        _assigned_again,
        "{why}",
        ex.OPTIMIZER_ASSIGNED_AGAIN,
    ),
    Refusal(
        "flag_differs_elsewhere",
        _when_shared,
        _flag_differs,
        "`{base}` in {function}() is not the `{base}` of amp.initialize's `if {flag}:` in {home} (a parameter "
        "or a local there): the flag could differ",
        ex.FLAG_DIFFERS_ELSEWHERE,
        chain="flag",
    ),
    Refusal(
        "flag_assigned_elsewhere",
        _when_shared,
        _flag_assigned_elsewhere,
        "the flag `{flag}` that guards amp.initialize is assigned in another function ({code}): the "
        "GradScaler's enabled= could not follow it; rewrite by hand, or use --to ampinit",
        ex.FLAG_ASSIGNED_ELSEWHERE,
        chain="flag",
    ),
    Refusal(
        "scaler_created_late",
        _when_shared,
        _runs_late,
        "{why}",
        ex.SCALER_CREATED_LATE,
    ),
    # -- every path through a function that steps --------------------------------------------------------------------
    Refusal(
        "step_before_initialize",
        _steps,
        _when(_step_before_initialize),
        "optimizer.step() comes before amp.initialize: it would run without a GradScaler",
        ex.STEP_BEFORE_INITIALIZE,
        chain="path",
    ),
    Refusal(
        "step_without_scale_loss",
        _steps,
        _when(_step_without_scale_loss),
        "optimizer.step() can run on a path without amp.scale_loss before it (scale_loss is conditional, "
        "or missing): GradScaler.step needs a scaled backward on every path",
        ex.STEP_WITHOUT_SCALE_LOSS,
        chain="path",
    ),
    Refusal(
        "backward_outside_scale_loss",
        _backwards,
        _when(_unscaled_backward),
        "a backward() outside amp.scale_loss in a function that steps the optimizer: on that path "
        "scaler.step() would see no scaled gradients",
        ex.BACKWARD_OUTSIDE_SCALE_LOSS,
    ),
    # -- gradients between the scale_loss block and the step --------------------------------------------------------
    Refusal(
        "clipping_not_through_amp",
        _calls,
        _other_clipping,
        "{name}() of gradients not taken through amp.master_params: Apex unscaled them when the scale_loss "
        "block exited, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) "
        "before the clipping by hand, or use --to ampinit",
        ex.CLIPPING_NOT_THROUGH_AMP,
    ),
    Refusal(
        "grad_used_by_hand",
        _file,
        _grads_by_hand,
        "`.grad` used between the scale_loss block and optimizer.step(): Apex had unscaled the gradients "
        "there, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) before it "
        "by hand, or use --to ampinit",
        ex.GRAD_USED_BY_HAND,
    ),
    Refusal(
        "master_params_twice",
        _file,
        _master_params_twice,
        "amp.master_params clipped twice in one function: each would get a scaler.unscale_(optimizer), "
        "and GradScaler raises on the second before update(); keep one unscale_ by hand",
        ex.MASTER_PARAMS_TWICE,
    ),
    # Each clipping gets a scaler.unscale_(optimizer) before it, which must be followed by scaler.step()/update()
    # whenever it runs: a clipping on every micro-batch with a step every second one would unscale twice before
    # update(), which GradScaler refuses. It over-refuses a step in another branch of the same path, so it is
    # tested only where no other reason stands.
    Refusal(
        "master_params_without_step",
        _file,
        _master_params_without_step,
        "amp.master_params clipped where no optimizer.step() of the same block follows (gradient "
        "accumulation?): the scaler.unscale_(optimizer) put before it would run again before update(), "
        "which GradScaler refuses; clip only on stepping iterations, by hand",
        ex.MASTER_PARAMS_WITHOUT_STEP,
        alone=True,
    ),
)
