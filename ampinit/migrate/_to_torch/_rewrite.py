"""The rewrite of a file no refusal stopped: where ``torch.autocast`` goes, then one transformer that turns
``amp.initialize`` into the autocast device and the GradScaler (:meth:`_Rewrite._create_scaler`, the one place
that writes them), ``scale_loss`` blocks into ``scaler.scale(loss).backward()``, steps into
``scaler.step(optimizer); scaler.update()``, ``amp.master_params`` clipping into ``scaler.unscale_`` and the
optimizer's parameters, and amp's state and loss-scale reads into the GradScaler's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper

from ampinit.migrate import _cst
from ampinit.migrate._helper_modules import GRAD_SCALER_STATE, add_definitions
from ampinit.migrate._reach import Home
from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import add_comments
from ampinit.migrate._to_torch._analysis import (
    APEX_SIGNATURE,
    SCALE_LOSS_SIGNATURE,
    Analysis,
    availability_guard,
    call_args,
)
from ampinit.migrate._to_torch._predicates import elsewhere, loss_scale_call, loss_scale_read

Block = cst.Module | cst.IndentedBlock


@dataclass
class _Plan:
    """What the rewrite writes, from the analysis of a file that no refusal stopped."""

    amp: str
    model: str = ""
    optimizer: str = ""
    level: str = "O1"
    condition: str | None = None
    level_switch: str | None = None
    enabled_expression: str | None = None
    home: Home | None = None
    shared: bool = False  # amp is used in other functions than amp.initialize's
    names: set[str] = field(default_factory=set)
    model_list: bool = False  # the model is a variable that holds a list of models
    loads_state: int = 0  # the line of amp.load_state_dict: checkpoints of either format go through a helper
    scale_reads: list[int] = field(default_factory=list)  # lines of amp._amp_state.loss_scalers[0].loss_scale()
    # (id of block, first index, last index) of the statements to run under autocast
    autocast: list[tuple[int, int, int]] = field(default_factory=list)
    unplaced: list[int] = field(default_factory=list)  # lines of scale_loss blocks whose forward was not found
    notes: list[Site] = field(default_factory=list)


def plan_rewrite(analysis: Analysis) -> _Plan:
    plan = _Plan(
        analysis.amp,
        analysis.model,
        analysis.optimizer,
        analysis.level,
        analysis.condition,
        analysis.level_switch,
        analysis.enabled_expression,
        analysis.home,
        shared=bool(elsewhere(analysis)),
        names=analysis.names,
        model_list=analysis.model_list,
    )
    for name, node in analysis.uses:
        if name == "load_state_dict":
            plan.loads_state = analysis.line(node)
        elif name == "_amp_state":
            call = loss_scale_call(analysis, node)
            if call is not None:
                plan.scale_reads.append(analysis.line(call))
        elif name == "scale_loss" and plan.level != "O0":
            _, block, args = analysis.scale_loss[id(node)]
            _wrap_forward_before(analysis, plan, block, args["loss"])
    return plan


def _wrap_forward_before(analysis: Analysis, plan: _Plan, block: cst.With, loss: cst.BaseExpression) -> None:
    """Plan autocast around the statements that compute ``loss`` before the ``scale_loss`` block, or note why not."""
    anchor: cst.CSTNode = block
    container = analysis.parent(block)
    while isinstance(container, cst.IndentedBlock) and (
        id(container) in analysis.enabled_bodies or isinstance(analysis.parent(container), cst.With)
    ):
        if container.body[0] is not anchor:
            break
        # `if <flag>: with amp.scale_loss(...)`, `with Nvtx("backward"): ...`: the forward is before the if/with
        anchor = analysis.parent(container)
        container = analysis.parent(anchor)
    if not isinstance(container, (cst.Module, cst.IndentedBlock)) or not isinstance(loss, cst.Name):
        plan.unplaced.append(analysis.line(block))
        return
    body = list(container.body)
    end = body.index(anchor) - 1  # type: ignore[arg-type]
    while end >= 0 and not _assigns(body[end], loss.value):
        end -= 1
    if end < 0:
        plan.unplaced.append(analysis.line(block))
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
        if not isinstance(statement, cst.SimpleStatementLine) and f"{model}(" in _cst.code(statement):
            return True
    return False


_FORWARD_LEFT_OUT = (
    "the model is called in a compound statement before the loss, outside the "
    "`with torch.autocast(...)` placed after it (Apex's O1 cast it): move it under that autocast"
)


def _autocast_note(header: str) -> str:
    """What to do where the forward could not be located, naming the autocast the file's other blocks got (a
    GradScaler held by a class has its device in ``self.amp_device``, not in a local)."""
    return f"run the forward pass and the loss under `with {header}:` (it could not be located next to this block)"


def _assigns(statement: cst.CSTNode, name: str) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine):
        return False
    for small in statement.body:
        if isinstance(small, cst.Assign) and any(_cst.code(t.target) == name for t in small.targets):
            return True
        if isinstance(small, (cst.AugAssign, cst.AnnAssign)) and _cst.code(small.target) == name:
            return True
    return False


def _ends_forward(statement: cst.BaseStatement, amp: str) -> bool:
    """A statement the forward pass starts after: zeroing or stepping, or any use of amp (whatever its local name:
    ``amp.initialize`` must not move under the autocast that reads the device it defines)."""
    code = _cst.code(statement)
    uses_amp = bool(m.findall(statement, m.Name(amp)))
    return "zero_grad" in code or ".step(" in code or "amp." in code or uses_amp


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

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> Any:
        """An availability guard (``try: from apex import amp / except ImportError: amp = None``) goes whole: torch.amp
        is always there, so the fallback path cannot be taken any more, and the refusals proved nothing reads it."""
        if not availability_guard(original_node, self.plan.amp):
            return updated_node
        if self.depth == 0 and not self.has_torch:
            self.has_torch = True
            statement = cst.parse_statement("import torch")
            return statement.with_changes(leading_lines=original_node.leading_lines)
        return cst.RemoveFromParent()

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
        return _cst.method_call(node, self.plan.amp, name)

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
            and _cst.dotted(small.module) == "apex"
            and not isinstance(small.names, cst.ImportStar)
        ):
            rest = [a for a in small.names if _cst.dotted(a.name) != "amp"]
            if len(rest) != len(small.names):
                return self._replace_import(updated_node, small, rest)
        if isinstance(small, cst.Import):
            rest = [a for a in small.names if _cst.dotted(a.name) != "apex.amp"]
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
        if f"{self.plan.amp}.master_params(" in _cst.code(original_node):
            unscale = cst.parse_statement(f"{self.scaler}.unscale_({self.plan.optimizer})")
            assert isinstance(unscale, cst.SimpleStatementLine)
            return cst.FlattenSentinel(
                [unscale.with_changes(leading_lines=lines), updated_node.with_changes(leading_lines=[])]
            )
        return updated_node

    def _replace_import(self, statement: cst.SimpleStatementLine, small: Any, rest: list[Any]) -> Any:
        out: list[cst.SimpleStatementLine] = []
        if rest:
            out.append(statement.with_changes(body=[small.with_changes(names=_cst.last_comma_dropped(rest))]))
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
        args = call_args(small.value, APEX_SIGNATURE) or {}  # type: ignore[attr-defined]
        given = (_cst.code(args["models"]), _cst.code(args["optimizers"]))
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
            self._device_line(),
            cst.parse_statement(f"{self.scaler} = torch.amp.GradScaler({self.device}{options})"),
        ]
        out[0] = out[0].with_changes(leading_lines=lines)
        if trailing is not None and trailing.comment is not None:
            out[1] = out[1].with_changes(trailing_whitespace=trailing)
        return out

    def _device_line(self) -> cst.BaseStatement:
        """``<device> = ...``: the device the GradScaler and every ``torch.autocast`` of the file name: the model's,
        as ampinit's own O1 takes it from the model's parameters (``torch.cuda.is_available()`` says nothing about
        where a model lives). Of a list of models, the first's: ``[a, b]`` unpacked, or a variable that holds the
        list."""
        models = self.plan.model
        node = cst.parse_expression(models)
        if isinstance(node, (cst.List, cst.Tuple)) and node.elements:
            models = _cst.code(node.elements[0].value)
        elif self.plan.model_list:
            models = f"{models}[0]"
        return cst.parse_statement(f"{self.device} = next({models}.parameters()).device.type")

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> Any:
        item = updated_node.items[0] if len(updated_node.items) == 1 else None
        call = self._amp_call(item.item, "scale_loss") if item is not None else None
        if item is None or call is None or item.asname is None:
            return updated_node
        loss = _cst.code((call_args(call, SCALE_LOSS_SIGNATURE) or {})["loss"])
        name = _cst.code(item.asname.name)
        body = list(updated_node.body.body) if isinstance(updated_node.body, cst.IndentedBlock) else []
        scaled = f"{self.scaler}.scale({loss})"
        if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
            expr = body[0].body[0]
            if isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call):
                func = expr.value.func
                if isinstance(func, cst.Attribute) and func.attr.value == "backward" and _cst.code(func.value) == name:
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
        if m.matches(original_node, loss_scale_read(self.plan.amp)):  # the reads _check_amp_state accepted
            return cst.parse_expression(f"{self.scaler}.get_scale()")
        return updated_node


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
    return isinstance(small, cst.ImportFrom) and _cst.dotted(small.module or cst.Name("")) == "__future__"


def _is_step(value: cst.BaseExpression, optimizer: str) -> bool:
    return (
        isinstance(value, cst.Call)
        and not value.args
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "step"
        and _cst.code(value.func.value) == optimizer
    )


def rewrite_to_torch(
    module: cst.Module, wrapper: MetadataWrapper, plan: _Plan, analysis: Analysis
) -> tuple[str, list[Site], bool]:
    """The accepted plan, written: autocast around the forward, the GradScaler, its state helper if needed."""
    assert plan.home is not None
    # an attribute only where other methods need it; a distinctive name there, as base classes may hold `scaler`
    attribute = plan.shared and plan.home.kind == "attribute"
    scaler = _cst.fresh_name(["amp_scaler", "_amp_scaler"] if attribute else ["scaler", "grad_scaler"], plan.names)
    device = _cst.fresh_name(["amp_device"], plan.names)
    if attribute:
        scaler, device = plan.home.name(scaler), plan.home.name(device)
    enabled = f", enabled={plan.enabled_expression}" if plan.enabled_expression is not None else ""
    if enabled and plan.shared:  # the flag's names may not be readable where the loop is; the GradScaler is
        enabled = f", enabled={scaler}.is_enabled()"
    header = f"torch.autocast({device}, dtype=torch.float16{enabled})"
    plan.notes += [Site(line, _autocast_note(header), True) for line in plan.unplaced]
    wrapped = wrapper.module.visit(_WrapAutocast(plan.autocast, header, plan.notes, analysis.positions))
    has_torch = _cst.imports_torch(module)
    state_helper = _cst.fresh_name(["grad_scaler_state", "_grad_scaler_state"], plan.names)
    rewritten = wrapped.visit(_Rewrite(plan, scaler, device, has_torch, state_helper))
    if plan.loads_state:
        rewritten = add_definitions(rewritten, [], [GRAD_SCALER_STATE.format(name=state_helper)])
    return rewritten.code, _rewrite_sites(plan, analysis, scaler, state_helper), False


def _rewrite_sites(plan: _Plan, analysis: Analysis, scaler: str, state_helper: str) -> list[Site]:
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
        if isinstance(s.func, cst.Attribute) and _cst.dotted(s.func.value) == plan.optimizer
    ]
    sites += plan.notes
    return sorted(sites, key=lambda s: s.line)
