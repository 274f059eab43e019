"""``--to torch``: Megatron-style ``multi_tensor_applier(amp_C.<kernel>, overflow_buf, tensor_lists, *args)`` calls
of the two kernels that torch's foreach ops and ``linalg.vector_norm`` reproduce, through a function written into
the file (Apex semantics, NVIDIA/apex ``csrc/multi_tensor_l2norm_kernel.cu`` and ``multi_tensor_scale_kernel.cu``):

* ``multi_tensor_l2norm`` ``[tensors]``, ``per_tensor=False``: the L2 norm of all tensors together, accumulated in
  fp32, as a shape-[1] fp32 tensor, and the per-tensor fp32 norms (an empty tensor unless ``per_tensor``). The
  kernel sets the overflow buffer when a chunk's partial sum is not finite; that depends on Apex's chunking, so a
  call whose buffer the file reads anywhere else is refused;
* ``multi_tensor_scale`` ``[inputs, outputs]``, ``scale``: ``out = in * scale`` in fp32, written in the output's
  dtype, and the overflow buffer set to 1 when an input holds an inf or a NaN (exactly Apex's rule, so it is kept,
  without a host sync). Its result is None: a call whose result is used is refused.

Other kernels, an op reached through an alias (``l2_norm_impl = amp_C.multi_tensor_l2norm``) or any other use of
``amp_C``/``multi_tensor_applier`` keep the import, and the file is then refused for it.
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ampinit.migrate import _cst
from ampinit.migrate._helper_modules import add_definitions
from ampinit.migrate._report import Site

L2NORM = '''def {name}(tensor_lists, per_tensor=False):
    """amp_C.multi_tensor_l2norm as Apex computes it: the L2 norm of all tensors of tensor_lists[0] together,
    accumulated in fp32, as a shape-[1] fp32 tensor, and each tensor's norm (empty unless per_tensor); written by
    ampinit migrate --to torch."""
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensor_lists[0]])
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else norms.new_empty(0)
'''

SCALE = '''def {name}(overflow_buf, tensor_lists, scale):
    """amp_C.multi_tensor_scale as Apex computes it: out = in * scale in fp32, written in out's dtype, for
    tensor_lists = [inputs, outputs]; overflow_buf is set to 1 when an input holds an inf or a NaN; written by
    ampinit migrate --to torch."""
    inputs, outputs = tensor_lists
    nonfinite = torch.stack([~torch.isfinite(t).all() for t in inputs]).any()
    overflow_buf.masked_fill_(nonfinite, 1)
    for source, target in zip(inputs, outputs):
        target.copy_(source.float() * scale)
'''

KERNELS = {
    "multi_tensor_l2norm": (L2NORM, ("foreach_l2norm", "_foreach_l2norm")),
    "multi_tensor_scale": (SCALE, ("foreach_scale", "_foreach_scale")),
}


class _Bindings(cst.CSTVisitor):
    """Module-level names of Apex's applier, of ``amp_C``, and of the two kernels imported from it."""

    def __init__(self) -> None:
        self.appliers: set[str] = set()
        self.modules: set[str] = set()
        self.kernels: dict[str, str] = {}  # local name -> kernel

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            if _cst.dotted(alias.name) == "amp_C":
                self.modules.add(_cst.local_name(alias))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        module = _cst.dotted(node.module)
        for alias in node.names:
            name = _cst.dotted(alias.name)
            if module == "apex.multi_tensor_apply" and name == "multi_tensor_applier":
                self.appliers.add(_cst.local_name(alias))
            elif module == "amp_C" and name in KERNELS:
                self.kernels[_cst.local_name(alias)] = name or ""


class _Uses(cst.CSTVisitor):
    """Applier calls of the two kernels, every reference to a name or attribute chain, every name in the file."""

    METADATA_DEPENDENCIES = (ParentNodeProvider,)

    def __init__(self, bindings: _Bindings) -> None:
        self.bindings = bindings
        self.calls: list[tuple[cst.Call, str]] = []
        self.references: list[tuple[str, cst.CSTNode]] = []  # (code, node) of names and attribute chains read
        self.names: set[str] = set()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value in self.bindings.appliers and node.args:
            kernel = self.kernel(node.args[0].value)
            if kernel is not None:
                self.calls.append((node, kernel))

    def kernel(self, op: cst.BaseExpression) -> str | None:
        if isinstance(op, cst.Name):
            return self.bindings.kernels.get(op.value)
        modules = self.bindings.modules
        if isinstance(op, cst.Attribute) and _cst.dotted(op.value) in modules and op.attr.value in KERNELS:
            return op.attr.value
        return None

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)
        parent = self.get_metadata(ParentNodeProvider, node)
        if not (isinstance(parent, cst.Attribute) and parent.attr is node):
            self.references.append((node.value, node))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        code = _cst.dotted(node)
        if code is not None:
            self.references.append((code, node))


