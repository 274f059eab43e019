"""The O1/O4 op lists, as data: Apex's lists, the aten operators they reach, and PyTorch's CUDA lists.

``cast_policy="apex"`` runs every op the way Apex's O1 did on CUDA, on every device. Apex patched Python
functions (``torch.nn.functional.softmax``, ``torch.exp``, ``Tensor.__pow__``...); ampinit adds kernels on the
autocast dispatch key instead, so each Apex name is mapped here to the aten operators it reaches. The CUDA
autocast lists are included too, because ``cast_policy="apex"`` on CUDA keeps them: adding them to every other
device gives one behaviour everywhere. :func:`plan` derives what a device still lacks from its own
registrations, so CUDA gets only the few ops its native lists miss, and the CPU gets the rest.

Policies: ``lower`` (cast floating inputs to the autocast dtype), ``fp32`` (cast them to float32),
``promote`` (cast them to the widest floating dtype among them), ``banned`` (Apex's error on half inputs, or
fp32 with ``allow_banned``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Policy = Literal["lower", "fp32", "promote", "banned"]

# fmt: off
# -- Apex's lists, verbatim (apex/amp/lists/{functional,torch,tensor}_overrides.py) ----------------------------
APEX_FUNCTIONAL_FP16 = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                        "conv_tbc", "linear")
APEX_FUNCTIONAL_FP32 = (
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss", "ctc_loss",
)
APEX_FUNCTIONAL_BANNED = ("binary_cross_entropy",)
# addbmm/baddbmm/bmm are appended by Apex on CUDA >= 9.1 builds, the configuration Apex's O1 was used in.
APEX_TORCH_FP16 = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                   "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm")
APEX_TORCH_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
                   "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm")
APEX_TORCH_CASTS = ("addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "eq", "equal",
                    "ge", "gt", "le", "lt", "ne")
APEX_TORCH_SEQUENCE_CASTS = ("cat", "stack")
APEX_TENSOR_FP16 = ("__matmul__",)  # plus every APEX_TORCH_FP16 name that is a Tensor method
APEX_TENSOR_FP32 = ("__ipow__", "__pow__", "__rpow__", "cpu")  # plus every APEX_TORCH_FP32 Tensor method
APEX_TENSOR_CASTS = (
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__",
)

# Apex's banned-function message, addressed to ampinit's API instead of ``amp.init()``.
BANNED_BCE_MESSAGE = (
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` It requires that the "
    "output of the previous function be already a FloatTensor. \n\nMost models have a Sigmoid right before "
    "BCELoss. In that case, you can use\n    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single "
    "layer that is compatible with amp.\nAnother option is to add\n    "
    "ampinit.register_float_function(torch, 'sigmoid')\nbefore calling `ampinit.initialize()`.\nIf you _really_ "
    "know what you are doing, you can disable this warning by passing allow_banned=True to "
    "`ampinit.initialize(..., allow_banned=True)`."
)
# PyTorch's message for binary_cross_entropy under CUDA autocast (aten/src/ATen/autocast_mode.cpp): the behaviour
# ampinit's kernel keeps for threads where no ampinit policy is on, since it replaces the native kernel.
NATIVE_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

# -- Apex names -> the aten operators that carry them ------------------------------------------------------------
# An empty tuple: no aten operator of its own. Either the function is Python composed of listed ops (normalize:
# norm then a promoting division; local_response_norm: pow; multilabel_soft_margin_loss: sum; softmin: softmax),
# or autocast leaves the kind of op alone by design (in-place ``__ipow__`` and the Tensor casts ``__iadd__``...
# keep the tensor's dtype; ``cpu`` is a device copy, which ampinit does not turn into a float cast).
APEX_TO_ATEN: Mapping[str, tuple[str, ...]] = {
    **{name: (name,) for name in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                                  "conv_transpose3d", "conv_tbc", "linear", "prelu", "addmm", "addmv", "addr",
                                  "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm")},
    "__matmul__": ("matmul",),
    "interpolate": (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    "grid_sample": ("grid_sampler",),
    "softmin": (),
    "layer_norm": ("layer_norm", "native_layer_norm"),
    "local_response_norm": (),
    "normalize": (),
    "cross_entropy": ("cross_entropy_loss",),
    "multilabel_soft_margin_loss": (),
    "nll_loss": ("nll_loss", "nll_loss2d", "nll_loss_nd"),
    **{name: (name,) for name in ("softplus", "log_softmax", "softmax", "gelu", "group_norm", "cosine_similarity",
                                  "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss", "kl_div",
                                  "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
                                  "multi_margin_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss",
                                  "soft_margin_loss", "triplet_margin_loss", "ctc_loss")},
    **{name: (name,) for name in ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
                                  "reciprocal", "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "prod",
                                  "std", "sum", "var", "renorm")},
    # torch.norm and Tensor.norm dispatch to linalg_vector_norm/linalg_matrix_norm for most arguments.
    "norm": ("norm", "linalg_vector_norm", "linalg_matrix_norm", "linalg_norm", "frobenius_norm", "nuclear_norm"),
    "__pow__": ("pow",),
    "__rpow__": ("pow",),
    "__ipow__": (),
    "cpu": (),
    "cross": ("cross", "linalg_cross"),
    **{name: (name,) for name in ("bilinear", "dot", "binary_cross_entropy")},
    # Type-promoting ops: aten's own type promotion already runs mixed half/fp32 tensors in fp32 (0-dim tensors
    # aside, which never widen a dimensioned tensor's dtype), so a kernel would only add dispatch cost.
    **{name: () for name in ("addcdiv", "addcmul", "atan2", "add", "div", "mul", "eq", "equal", "ge", "gt", "le",
                             "lt", "ne", "cat", "stack", *APEX_TENSOR_CASTS)},
}

# -- PyTorch's CUDA autocast lists (aten/src/ATen/autocast_mode.h), which ``cast_policy="apex"`` keeps on CUDA ---
PYTORCH_CUDA_LOWER = (
    "_convolution", "convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
)
PYTORCH_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa", "prod", "softmax", "log_softmax",
    "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum", "norm",
)
PYTORCH_CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                        "index_put", "tensordot", "scatter_add")

# fmt: on

# The recurrent layers: Apex cast them (rnn_compat.py) and CUDA autocast casts them at ``_cudnn_rnn``.
RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
# A device whose autocast key has a kernel for the value's op already casts the key's op (at a lower level).
COVERED_BY: Mapping[str, str] = {name: "_cudnn_rnn" for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
# Ops of PyTorch's CUDA promote list that aten's own type promotion already widens on every device, as Apex's
# promote did: both agree, so they get no kernel (a Python kernel would only add its cost to every call).
NATIVELY_PROMOTED = ("addcdiv", "addcmul", "atan2")
# Policies of ops that PyTorch's own type promotion does not widen: mixed half/fp32 inputs raise natively.
EXTRA_PROMOTE = ("vdot", "linalg_cross", "index_put", "tensordot", "scatter_add")

# -- What ``cast_policy="auto"`` leaves to native autocast: entries measured to change no result ---------------------
# Measured on one NVIDIA H100 80GB HBM3 with torch 2.11.0+cu130, bf16 (O4), by
# ``python -m benchmarks.cast_list_effect --device cuda --dtype bf16``: each overload reached by a probe, on top of
# native autocast alone, gave the same bits as native autocast after the consumer's rounding, and the losses of
# the decoder and the MLP after 3 steps agreed with native's within the run-to-run spread (the table is in
# docs/cast-policy.md). Not registered, an overload runs as native autocast runs it: these are composites whose
# inner ops autocast casts (the ``padding`` convolutions, ``nll_loss_nd``, ``linalg_norm``), or kernels that
# compute in fp32 inside and round once to the half dtype, forward and backward (gelu; nearest interpolation,
# whose backward gathers each input's gradient in fp32 and rounds it once).
#
# The measurement compared forward outputs. The backward of the other interpolations (linear, bilinear,
# trilinear, bicubic, antialiased) is why they stay registered: CUDA's backward kernels add every output's share
# into the input's gradient with atomic adds in the gradient's own dtype (``fastAtomicAdd`` on ``scalar_t`` in
# ATen's UpSample*.cu), so in half each of those adds rounds, where Apex's fp32 op accumulates in fp32 and the
# cast's backward rounds once. ``benchmarks/cast_list_effect.py`` now compares gradients too.
_CUDA_UNCHANGED = (
    "aten.conv1d.padding", "aten.conv2d.padding", "aten.conv3d.padding", "aten.gelu.default",
    "aten.upsample_nearest1d.vec", "aten.upsample_nearest2d.vec", "aten.upsample_nearest3d.vec",
    "aten._upsample_nearest_exact2d.vec", "aten.nll_loss_nd.default", "aten.linalg_norm.default",
)  # fmt: skip
# fp16 (``--dtype fp16``, the same machine, a later run): the same entries changed nothing on the probes, and the
# argument in docs/cast-policy.md carries that beyond the probes' inputs (nothing left out can overflow fp16
# where Apex's fp32 result is finite).
UNCHANGED: Mapping[tuple[str, torch.dtype], frozenset[str]] = {
    ("cuda", torch.bfloat16): frozenset(_CUDA_UNCHANGED),
    ("cuda", torch.float16): frozenset(_CUDA_UNCHANGED),
}


# -- Apex's lists as one value: the defaults, or as code edited ``apex.amp.lists`` before initialize ----------------
ListKind = Literal["FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"]
LIST_KINDS: tuple[ListKind, ...] = ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS")
# Apex's list modules and the namespace each one patches (its ``MODULE``).
LIST_MODULES: Mapping[str, object] = {
    "functional_overrides": torch.nn.functional,
    "torch_overrides": torch,
    "tensor_overrides": torch.Tensor,
}
# The policy of each kind; Apex applied them in this order, so where a name sits in two lists of one module, the
# first one's cast is the one the function sees (the later wrapper's cast runs first and is cast over).
KIND_POLICY: Mapping[ListKind, Policy] = {
    "FP16_FUNCS": "lower",
    "FP32_FUNCS": "fp32",
    "CASTS": "promote",
    "SEQUENCE_CASTS": "promote",
}


@dataclass(frozen=True)
class ApexLists:
    """Apex's O1 lists by module and kind: ``(module, kind) -> names``, e.g. ``("torch_overrides", "FP32_FUNCS")``."""

    lists: tuple[tuple[str, ListKind, tuple[str, ...]], ...]

    @classmethod
    def of(cls, lists: Mapping[tuple[str, ListKind], Sequence[str]]) -> ApexLists:
        for (module, kind), names in lists.items():
            if module not in LIST_MODULES or kind not in LIST_KINDS:
                raise ValueError(f"No Apex list {module}.{kind}; allowed: {sorted(LIST_MODULES)} x {list(LIST_KINDS)}")
            bad = [name for name in names if not isinstance(name, str)]
            if bad:
                raise TypeError(f"apex.amp.lists.{module}.{kind} must hold function names (str), found {bad[0]!r}")
        ordered = sorted((module, kind, tuple(names)) for (module, kind), names in lists.items())
        return cls(tuple(ordered))

    def get(self, module: str, kind: ListKind) -> tuple[str, ...]:
        return next((names for m, k, names in self.lists if (m, k) == (module, kind)), ())

    def names(self, kind: ListKind) -> set[str]:
        """The names one kind holds in any module (``torch.exp`` and ``Tensor.exp`` reach one aten operator)."""
        return {name for _, k, names in self.lists if k == kind for name in names}


