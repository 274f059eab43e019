"""``--to torch``: Apex's profiler hook ``apex.pyprof.nvtx.init()`` removed, with a note that names what is lost.

``pyprof.nvtx.init()`` (Apex 2019-08 to 2022-07) monkey-patched every function of ``torch``, ``torch.Tensor`` and
``torch.nn.functional`` (and the RNN modules' ``forward``) so that each call pushed NVTX ranges carrying its call
stack and its arguments' shapes, dtypes and scalar values, for pyprof's offline parser (``apex.pyprof.parse`` and
``apex.pyprof.prof``) to attribute the kernels of an nvprof/Nsight trace; each wrapper called the original function
unchanged, so no computation depended on it. The ranges themselves still come from
``torch.autograd.profiler.emit_nvtx`` (which such scripts wrap their loop in), and its ``record_shapes=True`` adds the
argument shapes natively. Removing the call is therefore safe for the training, but it is a change to what a profile
shows: the site needs a human to confirm it, while the file migrates.

Only that call (no arguments, as a statement of its own) and the imports that bind pyprof for it are rewritten.
Any other use (``pyprof.nvtx.wrap``, ``pyprof.parse``/``pyprof.prof``, the name passed or stored) leaves the file
as it is, refused with the use named and pyprof's successor package. ``apex.pyprof`` never had an ``init()`` of its
own (that is the standalone PyProf's ``import pyprof; pyprof.init()``): under Apex that call raised
``AttributeError``, so it is refused too rather than silently made to work.
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ampinit.migrate import _cst
from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import COMMENT_PREFIX, add_comments

#: Where pyprof went, for every refusal that names it.
SUCCESSOR = (
    "pyprof left Apex for NVIDIA's PyProf, whose successor is the nvidia-dlprof-pytorch-nvtx package; natively, "
    "torch.autograd.profiler.emit_nvtx(record_shapes=True) or torch.profiler record the argument shapes"
)
NOT_NATIVE = f"has no native torch equivalent (nor an ampinit one): {SUCCESSOR}"

#: The comment written where the call was (one ``# ampinit:`` line each).
NOTES = (
    "apex.pyprof.nvtx.init() removed by --to torch: it only wrapped torch functions in NVTX ranges carrying each "
    "call's argument shapes and dtypes for pyprof's parser (no computation depended on it).",
    "For those markers use torch.autograd.profiler.emit_nvtx(record_shapes=True), or torch.cuda.nvtx ranges; "
    "pyprof's successor is the nvidia-dlprof-pytorch-nvtx package.",
)
REMOVED = (
    "apex.pyprof.nvtx.init() removed: a profiling change (pyprof's per-call argument markers are lost; "
    "torch.autograd.profiler.emit_nvtx(record_shapes=True) records the shapes natively), confirm it"
)

#: The chain, after the pyprof-bound name, that calls Apex's hook, per what the name is bound to.
_HOOK = {"apex.pyprof": ("nvtx", "init"), "apex.pyprof.nvtx": ("init",)}


def _bindings(module: cst.Module) -> dict[str, str]:
    """Local names bound to ``apex.pyprof`` or ``apex.pyprof.nvtx`` by ``from apex import pyprof [as p]``,
    ``from apex.pyprof import nvtx`` or ``import apex.pyprof as p`` (``import apex.pyprof`` binds ``apex``: left to
    the refusal of the later pass)."""
    found: dict[str, str] = {}
    for node in _imports(module):
        for alias, qualified in _aliases(node):
            if qualified in _HOOK and (isinstance(node, cst.ImportFrom) or alias.asname is not None):
                found[_cst.local_name(alias)] = qualified
    return found


def _imports(module: cst.Module) -> list[cst.Import | cst.ImportFrom]:
    found: list[cst.Import | cst.ImportFrom] = []

    class Visitor(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> None:
            found.append(node)

        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            found.append(node)

    module.visit(Visitor())
    return found


def _aliases(node: cst.Import | cst.ImportFrom) -> list[tuple[cst.ImportAlias, str]]:
    """Each alias of an import with the qualified name it imports."""
    if isinstance(node, cst.Import):
        return [(alias, _cst.dotted(alias.name) or "") for alias in node.names]
    if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
        return []
    base = _cst.dotted(node.module)
    return [(alias, f"{base}.{_cst.dotted(alias.name)}") for alias in node.names]


def _binds(node: cst.Import | cst.ImportFrom, bound: dict[str, str]) -> bool:
    return any(q in _HOOK and _cst.local_name(a) in bound for a, q in _aliases(node))


class _Uses(cst.CSTVisitor):
    """Every reference to a pyprof-bound name: the hook calls (their ``Expr`` statements) and the others."""

    METADATA_DEPENDENCIES = (ParentNodeProvider, PositionProvider)

    def __init__(self, bound: dict[str, str]) -> None:
        self.bound = bound
        self.hooks: list[cst.Expr] = []
        self.others: list[tuple[int, str]] = []  # (line, the use's source)

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        qualified = self.bound.get(node.value)
        if qualified is None:
            return
        parent = self.get_metadata(ParentNodeProvider, node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return
        use: cst.CSTNode = node
        for attr in _HOOK[qualified]:
            parent = self.get_metadata(ParentNodeProvider, use)
            if not (isinstance(parent, cst.Attribute) and parent.attr.value == attr):
                break
            use = parent
        else:
            call = self.get_metadata(ParentNodeProvider, use)
            statement = self.get_metadata(ParentNodeProvider, call)
            if isinstance(call, cst.Call) and call.func is use and not call.args and isinstance(statement, cst.Expr):
                self.hooks.append(statement)
                return
        outer = self.get_metadata(ParentNodeProvider, use)
        if isinstance(outer, cst.Call) and outer.func is use:
            use = outer
        elif isinstance(outer, cst.Attribute):  # name the attribute used: pyprof.nvtx.wrap, pyprof.init
            use = outer
            call = self.get_metadata(ParentNodeProvider, use)
            if isinstance(call, cst.Call) and call.func is use:
                use = call
        line = _cst.line(self.metadata[PositionProvider], node)
        self.others.append((line, _cst.code(use)))


def _last_semicolon_dropped(smalls: list[Any]) -> list[Any]:
    return [*smalls[:-1], smalls[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]


class _Remove(cst.CSTTransformer):
    """The hook statements and the pyprof imports dropped; the notes go on the statement after the hook call, or on
    a ``pass`` where the block would be left empty."""

    def __init__(self, hooks: set[int], bound: set[str]) -> None:
        super().__init__()
        self.hooks = hooks
        self.bound = bound

    def _small(self, small: cst.BaseSmallStatement) -> tuple[cst.BaseSmallStatement | None, bool]:
        """The statement kept (None when dropped) and whether it was a hook call."""
        if id(small) in self.hooks:
            return None, True
        if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
            drop = [a for a, q in _aliases(small) if q in _HOOK and _cst.local_name(a) in self.bound]
            kept = _cst.without_aliases(small, drop)
            return (None if isinstance(kept, cst.RemovalSentinel) else kept), False
        return small, False

    def _body(self, original: Any, updated: Any) -> list[Any]:
        body: list[Any] = []
        carried: list[cst.EmptyLine] = []  # the comments above dropped statements (not their blank lines)
        note = False
        for before, after in zip(original.body, updated.body, strict=True):
            if isinstance(before, cst.SimpleStatementLine):
                smalls = [self._small(s) for s in before.body]
                if any(s is None for s, _ in smalls):
                    note = note or any(hook for _, hook in smalls)
                    kept = [s for s, _ in smalls if s is not None]
                    if not kept:
                        carried += [line for line in before.leading_lines if line.comment is not None]
                        continue
                    after = after.with_changes(body=_last_semicolon_dropped(kept))
            if carried:
                after = after.with_changes(leading_lines=[*carried, *after.leading_lines])
                carried = []
            if note:
                after = add_comments(after, list(NOTES))
                note = False
            body.append(after)
        if note or carried or not body:
            filler = cst.SimpleStatementLine([cst.Pass()], leading_lines=carried)
            body.append(add_comments(filler, list(NOTES)) if note else filler)
        return body

    def leave_SimpleStatementSuite(
        self, original_node: cst.SimpleStatementSuite, updated_node: cst.SimpleStatementSuite
    ) -> Any:
        smalls = [self._small(s) for s in original_node.body]
        if all(s is not None for s, _ in smalls):
            return updated_node
        kept = [s for s, _ in smalls if s is not None] or [cst.Pass()]
        suite = updated_node.with_changes(body=_last_semicolon_dropped(kept))
        if not any(hook for _, hook in smalls) or updated_node.trailing_whitespace.comment is not None:
            return suite
        comment = cst.Comment(f"{COMMENT_PREFIX}apex.pyprof.nvtx.init() removed by --to torch (see the report)")
        return suite.with_changes(trailing_whitespace=cst.TrailingWhitespace(cst.SimpleWhitespace("  "), comment))

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        return updated_node.with_changes(body=self._body(original_node, updated_node))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> Any:
        return updated_node.with_changes(body=self._body(original_node, updated_node))


def rewrite_pyprof(source: str) -> tuple[str, list[Site]]:
    """Remove ``apex.pyprof.nvtx.init()`` calls and the imports that bind pyprof for them, each call reported as a
    profiling change to confirm. Where pyprof is used otherwise, the source is returned unchanged with a refusal
    per such use (:data:`NOT_NATIVE`)."""
    module = cst.parse_module(source)
    bound = _bindings(module)
    if not bound:
        return source, []
    wrapper = MetadataWrapper(module)
    uses = _Uses(bound)
    wrapper.visit(uses)
    if uses.others:
        return source, [Site(line, f"apex.pyprof ({use}) {NOT_NATIVE}", True) for line, use in uses.others]
    positions = wrapper.resolve(PositionProvider)
    sites = [Site(_cst.line(positions, hook), REMOVED, True) for hook in uses.hooks]
    if not sites:
        line = min(_cst.line(positions, node) for node in _imports(wrapper.module) if _binds(node, bound))
        sites = [Site(line, "apex.pyprof is imported but never used here: the import is removed")]
    new = wrapper.module.visit(_Remove({id(hook) for hook in uses.hooks}, set(bound)))
    return new.code, sites