def _check(call: cst.Call, kernel: str, uses: _Uses, parents: Any) -> str | None:
    """Why this call cannot be rewritten, or None."""
    if any(a.keyword is not None or a.star for a in call.args):
        return f"multi_tensor_applier(amp_C.{kernel}, ...) with keyword or starred arguments: rewrite it by hand"
    count = len(call.args)
    if kernel == "multi_tensor_scale":
        if count != 4:
            return "multi_tensor_applier(amp_C.multi_tensor_scale, ...) needs (buffer, [inputs, outputs], scale)"
        if not isinstance(parents[call], cst.Expr):
            return "the result of multi_tensor_applier(amp_C.multi_tensor_scale, ...) is used: Apex returns None there"
        return None
    if count not in (3, 4):
        return "multi_tensor_applier(amp_C.multi_tensor_l2norm, ...) needs (buffer, [tensors][, per_tensor])"
    buffer = _cst.dotted(call.args[1].value)
    if buffer is None:
        return "the overflow buffer of amp_C.multi_tensor_l2norm is an expression: whether it is read cannot be told"
    passed = {id(c.args[1].value) for c, _ in uses.calls if len(c.args) > 1}
    for code, node in uses.references:
        if code != buffer or id(node) in passed or _is_store(node, parents):
            continue
        return (
            f"the overflow buffer `{buffer}` of amp_C.multi_tensor_l2norm is read elsewhere in the file: the kernel "
            "sets it when a chunk's partial sum is not finite, which depends on Apex's chunking; use --to ampinit"
        )
    return None


def _is_store(node: cst.CSTNode, parents: Any) -> bool:
    parent = parents.get(node)
    return isinstance(parent, (cst.AssignTarget, cst.AnnAssign)) and getattr(parent, "target", None) is node


class _Rewrite(cst.CSTTransformer):
    def __init__(self, calls: dict[int, str], helpers: dict[str, str], dropped: set[str]) -> None:
        super().__init__()
        self.calls = calls
        self.helpers = helpers
        self.dropped = dropped

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        kernel = self.calls.get(id(original_node))
        if kernel is None:
            return updated_node
        args = list(updated_node.args)
        kept = args[2:] if kernel == "multi_tensor_l2norm" else args[1:]
        return updated_node.with_changes(func=cst.Name(self.helpers[kernel]), args=kept)

    def leave_Import(self, original_node: cst.Import, updated_node: cst.Import) -> Any:
        return self._drop(updated_node)

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> Any:
        if isinstance(updated_node.names, cst.ImportStar):
            return updated_node
        return self._drop(updated_node)

    def _drop(self, node: Any) -> Any:
        return _cst.without_aliases(node, [a for a in node.names if _cst.local_name(a) in self.dropped])


def rewrite_multi_tensor(source: str) -> tuple[str, list[Site]]:
    """Rewrite the applier calls of ``multi_tensor_l2norm``/``multi_tensor_scale`` (all of them, or none: a call that
    cannot be rewritten leaves the source as it is, with the reason) and drop the imports nothing else uses."""
    module = cst.parse_module(source)
    bindings = _Bindings()
    module.visit(bindings)
    if not bindings.appliers:
        return source, []
    wrapper = MetadataWrapper(module)
    uses = _Uses(bindings)
    wrapper.visit(uses)
    if not uses.calls:
        return source, []
    parents = wrapper.resolve(ParentNodeProvider)
    positions = wrapper.resolve(PositionProvider)
    refused = [(c, why) for c, kernel in uses.calls for why in [_check(c, kernel, uses, parents)] if why is not None]
    if refused:
        return source, [Site(_cst.line(positions, c), why, True) for c, why in refused]
    kernels = sorted({kernel for _, kernel in uses.calls})
    helpers = {k: _cst.fresh_name(KERNELS[k][1], uses.names) for k in kernels}
    gone = _rewritten_nodes(uses.calls)
    still = {code.split(".")[0] for code, node in uses.references if id(node) not in gone}
    dropped = {n for n in bindings.appliers | bindings.modules | set(bindings.kernels) if n not in still}
    new = wrapper.module.visit(_Rewrite({id(c): k for c, k in uses.calls}, helpers, dropped))
    has_torch = _cst.imports_torch(new)
    new = add_definitions(new, [] if has_torch else ["torch"], [KERNELS[k][0].format(name=helpers[k]) for k in kernels])
    sites = [
        Site(
            _cst.line(positions, c),
            f"multi_tensor_applier(amp_C.{k}, ...) -> {helpers[k]}(...): "
            + (
                "torch.linalg.vector_norm in fp32, shape [1] as Apex's"
                if k == "multi_tensor_l2norm"
                else "a multiply in fp32 + copy, the overflow buffer set on inf/NaN as Apex's"
            ),
        )
        for c, k in uses.calls
    ]
    return new.code, sites


def _rewritten_nodes(calls: list[tuple[cst.Call, str]]) -> set[int]:
    """The nodes that go with the rewritten calls: the applier's name and the kernel expression."""
    gone: set[int] = set()

    class _Collect(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            gone.add(id(node))
            return True

    for call, _ in calls:
        call.func.visit(_Collect())
        call.args[0].value.visit(_Collect())
    return gone