def _tensor_list(own: tuple[str, ...], torch_names: tuple[str, ...]) -> tuple[str, ...]:
    # Apex's tensor_overrides: its own names, then every torch_overrides name that is also a Tensor method.
    return own + tuple(name for name in torch_names if hasattr(torch.Tensor, name))


DEFAULT_LISTS = ApexLists.of(
    {
        ("functional_overrides", "FP16_FUNCS"): APEX_FUNCTIONAL_FP16,
        ("functional_overrides", "FP32_FUNCS"): APEX_FUNCTIONAL_FP32,
        ("functional_overrides", "CASTS"): (),
        ("functional_overrides", "SEQUENCE_CASTS"): (),
        ("torch_overrides", "FP16_FUNCS"): APEX_TORCH_FP16,
        ("torch_overrides", "FP32_FUNCS"): APEX_TORCH_FP32,
        ("torch_overrides", "CASTS"): APEX_TORCH_CASTS,
        ("torch_overrides", "SEQUENCE_CASTS"): APEX_TORCH_SEQUENCE_CASTS,
        ("tensor_overrides", "FP16_FUNCS"): _tensor_list(APEX_TENSOR_FP16, APEX_TORCH_FP16),
        ("tensor_overrides", "FP32_FUNCS"): _tensor_list(APEX_TENSOR_FP32, APEX_TORCH_FP32),
        ("tensor_overrides", "CASTS"): _tensor_list(APEX_TENSOR_CASTS, APEX_TORCH_CASTS),
        ("tensor_overrides", "SEQUENCE_CASTS"): (),
    }
)

