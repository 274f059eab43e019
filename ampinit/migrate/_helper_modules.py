"""``--to torch`` for helper modules: files that never call ``amp.initialize`` and only use ``amp.float_function``
(as a decorator or a call) or ``amp.disable_casts()``.

* ``amp.float_function`` becomes a small decorator written into the file: while autocast is on for a tensor's
  device, floating-point tensor arguments (also inside tuples and lists) are cast to float32 before the call, and
  the body runs under autocast as before. That is Apex's rule: its wrapper cast only once O1 was initialized (the
  native counterpart: autocast is on), and did not switch its casts off inside.
* ``amp.disable_casts()`` becomes ``torch.autocast(<device>, enabled=False)`` for the device autocast is on for
  (CUDA's, else the CPU's): a helper module holds no model to take the device from, and the caller's autocast
  is what Apex's disable_casts switched off.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ampinit.migrate._cst import dotted
from ampinit.migrate._report import Site

HELPER_USES = frozenset({"float_function", "disable_casts"})

FLOAT_FUNCTION = '''def {name}(fn):
    """Apex's amp.float_function on torch.autocast: while autocast is on, floating-point tensor arguments are
    cast to float32 before ``fn`` runs (written by ampinit migrate --to torch)."""

    def to_float(value):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and torch.is_autocast_enabled(value.device.type):
                return value.float()
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(to_float(item) for item in value)
        return value

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*to_float(args), **{{key: to_float(item) for key, item in kwargs.items()}})

    return wrapper
'''

GRAD_SCALER_STATE = '''def {name}(state):
    """GradScaler state from a checkpoint written after the migration (GradScaler.state_dict()) or before it
    (Apex's amp.state_dict(): loss scale and clean steps, on Apex's schedule, which is GradScaler's default);
    written by ampinit migrate --to torch."""
    if "loss_scaler0" not in state:
        return state
    apex_state = state["loss_scaler0"]
    return {{
        "scale": float(apex_state["loss_scale"]),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": int(apex_state["unskipped"]),
    }}
'''

DEVICE = '"cuda" if torch.is_autocast_enabled("cuda") else "cpu"'


class _Helpers(cst.CSTTransformer):
    def __init__(self, amp: str, helper: str | None) -> None:
        super().__init__()
        self.amp = amp
        self.helper = helper  # None: the file does not use float_function
        self.imported: set[str] = set()  # modules imported at module level, unconditionally
        self.depth = 0  # compound statements around the current one

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.depth += 1

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        self.depth -= 1
        return updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> Any:
        if self.helper is not None and dotted(original_node) == f"{self.amp}.float_function":
            return cst.Name(self.helper)
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> Any:
        if dotted(original_node.func) == f"{self.amp}.disable_casts" and not original_node.args:
            return cst.parse_expression(f"torch.autocast({DEVICE}, enabled=False)")
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        for small in original_node.body if self.depth == 0 else ():
            if isinstance(small, cst.Import):
                self.imported.update(dotted(a.name) or "" for a in small.names if a.asname is None)
        if len(original_node.body) != 1:
            return updated_node
        small = original_node.body[0]
        if (
            isinstance(small, cst.ImportFrom)
            and dotted(small.module or cst.Name("")) == "apex"
            and not isinstance(small.names, cst.ImportStar)
            and [dotted(a.name) for a in small.names] == ["amp"]
            and small.names[0].asname is None
        ):
            return cst.RemoveFromParent()
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        wanted = ("functools", "torch") if self.helper is not None else ("torch",)
        functions = [FLOAT_FUNCTION.format(name=self.helper)] if self.helper is not None else []
        return add_definitions(updated_node, [m for m in wanted if m not in self.imported], functions)


def add_definitions(module: cst.Module, imports: list[str], functions: list[str]) -> cst.Module:
    """``import m`` for each of ``imports`` and the ``functions`` (source text), right after the docstring and the
    imports that open the file, so that every later statement sees them."""
    body = list(module.body)
    header = 0
    while header < len(body) and _opens_file(body[header]):
        header += 1
    new: list[Any] = [cst.parse_statement(f"import {m}") for m in imports]
    for text in functions:
        [function] = cst.parse_module(text).body
        new.append(function.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()]))
    body[header:header] = new
    return module.with_changes(body=body)


def _opens_file(statement: cst.BaseStatement) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine):
        return False
    return all(
        isinstance(s, (cst.Import, cst.ImportFrom))
        or (isinstance(s, cst.Expr) and isinstance(s.value, (cst.SimpleString, cst.ConcatenatedString)))
        for s in statement.body
    )


def migrate_helper_module(
    module: cst.Module, amp: str, uses: set[str], helper: str, import_line: int
) -> tuple[str, list[Site]]:
    """The rewrite above; ``helper`` is a free name for the decorator."""
    float_function = "float_function" in uses
    new = module.visit(_Helpers(amp, helper if float_function else None))
    sites = [Site(import_line, "from apex import amp: removed (this file only uses amp's cast helpers)")]
    if float_function:
        sites.append(Site(import_line, f"amp.float_function -> {helper} (a decorator written into the file)"))
    if "disable_casts" in uses:
        sites.append(Site(import_line, "amp.disable_casts() -> torch.autocast(<device>, enabled=False)"))
    return new.code, sites
