"""``--to ampinit``: Apex imports and calls rewritten to ampinit (and to torch where torch has the thing).

Every Apex name bound by an import is classified once (:class:`Binding`):

* *direct*: the name has a new home that can be imported under the same local name (``from apex import amp`` ->
  ``from ampinit import amp``; ``from apex.parallel import DistributedDataParallel as DDP`` ->
  ``from torch.nn.parallel import DistributedDataParallel as DDP``); uses stay as they are;
* *inline*: the new home is an expression (``convert_syncbn_model`` ->
  ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, ``to_python_float(x)`` -> ``x.item()``); each use is
  rewritten and the import becomes ``import torch``;
* *package*: ``import apex`` and friends; each attribute chain (``apex.amp.initialize``) is rewritten to its new
  home and the import becomes the imports those homes need.

Calls whose arguments torch does not take (Apex's DDP and SyncBatchNorm options) lose them, with a ``# ampinit:``
comment where dropping one changes behaviour. Anything without an ampinit or torch counterpart stays reachable
through ``ampinit.compat.apex``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
from libcst.metadata import (
    ExpressionContext,
    ExpressionContextProvider,
    ImportAssignment,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from ampinit.migrate import _cst, _rules
from ampinit.migrate._binding import unbound_calls
from ampinit.migrate._cst import dotted
from ampinit.migrate._report import Site
from ampinit.migrate._rules import Target

COMMENT_PREFIX = "# ampinit: "
Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement


def expression(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def import_statement(target: Target, local: str | None = None) -> cst.SimpleStatementLine:
    """``from module import name [as local]`` or ``import module [as local]``."""
    if target.name is None:
        alias = f" as {local}" if local and local != target.module else ""
        return cst.parse_statement(f"import {target.module}{alias}")  # type: ignore[return-value]
    alias = f" as {local}" if local and local != target.name else ""
    return cst.parse_statement(f"from {target.module} import {target.name}{alias}")  # type: ignore[return-value]


def apex_bindings(module: cst.Module) -> dict[str, str]:
    """Local names bound to Apex modules or objects by absolute imports anywhere in ``module``."""
    found: dict[str, str] = {}

    class Visitor(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> None:
            for alias in node.names:
                name = dotted(alias.name)
                if name is None or not is_apex(name):
                    continue
                if alias.asname is not None:
                    found[_cst.local_name(alias)] = name
                else:
                    found[name.split(".")[0]] = name.split(".")[0]

        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            if node.relative or node.module is None:
                return
            base = dotted(node.module)
            if base is None or not is_apex(base) or isinstance(node.names, cst.ImportStar):
                return
            for alias in node.names:
                name = dotted(alias.name)
                if name is not None:
                    found[_cst.local_name(alias) if alias.asname else name] = f"{base}.{name}"

    module.visit(Visitor())
    return found


def is_apex(name: str) -> bool:
    return name == "apex" or name.startswith(("apex.", "amp_C.", "apex_C.")) or name in ("amp_C", "apex_C")


@dataclass
class Binding:
    local: str
    qualified: str
    kind: str  # "direct", "inline", "package" or "keep" (no new home exists: the Apex import stays)
    target: Target | None = None
    imports: set[str] = field(default_factory=set)  # for package bindings: the modules their chains need
    unresolved: set[str] = field(default_factory=set)  # package bindings: chains with no new home (import kept)
    bare: bool = False  # package bindings: the name itself is used as a value (`getattr(apex, "amp")`)


def unresolved_note(qualified: str) -> str:
    return (
        f"ampinit provides no {qualified}, so this Apex name is left as it is (the codemod never writes an import "
        "that does not resolve): replace it by hand"
    )


def stats_rewrite(node: cst.CSTNode, amp_locals: set[str]) -> cst.BaseExpression | None:
    """``amp._amp_state.loss_scalers[i].loss_scale()`` / ``._loss_scale`` / ``._unskipped`` -> ``amp.stats()...``."""
    call_form = isinstance(node, cst.Call) and not node.args
    attr_node = node.func if isinstance(node, cst.Call) else node
    if not isinstance(attr_node, cst.Attribute):
        return None
    field_name = attr_node.attr.value
    wanted = {"loss_scale": "loss_scales"} if call_form else {"_loss_scale": "loss_scales", "_unskipped": "unskipped"}
    if field_name not in wanted:
        return None
    subscript = attr_node.value
    if not (isinstance(subscript, cst.Subscript) and len(subscript.slice) == 1):
        return None
    scalers = subscript.value
    if not (isinstance(scalers, cst.Attribute) and scalers.attr.value == "loss_scalers"):
        return None
    state = scalers.value
    if not (
        isinstance(state, cst.Attribute) and state.attr.value == "_amp_state" and isinstance(state.value, cst.Name)
    ):
        return None
    if state.value.value not in amp_locals:
        return None
    index = subscript.slice[0].slice
    if not isinstance(index, cst.Index):
        return None
    return cst.Subscript(
        value=cst.Attribute(
            value=cst.Call(func=cst.Attribute(value=cst.Name(state.value.value), attr=cst.Name("stats"))),
            attr=cst.Name(wanted[field_name]),
        ),
        slice=[cst.SubscriptElement(slice=index)],
    )


class _Collector(cst.CSTVisitor):
    """Finds which attributes of module-like bindings are used (outside the ``stats`` patterns)."""

    METADATA_DEPENDENCIES = (ParentNodeProvider,)

    def __init__(self, bindings: dict[str, str]) -> None:
        self.bindings = bindings
        self.used: dict[str, set[str]] = {}
        self.covered: set[int] = set()
        self.stores: set[int] = set()
        self.amp_locals = {local for local, q in bindings.items() if q == "apex.amp"}

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.stores.add(id(node.target))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.stores.add(id(node.target))

    def visit_Call(self, node: cst.Call) -> None:
        self._cover(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._cover(node)
        if isinstance(node.value, cst.Name) and node.value.value in self.bindings and id(node) not in self.covered:
            self.used.setdefault(node.value.value, set()).add(node.attr.value)

    def _cover(self, node: cst.CSTNode) -> None:
        if id(node) in self.stores or stats_rewrite(node, self.amp_locals) is None:
            return
        inner: Any = node.func if isinstance(node, cst.Call) else node
        self.covered.add(id(inner.value.value.value))  # the `amp._amp_state` attribute


class _ToAmpinit(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (ParentNodeProvider, PositionProvider, ExpressionContextProvider, ScopeProvider)

    def __init__(
        self,
        bindings: dict[str, Binding],
        amp_locals: set[str],
        stores: set[int],
        existing_imports: set[str],
        to: str,
        local_functions: set[str],
    ) -> None:
        super().__init__()
        self.bindings = bindings
        self.to = to  # "ampinit", or "torch" for the rest of Apex after the native amp rewrite
        self.local_functions = local_functions  # a locally defined is_apex_available is migrated with its body
        self.imported = set(existing_imports)  # modules imported plainly (``import x``) at module level
        self.amp_locals = amp_locals
        self.stores = stores
        self.sites: list[Site] = []
        self._notes: list[list[str]] = []

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _line(self, node: cst.CSTNode) -> int:
        return _cst.line(self.metadata[PositionProvider], node)

    def _site(self, node: cst.CSTNode, message: str, note: str | None = None) -> None:
        self.sites.append(Site(self._line(node), message if note is None else f"{message}: {note}", note is not None))
        if note is not None and self._notes:
            self._notes[-1].append(note)

    def _qualified(self, node: cst.BaseExpression) -> str | None:
        name = dotted(node)
        if name is None:
            return None
        root, _, rest = name.partition(".")
        binding = self.bindings.get(root)
        if binding is None:
            return None
        return binding.qualified + ("." + rest if rest else "")

    # -- statements carry the comments -------------------------------------------------------------------------------
    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            self._notes.append([])
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode) -> Any:
        result = super().on_leave(original_node, updated_node)
        if isinstance(original_node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            notes = self._notes.pop()
            if notes:
                result = add_comments(result, notes)
        return result

    # -- imports ---------------------------------------------------------------------------------------------------
    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        pieces = self._rewrite_smalls(original_node, updated_node.body)
        if pieces is None:
            return updated_node
        # in the order of the line (`from apex.parallel import DistributedDataParallel as DDP; m = DDP(m)`: the
        # import must still come before the statement that uses it)
        out: list[cst.SimpleStatementLine] = []
        run: list[cst.BaseSmallStatement] = []
        for piece in pieces:
            if isinstance(piece, list):
                if run:
                    out.append(cst.SimpleStatementLine(body=_semicolons(run)))
                    run = []
                out.extend(piece)
            else:
                run.append(piece)
        if run:
            out.append(cst.SimpleStatementLine(body=_semicolons(run)))
        if not out:
            return cst.RemoveFromParent()
        out[0] = out[0].with_changes(
            leading_lines=updated_node.leading_lines, trailing_whitespace=updated_node.trailing_whitespace
        )  # keeps a trailing comment (a noqa, a type: ignore)
        return cst.FlattenSentinel(out)

    def leave_SimpleStatementSuite(
        self, original_node: cst.SimpleStatementSuite, updated_node: cst.SimpleStatementSuite
    ) -> cst.SimpleStatementSuite:
        """The one-line body of a compound statement (`try: import apex`, `if x: from apex import amp`): its imports
        are rewritten like a line's, the new ones joined by semicolons in the same place."""
        pieces = self._rewrite_smalls(original_node, updated_node.body)
        if pieces is None:
            return updated_node
        body: list[cst.BaseSmallStatement] = []
        for piece in pieces:
            if isinstance(piece, list):
                body.extend(small for line in piece for small in line.body)
            else:
                body.append(piece)
        return updated_node.with_changes(body=_semicolons(body or [cst.Pass()]))

    def _rewrite_smalls(
        self, statement: cst.SimpleStatementLine | cst.SimpleStatementSuite, body: Sequence[cst.BaseSmallStatement]
    ) -> list[cst.BaseSmallStatement | list[cst.SimpleStatementLine]] | None:
        """Each small statement of a line, or the import lines it becomes; None when no import is rewritten."""
        pieces: list[cst.BaseSmallStatement | list[cst.SimpleStatementLine]] = []
        replaced = False
        for small in body:
            new = self._rewrite_import(small, statement)
            if new is None:
                pieces.append(small)
            else:
                replaced = True
                pieces.append(new)
        return pieces if replaced else None

    def _rewrite_import(
        self, small: cst.BaseSmallStatement, statement: cst.SimpleStatementLine | cst.SimpleStatementSuite
    ) -> list[cst.SimpleStatementLine] | None:
        if isinstance(small, cst.Import):
            names = [(dotted(a.name) or "", a) for a in small.names]
        elif isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None:
            base = dotted(small.module) or ""
            if not _rules_is_apex(base):
                return None
            if isinstance(small.names, cst.ImportStar):
                home = _rules.COMPAT + base[len("apex") :] if base.startswith("apex") else f"{_rules.COMPAT}.{base}"
                if not _rules.resolves(home):
                    self._site(statement, f"from {base} import *", unresolved_note(base))
                    return None
                self._site(statement, f"from {base} import * -> from {home} import *")
                return [cst.SimpleStatementLine([small.with_changes(module=expression(home))])]
            names = [(f"{base}.{dotted(a.name)}", a) for a in small.names]
        else:
            return None
        if not any(_rules_is_apex(n) for n, _ in names):
            return None
        out: list[cst.SimpleStatementLine] = []
        others = [a for n, a in names if not _rules_is_apex(n)]
        if others:
            assert isinstance(small, cst.Import)
            out.append(cst.SimpleStatementLine([small.with_changes(names=_cst.last_comma_dropped(others))]))
        for name, alias in names:
            if not _rules_is_apex(name):
                continue
            local = (
                _cst.local_name(alias)
                if alias.asname
                else (name.split(".")[-1] if isinstance(small, cst.ImportFrom) else name.split(".")[0])
            )
            binding = self.bindings.get(local)
            if binding is None:
                continue
            if binding.kind == "keep" or binding.unresolved:
                out.append(cst.SimpleStatementLine([small.with_changes(names=_cst.last_comma_dropped([alias]))]))
                if binding.kind == "keep":
                    self._site(statement, binding.qualified, unresolved_note(binding.qualified))
                    continue
                if not binding.imports:
                    continue
            out.extend(self._binding_imports(binding, statement))
        return _dedupe(out)

    def _binding_imports(
        self, binding: Binding, statement: cst.SimpleStatementLine | cst.SimpleStatementSuite
    ) -> list[cst.SimpleStatementLine]:
        if binding.kind == "direct":
            assert binding.target is not None
            new = import_statement(binding.target, binding.local)
            self._site(statement, f"{binding.qualified} -> {binding.target.expression}", binding.target.note)
            if binding.target.info:
                self.sites.append(Site(self._line(statement), f"{binding.qualified}: {binding.target.info}"))
            return [new]
        imports = sorted(binding.imports) if binding.kind == "inline" else sorted(binding.imports) or ["ampinit"]
        if binding.kind == "package" and binding.bare and not binding.imports:
            imports = []
        fresh = [m for m in imports if m not in self.imported]
        self.imported.update(fresh)
        out = [import_statement(Target(m)) for m in fresh]
        if binding.kind == "package" and binding.bare:
            # the name itself is read (`getattr(apex, "amp")`, `print(apex)`): it stays bound, to the package's
            # home in ampinit's Apex layer (what `ampinit run` gives it)
            home = _rules.COMPAT + binding.qualified[len("apex") :]
            out.append(import_statement(Target(home), binding.local))
            imports = [*imports, f"{home} as {binding.local}"]
        if binding.kind == "package":
            self._site(statement, f"import {binding.qualified} -> " + (", ".join(f"import {m}" for m in imports)))
        return out

    # -- availability guards ---------------------------------------------------------------------------------------
    def leave_Comparison(self, original_node: cst.Comparison, updated_node: cst.Comparison) -> cst.BaseExpression:
        membership = any(isinstance(c.operator, (cst.In, cst.NotIn)) for c in original_node.comparisons)
        left = original_node.left
        if not (membership and isinstance(left, cst.SimpleString) and _names_apex(left)):
            return updated_node
        code = _cst.code(original_node)
        container = dotted(original_node.comparisons[0].comparator) or ""
        if self.to == "ampinit" and _is_apex_root(left) and container.endswith("modules"):
            self._site(original_node, f"{code}: the Apex check now asks for ampinit, which this file's imports load")
            return updated_node.with_changes(left=_renamed(left))
        self._site(original_node, code, GUARD_NOTE)
        return updated_node

    def _guard_call(self, node: cst.Call, updated: cst.Call) -> cst.BaseExpression | None:
        """``find_spec("apex")`` -> ``find_spec("ampinit")``; ``is_apex_available()`` -> ``True`` (both under
        ``--to ampinit``, where ampinit provides what the check guarded); flagged for a human otherwise."""
        name = dotted(node.func) or ""
        last = name.rpartition(".")[2]
        first = node.args[0].value if node.args else None
        if last in ("find_spec", "find_loader") and isinstance(first, cst.SimpleString) and _names_apex(first):
            if self.to == "ampinit" and not _is_apex_root(first) and _module_string(first) is not None:
                return None  # a submodule's name: leave_SimpleString renames it to its ampinit home
            if self.to == "ampinit" and _is_apex_root(first):
                self._site(node, f"{name}({first.value}) -> {name}({_renamed(first).value})")
                renamed = updated.args[0].with_changes(value=_renamed(first))
                return updated.with_changes(args=[renamed, *updated.args[1:]])
            self._site(node, f"{name}({first.value})", GUARD_NOTE)
        elif last == "is_apex_available" and name not in self.local_functions:
            if self.to == "ampinit":
                self._site(node, f"{name}() -> True: ampinit provides the Apex names this file uses")
                return cst.Name("True")
            self._site(node, f"{name}()", GUARD_NOTE)
        return None

    # -- module names in strings ----------------------------------------------------------------------------------
    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.BaseExpression:
        """A string that is exactly an Apex module's name (``import_module("apex.optimizers")``, a factory's list
        of module names, ``find_spec("apex.amp")``): under ``--to ampinit`` it names the module's ampinit home,
        since Apex is not installed after the migration. ``__import__("apex.x")`` without a ``fromlist`` returns
        the top package, which the renamed string would not: that one is flagged."""
        if self.to != "ampinit":
            return updated_node
        name = _module_string(original_node)
        if name is None:
            return updated_node
        parent = self.get_metadata(ParentNodeProvider, original_node)
        call = self.get_metadata(ParentNodeProvider, parent) if isinstance(parent, cst.Arg) else None
        function = (dotted(call.func) or "") if isinstance(call, cst.Call) else ""
        if isinstance(parent, cst.Comparison) or (name == "apex" and not function.endswith("import_module")):
            return updated_node  # availability guards are handled as guards; a bare "apex" is usually a word
        home = _rules.COMPAT + name[len("apex") :] if name.startswith("apex") else f"{_rules.COMPAT}.{name}"
        code = _cst.code(original_node)
        if isinstance(call, cst.Call) and function.rpartition(".")[2] == "__import__" and not _has_fromlist(call):
            self._site(original_node, f"__import__({code})", MODULE_STRING_NOTE.format(home=home))
            return updated_node
        if not _rules.resolves(home):
            self._site(original_node, code, unresolved_note(name))
            return updated_node
        self._site(original_node, f"{code} -> {code.replace(name, home, 1)}: the Apex module's ampinit home")
        return updated_node.with_changes(value=original_node.value.replace(name, home, 1))

    # -- uses ------------------------------------------------------------------------------------------------------
    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        private = original_node.attr.value
        if private in _rules.PRIVATE_ATTRIBUTES and not _rules.private_attribute_provided(private):
            note = (
                f"uses Apex's private `{private}` ({_rules.PRIVATE_ATTRIBUTES[private]}), which ampinit does not "
                "provide yet: keep Apex for this code, or rewrite it against ampinit's public API"
            )
            self._site(original_node, _cst.code(original_node), note)
        parent = self.get_metadata(ParentNodeProvider, original_node)
        if isinstance(parent, cst.Attribute) and parent.value is original_node:
            return updated_node  # only the outermost attribute of a chain is rewritten
        if id(original_node) not in self.stores:
            stats = stats_rewrite(original_node, self.amp_locals)
            if stats is not None:
                self._site(original_node, "amp._amp_state.loss_scalers[i] field -> amp.stats()")
                return stats
        name = dotted(original_node)
        if name is None:
            return updated_node
        binding = self.bindings.get(name.split(".")[0])
        if binding is None or binding.kind != "package":
            return updated_node
        target, depth = chain_target(binding, name)
        if target is None:
            return updated_node
        if not target.resolves:
            if not _is_call_func(self, original_node):
                self._site(original_node, name, unresolved_note(_chain_name(binding, name, depth)))
            return updated_node
        result: cst.BaseExpression = expression(target.expression)
        trailing: list[cst.Name] = []
        node: cst.BaseExpression = updated_node
        for _ in range(depth):
            assert isinstance(node, cst.Attribute)
            trailing.append(node.attr)
            node = node.value
        for attr in reversed(trailing):
            result = cst.Attribute(value=result, attr=attr)
        if not _is_call_func(self, original_node):
            self._site(original_node, f"{name} -> {dotted(result)}", target.note)
        return result

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        binding = self.bindings.get(original_node.value)
        if binding is None or binding.kind != "inline":
            return updated_node
        parent = self.get_metadata(ParentNodeProvider, original_node)
        if isinstance(parent, cst.Attribute) and parent.value is not original_node:
            return updated_node  # `x.name`: not a use of the binding
        if isinstance(parent, cst.Arg) and parent.keyword is original_node:
            return updated_node
        if not _reads_import(self, original_node):
            return updated_node  # `def to_python_float(t):` (a fallback), a parameter or local of that name
        is_call = isinstance(parent, cst.Call) and parent.func is original_node
        if binding.qualified in _rules.TO_PYTHON_FLOAT_NAMES:
            if is_call:
                return updated_node  # the whole call is rewritten in leave_Call
            self._site(original_node, "to_python_float (as a value) -> torch.Tensor.item")
            return expression("torch.Tensor.item")
        assert binding.target is not None
        if not is_call:
            self._site(original_node, f"{binding.local} -> {binding.target.expression}")
        return expression(binding.target.expression)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        guard = self._guard_call(original_node, updated_node)
        if guard is not None:
            return guard
        if id(original_node) not in self.stores:
            stats = stats_rewrite(original_node, self.amp_locals)
            if stats is not None:
                self._site(original_node, "amp._amp_state.loss_scalers[i].loss_scale() -> amp.stats().loss_scales[i]")
                return stats
        qualified = self._qualified(original_node.func)
        if qualified is None:
            return updated_node
        if isinstance(original_node.func, cst.Name) and not _reads_import(self, original_node.func):
            return updated_node  # a local of the imported name's name (a parameter) is called
        if qualified in _rules.TO_PYTHON_FLOAT_NAMES:
            return self._to_python_float(original_node, updated_node)
        if qualified in _rules.DDP_NAMES:
            return self._drop_args(original_node, updated_node, "DistributedDataParallel", 1)
        if qualified in _rules.SYNCBN_NAMES:
            return self._drop_named(original_node, updated_node, "SyncBatchNorm", {"channel_last", "fuse_relu"}, 6)
        if qualified == _rules.CONVERT_SYNCBN:
            return self._drop_named(original_node, updated_node, "convert_syncbn_model", {"channel_last"}, 2)
        binding = self.bindings.get((dotted(original_node.func) or "").split(".")[0])
        if binding is not None and binding.kind in ("inline", "package"):
            target, depth = chain_target(binding, dotted(original_node.func) or "")
            note = target.note if target is not None else None
            if target is not None and not target.resolves:
                name = dotted(original_node.func) or ""
                self._site(original_node, name, unresolved_note(_chain_name(binding, name, depth)))
                return updated_node
            self._site(original_node, f"{dotted(original_node.func)}(...) -> {dotted(updated_node.func)}(...)", note)
        return updated_node

    def _to_python_float(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if len(updated.args) != 1 or updated.args[0].keyword is not None or updated.args[0].star:
            self._site(original, "to_python_float(...)", "unusual arguments: rewrite to .item() by hand")
            return updated
        value = updated.args[0].value
        if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self._site(original, "to_python_float(x) -> x.item()")
        return cst.Call(func=cst.Attribute(value=value, attr=cst.Name("item")))

    def _drop_args(self, original: cst.Call, updated: cst.Call, what: str, positional: int) -> cst.Call:
        kept: list[cst.Arg] = []
        notes: list[str] = []
        dropped: list[str] = []
        for index, arg in enumerate(updated.args):
            keyword = arg.keyword.value if arg.keyword is not None else None
            if arg.star:
                code = f"{arg.star}{_cst.code(arg.value)}"
                dropped.append(code)
                notes.append(f"dropped {code}: the Apex options it holds cannot be read; pass torch's by hand")
            elif keyword is None and index < positional:
                kept.append(arg)
            elif keyword is None and index - positional >= len(_rules.DDP_POSITIONAL):
                dropped.append(f"argument {index + 1}")
                notes.append(f"dropped positional argument {index + 1}: Apex's DDP takes no such argument")
            elif keyword is None:  # Apex's parameters in order: read by name, as the keyword form is
                arg = arg.with_changes(
                    keyword=cst.Name(_rules.DDP_POSITIONAL[index - positional]),
                    equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
                )
                keyword = _rules.DDP_POSITIONAL[index - positional]
            if keyword is None:  # kept or dropped above
                continue
            if keyword in _rules.DDP_RENAMED:
                renamed = _rules.DDP_RENAMED[keyword]
                kept.append(arg.with_changes(keyword=cst.Name(renamed)))
                dropped.append(f"{keyword} -> {renamed}")
            elif keyword in _rules.DDP_DROPPED_WITH_EFFECT:
                dropped.append(keyword)
                notes.append(f"dropped Apex-only {keyword}=: {_rules.DDP_DROPPED_WITH_EFFECT[keyword]}")
            elif keyword in _rules.DDP_DROPPED_SILENTLY:
                dropped.append(keyword)
            else:
                kept.append(arg)
        renames = [d for d in dropped if " -> " in d]
        dropped = [d for d in dropped if " -> " not in d]
        details = [f"dropped {', '.join(dropped)}"] if dropped else []
        details += renames
        message = f"apex {what} -> torch {what}" + (f" ({'; '.join(details)})" if details else "")
        self._site(original, message, "; ".join(notes) or None)
        return updated.with_changes(args=_cst.last_comma_dropped(kept))

    def _drop_named(
        self, original: cst.Call, updated: cst.Call, what: str, names: set[str], positional: int
    ) -> cst.Call:
        kept: list[cst.Arg] = []
        effective: list[str] = []
        for index, arg in enumerate(updated.args):
            keyword = arg.keyword.value if arg.keyword is not None else None
            if (keyword is None and index < positional) or (keyword is not None and keyword not in names):
                kept.append(arg)
            elif not (isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None")):
                effective.append(keyword or f"positional argument {index + 1}")
        note = None
        if effective:
            note = f"dropped Apex-only {', '.join(effective)}: torch's {what} has no such option"
        self._site(original, f"apex {what} -> torch", note)
        return updated.with_changes(args=_cst.last_comma_dropped(kept))


def _reads_import(transformer: cst.MetadataDependent, node: cst.Name) -> bool:
    """Whether ``node`` reads a name that an import binds where it is read: not a definition, an assignment target,
    a ``global`` list or a parameter (those are names, not uses; rewriting them to an expression breaks the file),
    and not a use that only a local of the same name can reach (a parameter ``to_python_float``)."""
    if transformer.get_metadata(ExpressionContextProvider, node, None) is not ExpressionContext.LOAD:
        return False
    if isinstance(transformer.get_metadata(ParentNodeProvider, node, None), cst.NameItem):
        return False  # `global name` / `nonlocal name`: libcst calls it a load
    scope = transformer.get_metadata(ScopeProvider, node, None)
    if scope is None:
        return True
    assignments = scope[node.value]
    return not assignments or any(isinstance(a, ImportAssignment) for a in assignments)


def _is_call_func(transformer: _ToAmpinit, node: cst.CSTNode) -> bool:
    parent = transformer.get_metadata(ParentNodeProvider, node)
    return isinstance(parent, cst.Call) and parent.func is node


GUARD_NOTE = (
    "an Apex availability guard: after the migration apex is not installed, so this test says no and the code "
    "takes its no-Apex path although ampinit provides what it guarded; replace the test (True) or remove it"
)
GUARD_WORDS = ("find_spec", "find_loader", "sys.modules", "is_apex_available")


MODULE_STRING_NOTE = (
    "__import__ of an Apex submodule without fromlist returns the top package `apex`; after the migration Apex is "
    "not installed: import {home} with importlib.import_module instead"
)


def _module_string(node: cst.SimpleString) -> str | None:
    """The Apex module a string literal is exactly the name of (``"apex.optimizers"``, ``"amp_C"``), else None."""
    try:
        value = node.evaluated_value
    except Exception:  # an f-string or bytes: not a module name
        return None
    if not isinstance(value, str) or not is_apex(value) or not all(p.isidentifier() for p in value.split(".")):
        return None
    return value


def _has_fromlist(call: cst.Call) -> bool:
    return len(call.args) >= 4 or any(a.keyword is not None and a.keyword.value == "fromlist" for a in call.args)


def _is_apex_root(node: cst.SimpleString) -> bool:
    return node.evaluated_value == "apex"


def _renamed(node: cst.SimpleString) -> cst.SimpleString:
    """The same string literal (prefix and quotes kept) naming ``ampinit`` instead of ``apex``."""
    return node.with_changes(value=node.value.replace("apex", "ampinit", 1))


def _names_apex(node: cst.SimpleString) -> bool:
    try:
        value = node.evaluated_value
    except Exception:  # an f-string or bytes: not a module name
        return False
    return isinstance(value, str) and is_apex(value)


def _chain_name(binding: Binding, name: str, depth: int) -> str:
    """The Apex name a chain's mapped prefix stands for (``apex.normalization.FusedLayerNorm``)."""
    parts = [binding.qualified, *name.split(".")[1:]]
    return ".".join(parts[: len(parts) - depth] if depth else parts)


def _semicolons(smalls: Sequence[cst.BaseSmallStatement]) -> list[cst.BaseSmallStatement]:
    """Small statements to share one line: a semicolon after each but the last."""
    out = []
    for index, small in enumerate(smalls):
        last = index == len(smalls) - 1
        if last:
            out.append(small.with_changes(semicolon=cst.MaybeSentinel.DEFAULT))
        elif not isinstance(small.semicolon, cst.Semicolon):
            semicolon = cst.Semicolon(cst.SimpleWhitespace(""), cst.SimpleWhitespace(" "))
            out.append(small.with_changes(semicolon=semicolon))
        else:
            out.append(small)
    return out


def _rules_is_apex(name: str) -> bool:
    return is_apex(name)


def _dedupe(statements: list[cst.SimpleStatementLine]) -> list[cst.SimpleStatementLine]:
    seen: set[str] = set()
    out = []
    for statement in statements:
        code = _cst.code(statement)
        if code not in seen:
            seen.add(code)
            out.append(statement)
    return out


def chain_target(binding: Binding, name: str) -> tuple[Target | None, int]:
    """The target for the longest mapped prefix of ``name`` (a chain rooted at a package binding), and how many
    trailing attributes stay after it."""
    rest = name.split(".")[1:]
    for keep in range(len(rest), 0, -1):
        qualified = ".".join([binding.qualified, *rest[:keep]])
        target = _rules.TARGETS.get(qualified)
        if target is None:
            continue
        surface = _rules.MODULE_SURFACES.get(qualified)
        if surface is not None and keep < len(rest) and rest[keep] not in surface:
            return _rules.target_for(f"{qualified}.{rest[keep]}"), len(rest) - keep - 1
        return target, len(rest) - keep
    if not rest:
        return None, 0
    first = ".".join([binding.qualified, rest[0]])
    if first in _rules.TO_PYTHON_FLOAT_NAMES:
        return None, 0
    target = _rules.target_for(first)
    for keep in range(len(rest), 1, -1):
        note = _rules.SPECIAL_NOTES.get(".".join([binding.qualified, *rest[:keep]]))
        if note is not None:
            return dataclasses.replace(target, note=note, info=None), len(rest) - 1
    return target, len(rest) - 1


def add_comments(node: Any, notes: list[str]) -> Any:
    """Put ``# ampinit: note`` lines above a statement (once: an identical comment is not added again)."""
    if isinstance(node, cst.FlattenSentinel):
        nodes = list(node.nodes)
        if nodes:
            nodes[0] = add_comments(nodes[0], notes)
        return cst.FlattenSentinel(nodes)
    if not hasattr(node, "leading_lines"):
        return node
    existing = {line.comment.value for line in node.leading_lines if line.comment is not None}
    lines = list(node.leading_lines)
    for note in dict.fromkeys(notes):
        text = COMMENT_PREFIX + note
        if text not in existing:
            lines.append(cst.EmptyLine(comment=cst.Comment(text)))
    return node.with_changes(leading_lines=lines)


def classify(module: cst.Module, wrapper: MetadataWrapper) -> tuple[dict[str, Binding], _Collector]:
    """Decide, for each Apex binding, how it is rewritten (see the module docstring)."""
    raw = apex_bindings(module)
    collector = _Collector(raw)
    wrapper.visit(collector)
    bindings: dict[str, Binding] = {}
    # ``from apex.parallel.LARC import LARC``, or ``apex.parallel.LARC.LARC(...)`` through ``import apex``
    wrapped = any(q.startswith(_rules.OPTIMIZER_WRAPPERS) for q in raw.values()) or (
        any(q in _rules.PACKAGES for q in raw.values()) and ".LARC" in module.code
    )
    reads_amp_stash = any(f".{name}" in module.code for name in _rules.COMPAT_AMP_ATTRIBUTES)
    for local, qualified in raw.items():
        used = collector.used.get(local, set())
        if qualified in _rules.PACKAGES:
            binding = Binding(local, qualified, "package")
        elif qualified in _rules.TO_PYTHON_FLOAT_NAMES:
            binding = Binding(local, qualified, "inline", imports=set())
        else:
            target = _rules.target_for(qualified)
            surface = _rules.MODULE_SURFACES.get(qualified)
            # dunders (``amp.__dict__``, ``__version__``...) exist on every module: not names outside the API
            unknown = sorted(u for u in used - surface if not u.startswith("__")) if surface is not None else []
            if unknown:
                target = _rules.compat_target(qualified, unknown)
            elif qualified == "apex.amp" and wrapped:
                target = Target(_rules.COMPAT, "amp", info=_rules.WRAPPER_INFO)
            elif qualified == "apex.amp" and reads_amp_stash:
                target = Target(_rules.COMPAT, "amp", info=_rules.COMPAT_AMP_INFO)
            kind = "direct" if target.importable else "inline"
            if not target.resolves:
                kind = "keep"
            binding = Binding(local, qualified, kind, target, {"torch"} if kind == "inline" else set())
        bindings[local] = binding
    return bindings, collector


class _ImportNeeds(cst.CSTVisitor):
    """The modules the rewritten chains of package bindings (``import apex``) and inline uses need."""

    METADATA_DEPENDENCIES = (ParentNodeProvider, ExpressionContextProvider, ScopeProvider)

    def __init__(self, bindings: dict[str, Binding]) -> None:
        self.bindings = bindings

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Attribute(self, node: cst.Attribute) -> None:
        parent = self.get_metadata(ParentNodeProvider, node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return
        name = dotted(node)
        binding = self.bindings.get((name or "").split(".")[0])
        if name is None or binding is None or binding.kind != "package":
            return
        target, _ = chain_target(binding, name)
        if target is not None and target.resolves:
            binding.imports.add(target.root_import)
        elif target is not None:
            binding.unresolved.add(name)

    def visit_Name(self, node: cst.Name) -> None:
        binding = self.bindings.get(node.value)
        if binding is not None and binding.kind == "package" and not binding.bare:
            parent = self.get_metadata(ParentNodeProvider, node)
            chain = isinstance(parent, cst.Attribute) and parent.value is node
            binding.bare = not chain and _reads_import(self, node)
        if binding is not None and binding.kind == "inline" and binding.qualified in _rules.TO_PYTHON_FLOAT_NAMES:
            parent = self.get_metadata(ParentNodeProvider, node)
            if not isinstance(parent, (cst.Call, cst.ImportAlias)):
                binding.imports.add("torch")


def migrate_module(source: str, to: str = "ampinit") -> tuple[str, list[Site]]:
    """Rewrite one module's Apex code to ampinit; returns the new source and the sites. ``to="torch"`` is the
    second pass of ``--to torch``: availability guards are flagged, not turned into checks for ampinit."""
    module = cst.parse_module(source)
    wrapper = MetadataWrapper(module)
    bindings, collector = classify(module, wrapper)
    words = (*GUARD_WORDS, "import *", "import_module", "__import__")
    if not bindings and not (("apex" in source or "amp_C" in source) and any(word in source for word in words)):
        return source, []
    wrapper.visit(_ImportNeeds(bindings))
    amp_locals = {
        b.local
        for b in bindings.values()
        if b.qualified == "apex.amp" and b.kind == "direct" and b.target is not None and b.target.module == "ampinit"
    }
    existing = {
        dotted(alias.name) or ""
        for statement in module.body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.Import)
        for alias in small.names
        if alias.asname is None and not is_apex(dotted(alias.name) or "")
    }
    local_functions = {s.name.value for s in module.body if isinstance(s, cst.FunctionDef)}
    transformer = _ToAmpinit(bindings, amp_locals, collector.stores, existing, to, local_functions)
    new = wrapper.visit(transformer)
    checked = unbound_calls(new.code) if to == "ampinit" else []
    sites = sorted(transformer.sites + checked, key=lambda s: s.line)
    return new.code, sites