# Where edited lists come from: ``apex.amp.lists`` (the compat layer) installs a reader of its modules when it is
# first imported; until then every session runs on the defaults.
_source: Callable[[], ApexLists] | None = None


def read_lists_from(source: Callable[[], ApexLists]) -> None:
    """Have every later O1/O4 ``"apex"`` session run on the lists ``source()`` returns at its ``initialize``."""
    global _source
    _source = source


def current_lists() -> ApexLists:
    return DEFAULT_LISTS if _source is None else _source()


def python_patches(lists: ApexLists) -> list[tuple[object, str, Policy]]:
    """The names ``lists`` adds that no kernel carries: ``(namespace, name, policy)``, patched as Apex did.

    A name reaches the aten operators of :data:`APEX_TO_ATEN`; one added to a list that maps to none (``sigmoid``
    appended to ``FP32_FUNCS``, or ``softmin`` moved to ``FP16_FUNCS``) is wrapped in Python for the session, with
    the list's cast, exactly like Apex's patch of ``MODULE.name``. A name the namespace lacks is skipped, as
    Apex skipped it.
    """
    patches = []
    for module, kind, names in lists.lists:
        defaults, namespace = DEFAULT_LISTS.get(module, kind), LIST_MODULES[module]
        for name in names:
            if name not in defaults and not APEX_TO_ATEN.get(name) and hasattr(namespace, name):
                patches.append((namespace, name, KIND_POLICY[kind]))
    return patches


