"""``--to torch``: ``apex.optimizers.FusedAdam`` -> ``torch.optim.AdamW`` (Apex's default ``adam_w_mode=True``) or
``torch.optim.Adam`` (``adam_w_mode=False``: L2 decay added to the gradient), where the semantics match.

They match when every argument is one torch has with the same meaning: ``lr``, ``betas``, ``eps`` (added after the
square root in both) and ``weight_decay`` (Apex's default 0.0 is written out, since AdamW's default is 0.01);
``bias_correction``, ``amsgrad``, ``capturable`` and ``master_weights`` only at their defaults (torch has no
switch for the first; Apex refuses amsgrad; the others are Apex's CUDA-graph and O2 machinery), and
``set_grad_none`` only True (torch's ``zero_grad`` sets grads to None too). A name used other than by calling it
(a subclass, an ``isinstance``) is left alone, and the file is then refused for its Apex import.

Checkpoints the script saved before the migration hold FusedAdam's state (one step count per group), which torch's
``load_state_dict`` rejects. ``<optimizer>.load_state_dict(s)`` on a name the FusedAdam was assigned to becomes
``<optimizer>.load_state_dict(torch_adam_state(s))``, a function written into the file that converts that state as
:func:`ampinit.migrate.torch_optimizer_state` does and passes torch's own through; where no such call is found, the
report names the converter for the checkpoints.
"""

from __future__ import annotations

import inspect
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ampinit.compat.apex import optimizers as apex_optimizers
from ampinit.migrate._helper_modules import add_definitions
from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import dotted

#: FusedAdam's parameters in Apex's order (after ``self``), from the Apex layer that reproduces its signature.
FUSED_ADAM_SIGNATURE = tuple(inspect.signature(apex_optimizers.FusedAdam.__init__).parameters)[1:]
KEPT = ("lr", "betas", "eps", "weight_decay")

#: Written into a migrated file that loads the optimizer's state: the layout conversion of
#: ampinit.migrate.torch_optimizer_state, without an ampinit dependency (tests check that both agree).
TORCH_ADAM_STATE = '''def {name}(state):
    """torch.optim.Adam/AdamW state from a checkpoint written after the migration (torch's layout) or before it
    (Apex's FusedAdam: one step count per parameter group, none per parameter); written by ampinit migrate --to
    torch."""
    if not any("bias_correction" in group for group in state["param_groups"]):
        return state
    per_param = dict(state["state"])
    groups = []
    for group in state["param_groups"]:
        if "grad_averaging" in group or not group.get("bias_correction", True):
            raise ValueError(
                "this checkpoint's optimizer state is not FusedAdam's with bias correction, the only Apex state "
                "torch.optim.Adam/AdamW can resume: see ampinit.migrate.convert_apex_checkpoint"
            )
        step = float(group.get("step", 0))
        for index in group["params"]:
            if index in per_param and "step" not in per_param[index]:
                if set(per_param[index]) - {{"exp_avg", "exp_avg_sq"}}:
                    raise ValueError(
                        f"parameter {{index}} has FusedAdam state torch.optim.Adam/AdamW does not keep: see "
                        "ampinit.migrate.convert_apex_checkpoint"
                    )
                per_param[index] = {{"step": step, **per_param[index]}}
        groups.append({{key: value for key, value in group.items() if key not in ("step", "bias_correction")}})
    return {{**state, "state": per_param, "param_groups": groups}}
'''
CONVERTER_NOTE = (
    "checkpoints saved before the migration hold FusedAdam state, which torch's load_state_dict rejects "
    "(KeyError: 'step'): convert them with ampinit.migrate.convert_apex_checkpoint"
)
AT_DEFAULT = {"bias_correction": "True", "amsgrad": "False", "capturable": "False", "master_weights": "False"}


#: Why the other Apex optimizers stay refused under --to torch (keyed by class name).
NOT_NATIVE = {
    "FusedSGD": (
        "its zero_grad() zeroes the gradients (set_grad_none=False, its default) where torch.optim.SGD's sets them "
        "to None, so a parameter that gets no gradient in a step still takes weight decay and moves with its "
        "momentum under FusedSGD, and is skipped by torch's SGD; besides, FusedSGD updates only fp16 and fp32 "
        "parameters, and restarts the momentum of every parameter of a dtype when the last one's is new"
    ),
    "FusedLAMB": "torch.optim has no LAMB",
    "FusedMixedPrecisionLamb": "torch.optim has no LAMB",
    "FusedNovoGrad": "torch.optim has no NovoGrad",
}


def _arguments(call: cst.Call) -> dict[str, cst.Arg] | None:
    found: dict[str, cst.Arg] = {}
    for index, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is not None:
            found[arg.keyword.value] = arg
        elif index < len(FUSED_ADAM_SIGNATURE):
            found[FUSED_ADAM_SIGNATURE[index]] = arg
        else:
            return None
    return found