def _apex_ops(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(op for name in sorted(names) for op in APEX_TO_ATEN.get(name, ()))


def op_policies(lists: ApexLists = DEFAULT_LISTS) -> dict[str, Policy]:
    """Every aten operator (overload packet name) ``cast_policy="apex"`` covers with ``lists``, with its policy.

    PyTorch's CUDA lists complete Apex's on every device, except for the operators of names ``lists`` removed
    from Apex's defaults: those follow no list but the device's own.
    """
    policies: dict[str, Policy] = {}
    removed = set(_apex_ops(DEFAULT_LISTS.names("FP32_FUNCS") - lists.names("FP32_FUNCS")))
    removed |= set(_apex_ops(DEFAULT_LISTS.names("FP16_FUNCS") - lists.names("FP16_FUNCS")))
    # Apex's lists come first and win where PyTorch's CUDA lists disagree (grid_sampler: Apex fp32, CUDA promote).
    sources: tuple[tuple[Policy, Iterable[str]], ...] = (
        ("banned", _apex_ops(APEX_FUNCTIONAL_BANNED)),
        ("lower", _apex_ops(lists.names("FP16_FUNCS"))),
        ("fp32", _apex_ops(lists.names("FP32_FUNCS"))),
        ("promote", _apex_ops(lists.names("CASTS") | lists.names("SEQUENCE_CASTS"))),
        ("lower", RNN_OPS),
        ("lower", (op for op in PYTORCH_CUDA_LOWER if op not in removed)),
        ("fp32", (op for op in PYTORCH_CUDA_FP32 if op not in removed)),
        ("promote", (op for op in PYTORCH_CUDA_PROMOTE if op not in NATIVELY_PROMOTED)),
        ("promote", EXTRA_PROMOTE),
    )
    for policy, ops in sources:
        for op in ops:
            policies.setdefault(op, policy)
    return policies


def _overload_names(op: str) -> list[str]:
    """The functional overloads of ``aten::op`` that the dispatcher knows and that take a tensor."""
    packet = getattr(torch.ops.aten, op)
    names = []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if schema.is_mutable or not any("Tensor" in str(arg.type) for arg in schema.arguments):
            continue
        if any(arg.name in ("dtype", "out_dtype") and str(arg.type) == "int" for arg in schema.arguments):
            continue  # a required output dtype: the caller chose the precision, autocast leaves such calls alone
        qualified = f"aten::{op}" if overload == "default" else f"aten::{op}.{overload}"
        try:
            torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")
        except RuntimeError:  # a Python-only overload (e.g. einsum.sublist): nothing to register
            continue
        names.append(overload)
    return names


def plan(dispatch_key: str, lists: ApexLists = DEFAULT_LISTS) -> dict[torch._ops.OpOverload, Policy]:
    """The kernels ``dispatch_key`` (e.g. ``"AutocastCPU"``) lacks for Apex's semantics with ``lists``, by overload.

    An overload gets a kernel when the key has none for it (its native list does not cover it), except for the
    banned ops, whose native kernel (fp32 on CPU, an error on CUDA) is replaced by Apex's behaviour.
    """
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    kernels: dict[torch._ops.OpOverload, Policy] = {}
    for op, policy in op_policies(lists).items():
        covering = COVERED_BY.get(op)
        if covering is not None and has_kernel(f"aten::{covering}", dispatch_key):
            continue
        packet = getattr(torch.ops.aten, op)
        for overload in _overload_names(op):
            qualified = f"aten::{op}" if overload == "default" else f"aten::{op}.{overload}"
            if policy != "banned" and has_kernel(qualified, dispatch_key):
                continue
            kernels[getattr(packet, overload)] = policy
    return kernels


def unchanged(device_type: str, dtype: torch.dtype, lists: ApexLists | None = None) -> frozenset[str]:
    """The overloads (as ``str(op)``: ``"aten.gelu.default"``) that ``"auto"`` does not register on ``device_type``.

    Empty where nothing was measured (the CPU, whose native lists lack softmax, layer_norm, ...: every Apex entry
    changes or may change results there), so ``"auto"`` registers what ``"apex"`` does. The measurement is of
    Apex's own entries: an op whose policy edited ``lists`` changed (``gelu`` moved to ``FP16_FUNCS``) keeps its
    kernel, so the edit applies.
    """
    measured = UNCHANGED.get((device_type, dtype), frozenset())
    if lists is None or lists == DEFAULT_LISTS or not measured:
        return measured
    edited, default = op_policies(lists), op_policies(DEFAULT_LISTS)
    return frozenset(name for name in measured if edited.get(_packet(name)) == default.get(_packet(name)))


def _packet(overload: str) -> str:
    return overload.split(".")[1]  # "aten.gelu.default" -> "gelu"