def native_adam(call: cst.Call) -> tuple[str, str] | tuple[None, str]:
    """(the torch.optim call's source, what was done) or (None, why not)."""
    args = _arguments(call)
    if args is None or "params" not in args:
        return None, "FusedAdam(*args/**kwargs): the arguments cannot be read statically"
    given = {name: cst.Module([]).code_for_node(arg.value) for name, arg in args.items()}
    for name, default in AT_DEFAULT.items():
        if given.get(name, default) != default:
            return None, f"FusedAdam({name}={given[name]}): torch.optim's Adam has no such switch"
    if given.get("set_grad_none", "True") != "True":
        return None, "FusedAdam(set_grad_none=False): torch's zero_grad sets gradients to None"
    unknown = sorted(set(given) - {"params", "adam_w_mode", "set_grad_none", *KEPT, *AT_DEFAULT})
    if unknown:
        return None, f"FusedAdam({', '.join(unknown)}=...): no torch.optim counterpart"
    mode = given.get("adam_w_mode", "True")
    if mode not in ("True", "False"):
        return None, "FusedAdam(adam_w_mode=<not a literal>): AdamW or Adam cannot be chosen statically"
    kind = "AdamW" if mode == "True" else "Adam"
    options = [given["params"]]
    options += [f"{name}={given[name]}" for name in KEPT if name in given]
    if kind == "AdamW" and "weight_decay" not in given:
        options.append("weight_decay=0.0")  # Apex's default; AdamW's is 0.01
    return f"torch.optim.{kind}({', '.join(options)})", f"apex FusedAdam -> torch.optim.{kind}"


class _Uses(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (ParentNodeProvider,)

    def __init__(self, local: str) -> None:
        self.local = local
        self.calls: list[cst.Call] = []
        self.other = False
        self.bound: set[str] = set()  # the names and attributes a FusedAdam call is assigned to

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        if node.value != self.local:
            return
        parent = self.get_metadata(ParentNodeProvider, node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return
        if isinstance(parent, cst.Call) and parent.func is node:
            self.calls.append(parent)
            statement = self.get_metadata(ParentNodeProvider, parent)
            if isinstance(statement, cst.Assign):
                self.bound.update(cst.Module([]).code_for_node(t.target) for t in statement.targets)
        else:
            self.other = True


class _Rewrite(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, local: str, calls: dict[int, str], bound: set[str], helper: str) -> None:
        super().__init__()
        self.local = local
        self.calls = calls
        self.bound = bound
        self.helper = helper
        self.loads: list[tuple[int, str]] = []  # (line, optimizer) of each load_state_dict routed through the helper

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> Any:
        native = self.calls.get(id(original_node))
        if native is not None:
            return cst.parse_expression(native)
        func = updated_node.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "load_state_dict"
            and cst.Module([]).code_for_node(func.value) in self.bound
            and len(updated_node.args) == 1
            and updated_node.args[0].keyword is None
            and not updated_node.args[0].star
        ):
            line = int(self.get_metadata(PositionProvider, original_node).start.line)
            self.loads.append((line, cst.Module([]).code_for_node(func.value)))
            state = updated_node.args[0]
            wrapped = cst.Call(func=cst.Name(self.helper), args=[cst.Arg(state.value)])
            return updated_node.with_changes(args=[state.with_changes(value=wrapped)])
        return updated_node

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> Any:
        names = updated_node.names
        if dotted(original_node.module or cst.Name("")) != "apex.optimizers" or isinstance(names, cst.ImportStar):
            return updated_node
        rest = [a for a in names if _local(a) != self.local]
        if len(rest) == len(names):
            return updated_node
        if not rest:
            return cst.RemoveFromParent()
        rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(names=rest)


def _local(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return dotted(alias.name) or ""


def rewrite_fused_adam(source: str) -> tuple[str, list[Site]]:
    """``from apex.optimizers import FusedAdam [as X]`` whose every use is a call that maps: calls rewritten to
    torch.optim, the name dropped from the import, and the optimizer's ``load_state_dict`` routed through a
    converter written into the file (under a name the file does not use). Otherwise the
    source is returned as it is, with the reason."""
    module = cst.parse_module(source)
    locals_ = [
        _local(a)
        for statement in module.body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.ImportFrom)
        and small.module is not None  # `from . import x` has no module (cst.Name("") is invalid)
        and dotted(small.module) == "apex.optimizers"
        and not isinstance(small.names, cst.ImportStar)
        for a in small.names
        if dotted(a.name) == "FusedAdam"
    ]
    if len(locals_) != 1:
        return source, []
    wrapper = MetadataWrapper(module)
    uses = _Uses(locals_[0])
    wrapper.visit(uses)
    positions = wrapper.resolve(PositionProvider)
    natives = {id(call): native_adam(call) for call in uses.calls}
    refused = [(call, why) for call in uses.calls for code, why in [natives[id(call)]] if code is None]
    if uses.other or refused or not uses.calls:
        sites = [Site(positions[c].start.line, why, True) for c, why in refused]
        return source, sites
    calls = {key: code for key, (code, _) in natives.items() if code is not None}
    used = {name.value for name in m.findall(module, m.Name()) if isinstance(name, cst.Name)}
    helper = next(n for n in ("torch_adam_state", "_torch_adam_state", "torch_adam_state_") if n not in used)
    rewrite = _Rewrite(locals_[0], calls, uses.bound, helper)
    new = wrapper.visit(rewrite)
    if rewrite.loads:
        new = add_definitions(new, [], [TORCH_ADAM_STATE.format(name=helper)])
    if not any(
        isinstance(s, cst.SimpleStatementLine)
        and any(
            isinstance(x, cst.Import) and any(dotted(a.name) == "torch" and a.asname is None for a in x.names)
            for x in s.body
        )
        for s in new.body
    ):
        new = add_definitions(new, ["torch"], [])
    sites = [
        Site(positions[c].start.line, natives[id(c)][1] + ("" if rewrite.loads else f"; {CONVERTER_NOTE}"))
        for c in uses.calls
    ]
    sites += [
        Site(line, f"{name}.load_state_dict(s) -> {name}.load_state_dict({helper}(s)): loads FusedAdam state too")
        for line, name in rewrite.loads
    ]
    return new.code, sites
