"""The kernel boundary: grouping tensors for multi-tensor kernels, and every private torch kernel ampinit calls.

Engine layer. Everything that runs on lists of tensors goes through here: the engine (unscale and check,
master copies, the scale update), the fused optimizers and Apex's ``amp_C`` ops. Each function issues one
PyTorch multi-tensor kernel per group of tensors that share a device and, position by position, dtypes
(:func:`group_indices`, the one grouping rule), never a Python loop over tensors.

The kernels are PyTorch's own and private: ``torch._foreach_*``, ``torch._fused_adam_``/``_fused_adamw_``/
``_fused_sgd_``/``_fused_adagrad_``, ``torch._amp_foreach_non_finite_check_and_unscale_`` and
``torch._amp_update_scale_`` (on CUDA these are the MultiTensorApply kernels PyTorch inherited from Apex; on
CPU they are vectorised loops), and the flatten helpers of ``torch._utils`` that Apex's ``apex_C`` bound.
No other module names them, so a torch release that moves one breaks here, loudly, and nowhere else. The
foreach and fused kernels are bound once, under public names and with torch's own signatures; the ones that a
device or a torch build may lack have a plain-torch fallback (the unscale and scale-update kernels,
``_foreach_copy_``, ``_fused_adagrad_`` off CPU before torch 2.9). Nothing here reads a tensor value on the host.
One measured exception to "one kernel per group": :func:`check_finite_` sums large bf16 CPU tensors one by one.

torch's kernels do not take the same dtypes on every device: :data:`KERNEL_DTYPES` says, from ATen's dispatch
macros, which kernel takes which dtype on which device type; the unscale path routes by it (:func:`takes`), and
``tests/test_kernel_dtypes.py`` records every private kernel call of a CPU run and fails on one that CUDA would
refuse.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampinit._distributed import local_views

GroupKey = tuple[torch.device, tuple[torch.dtype, ...]]

_HAS_UNSCALE_KERNEL = hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")
_HAS_UPDATE_SCALE_KERNEL = hasattr(torch, "_amp_update_scale_")

# -- torch's foreach and fused kernels, under public names ---------------------------------------------------
# Present in every torch ampinit supports (>= 2.11); bound here so that the rest of the package never spells a
# private torch name.
foreach_add = torch._foreach_add
foreach_add_ = torch._foreach_add_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_div = torch._foreach_div
foreach_div_ = torch._foreach_div_
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_sqrt = torch._foreach_sqrt
foreach_sqrt_ = torch._foreach_sqrt_
foreach_sub_ = torch._foreach_sub_
foreach_zero_ = torch._foreach_zero_
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_
fused_sgd_ = torch._fused_sgd_
fused_adagrad_ = torch._fused_adagrad_

# torch._fused_adagrad_ has had a CPU kernel since it appeared (torch 2.4) and a CUDA kernel only since 2.9; on
# other devices it has none, and the caller runs the same update on foreach ops.
FUSED_ADAGRAD_CUDA_SINCE = (2, 9)

# -- which kernel takes which dtype on which device ----------------------------------------------------------
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FLOATS_AND_HALF = frozenset({torch.float16, torch.float32, torch.float64})  # AT_DISPATCH_FLOATING_TYPES_AND_HALF


@dataclass(frozen=True)
class KernelDtypes:
    """What one private torch kernel accepts on one device type, as ATen's source says (``source``).

    ``lists`` names (as in the op's schema) the tensor-list arguments whose dtype the kernel dispatches on;
    ``dtypes`` is what that dispatch takes (``None``: any dtype, because a dtype the fast kernel lacks falls back
    to per-tensor ops instead of failing). ``one_dtype``: every tensor of those lists must share one dtype, or
    the kernel refuses the call. ``fixed``: arguments (a tensor, or each tensor of a list) read as exactly this
    dtype.
    """

    lists: tuple[str, ...]
    dtypes: frozenset[torch.dtype] | None
    one_dtype: bool
    fixed: Mapping[str, torch.dtype] = field(default_factory=dict)
    source: str = ""


UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"
UPDATE_SCALE = "_amp_update_scale_"

# Read from ATen (aten/src/ATen/native/...) for torch 2.11 to 2.14. The release tags themselves could not be
# fetched here (pytorch/pytorch's snapshot is over the size limit), so each row was read at the commits the source
# index holds, named in the row: cyyever/pytorch is a fork of pytorch main at 2.15.0a0; ROCm/pytorch ee04104 is
# torch 2.9 (ROCm builds hipify the same .cu files); pytorch/pytorch commits are older mains whose macro each
# newer read repeats. The 2.11 wheel's own headers (ATen/native/ForeachUtils.h: check_fast_path_restrictions)
# agree, and torch 2.11 on an H100 refused bf16 in the unscale kernel exactly as its row says (issue 21).
_STEP_FLAGS = {"grad_scale": torch.float32, "found_inf": torch.float32, "lr": torch.float32}
_FOREACH = (
    "the fast multi-tensor path dispatches every float type, Half and BFloat16 included (add/sub/mul/div/zero_: "
    "AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(Bool, Half, BFloat16); addcmul_: ..._AND2(Half, BFloat16); sqrt: "
    "AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(Half, BFloat16); norm: AT_DISPATCH_FLOATING_TYPES_AND2(Half, "
    "BFloat16)), and a dtype, mix of dtypes or layout it lacks takes the per-tensor slow path (!can_use_fast_route "
    "-> foreach_tensor_*_slow), so no dtype is refused"
)
KERNEL_DTYPES: dict[tuple[str, str], KernelDtypes] = {
    (UNSCALE, "cuda"): KernelDtypes(
        ("self",),
        _FLOATS_AND_HALF,
        one_dtype=False,
        fixed={"found_inf": torch.float32, "inv_scale": torch.float32},
        source="cuda/AmpKernels.cu, _amp_foreach_non_finite_check_and_unscale_cuda_: "
        "AT_DISPATCH_FLOATING_TYPES_AND_HALF on the multi-tensor list and on its single-tensor fallback for "
        "mixed dtypes; TORCH_CHECK found_inf and "
        "inv_scale scalar_type() == Float (ROCm/pytorch ee04104; the same macro at pytorch/pytorch 0050de5, torch 1.x)",
    ),
    (UNSCALE, "cpu"): KernelDtypes(
        ("self",),
        _FLOATS,
        one_dtype=False,
        fixed={"found_inf": torch.float32, "inv_scale": torch.float32},
        source="cpu/AmpGradScalerKernels.cpp, _amp_foreach_non_finite_check_and_unscale_cpu_kernel: "
        "AT_DISPATCH_REDUCED_FLOATING_TYPES (Half, BFloat16) and AT_DISPATCH_FLOATING_TYPES, per tensor "
        "(cyyever/pytorch ff536a3)",
    ),
    (UPDATE_SCALE, "cuda"): KernelDtypes(
        (),
        None,
        one_dtype=False,
        fixed={"self": torch.float32, "growth_tracker": torch.int32, "found_inf": torch.float32},
        source="cuda/AmpKernels.cu, _amp_update_scale_cuda_: TORCH_CHECK current_scale and found_inf Float, "
        "growth_tracker Int (ROCm/pytorch ee04104)",
    ),
    (UPDATE_SCALE, "cpu"): KernelDtypes(
        (),
        None,
        one_dtype=False,
        fixed={"self": torch.float32, "growth_tracker": torch.int32, "found_inf": torch.float32},
        source="cpu/AmpGradScalerKernels.cpp, _amp_update_scale_cpu_kernel: the same three TORCH_CHECKs "
        "(cyyever/pytorch ff536a3)",
    ),
    **{
        (adam, "cuda"): KernelDtypes(
            ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
            _FLOATS,
            one_dtype=True,
            fixed={**_STEP_FLAGS, "state_steps": torch.float32},
            source="cuda/FusedAdamKernel.cu, _fused_adam_kernel_cuda_: TORCH_CHECK(check_fast_path_restrictions("
            "{params, grads, exp_avgs, exp_avg_sqs[, max_exp_avg_sqs]}), 'must have same dtype, device, and layout') "
            "(pytorch/pytorch 08f7dfb); cuda/fused_adam_impl.cu (and fused_adamw_impl.cu), _fused_adam_cuda_impl_: "
            "AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, params[0].scalar_type()), grad_scale/found_inf/lr "
            "read as float (pytorch/pytorch 11f118d); state_steps are read through a float* with no check "
            "(MultiTensorApply.cuh, multi_tensor_apply_for_fused_optimizer, in the 2.11 wheel)",
        )
        for adam in ("_fused_adam_", "_fused_adamw_")
    },
    ("_fused_sgd_", "cuda"): KernelDtypes(
        ("self", "grads", "momentum_buffer_list"),
        _FLOATS,
        one_dtype=True,
        fixed=_STEP_FLAGS,
        source="cuda/FusedSgdKernel.cu, _fused_sgd_kernel_cuda_ / _fused_sgd_with_momentum_kernel_cuda_: "
        "TORCH_CHECK(check_fast_path_restrictions({params, grads[, momentum_buffer_list]})), "
        "AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, params[0].scalar_type()) (cyyever/pytorch ff536a3)",
    ),
    ("_fused_adagrad_", "cuda"): KernelDtypes(
        ("self", "grads", "state_sums"),
        _FLOATS,
        one_dtype=True,
        fixed={**_STEP_FLAGS, "state_steps": torch.float32},
        source="cuda/FusedAdagradKernel.cu, _fused_adagrad_kernel_cuda_: TORCH_CHECK(check_fast_path_restrictions("
        "{params, grads, state_sums})) (pytorch/pytorch ddde5f9); cuda/fused_adagrad_impl.cu: "
        "AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, params[0].scalar_type()) (pytorch/pytorch 7095778)",
    ),
    **{
        (op, "cuda"): KernelDtypes(
            ("self",),
            None,
            one_dtype=False,
            source=f"cuda/{where}: {_FOREACH} (cyyever/pytorch {commit})",
        )
        for op, where, commit in (
            ("_foreach_add", "ForeachBinaryOpList.cu, ForeachBinaryOpScalar.cu", "0d18888, 4b33b20"),
            ("_foreach_add_", "ForeachBinaryOpList.cu, ForeachBinaryOpScalar.cu", "0d18888, 4b33b20"),
            ("_foreach_sub_", "ForeachBinaryOpList.cu, ForeachBinaryOpScalar.cu", "0d18888, 4b33b20"),
            ("_foreach_mul", "ForeachBinaryOpList.cu, ForeachBinaryOpScalarTensor.cu", "0d18888"),
            ("_foreach_mul_", "ForeachBinaryOpList.cu, ForeachBinaryOpScalarTensor.cu", "0d18888"),
            ("_foreach_div", "ForeachBinaryOpList.cu, ForeachBinaryOpScalarTensor.cu", "0d18888"),
            ("_foreach_div_", "ForeachBinaryOpList.cu, ForeachBinaryOpScalarTensor.cu", "0d18888"),
            ("_foreach_addcmul_", "ForeachPointwiseOp.cu", "4b33b20"),
            ("_foreach_sqrt", "ForeachUnaryOp.cu", "06f3639"),
            ("_foreach_sqrt_", "ForeachUnaryOp.cu", "06f3639"),
            ("_foreach_zero_", "ForeachUnaryOp.cu", "06f3639"),
            ("_foreach_norm", "ForeachReduceOp.cu", "0cecc5c"),
            (
                "_foreach_copy_",
                "ForeachBinaryOpList.cu, foreach_tensor_copy_list_kernel_cuda_ (AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND7 "
                "x AT_DISPATCH_SOURCE_TYPES, every float type both sides)",
                "0d18888",
            ),
        )
    },
}


def takes(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's ``kernel`` (ATen's name) runs a ``dtype`` tensor list on ``device`` (:data:`KERNEL_DTYPES`).

    A device type with no row is not known to have the kernel for that dtype, so the answer is no and the caller
    takes its plain-torch route.
    """
    if kernel == UNSCALE and not _HAS_UNSCALE_KERNEL:
        return False  # pragma: no cover - only on a torch without the private kernel
    rule = KERNEL_DTYPES.get((kernel, device.type))
    return rule is not None and (rule.dtypes is None or dtype in rule.dtypes)


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"Unrecognised torch version {version!r}: expected 'major.minor[...]'")
    return int(found.group(1)), int(found.group(2))


def has_fused_adagrad(device: torch.device, torch_version: str | None = None) -> bool:
    """Whether ``torch._fused_adagrad_`` has a kernel for ``device`` in this torch (or ``torch_version``)."""
    if device.type == "cpu":
        return True
    version = torch.__version__ if torch_version is None else torch_version
    return device.type == "cuda" and _major_minor(version) >= FUSED_ADAGRAD_CUDA_SINCE


def flatten_dense_tensors(tensors: Sequence[Tensor]) -> Tensor:
    """One contiguous 1-d tensor holding ``tensors`` one after the other (torch's helper, Apex's ``apex_C``)."""
    flat: Tensor = _flatten_dense_tensors(list(tensors))  # type: ignore[no-untyped-call]
    return flat


def unflatten_dense_tensors(flat: Tensor, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten_dense_tensors`)."""
    return tuple(_unflatten_dense_tensors(flat, list(tensors)))  # type: ignore[no-untyped-call]


# -- grouping ----------------------------------------------------------------------------------------------
def group_indices(tensor_lists: Sequence[Sequence[Tensor]]) -> dict[GroupKey, list[int]]:
    """Positions grouped by the device of the first list and the dtypes found at that position in every list.

    torch's foreach and fused kernels want one device and one dtype per list, so every multi-tensor op runs
    once per group. The keys are read with ``map`` (a loop in C, no Python call per tensor): a master step
    groups every grad of the model, every step, and nearly always finds one group.
    """
    devices = list(map(_DEVICE, tensor_lists[0]))
    if not devices:
        return {}
    dtypes = list(zip(*(map(_DTYPE, tensors) for tensors in tensor_lists)))
    if devices.count(devices[0]) == len(devices) and dtypes.count(dtypes[0]) == len(dtypes):
        return {(devices[0], dtypes[0]): list(range(len(devices)))}
    groups: dict[GroupKey, list[int]] = {}
    for i, key in enumerate(zip(devices, dtypes)):
        groups.setdefault(key, []).append(i)
    return groups


_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")


def pick(tensors: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
    return [tensors[i] for i in indices]


def grouped(*lists: Sequence[Tensor]) -> list[tuple[GroupKey, list[list[Tensor]]]]:
    """The parallel ``lists`` split by :func:`group_indices`: one ``(key, [sublist per list])`` per group.

    Sharded tensors (FSDP2's DTensors) are taken as their local shards: the engine's ops are elementwise, and
    the one cross-rank fact, the overflow flag, is reduced by the caller.
    """
    shards = [local_views(tensors) for tensors in lists]
    if not shards[0]:
        return []
    groups = group_indices(shards)
    if len(groups) == 1:
        return [(key, [list(s) for s in shards]) for key in groups]
    return [(key, [pick(s, indices) for s in shards]) for key, indices in groups.items()]


# -- the engine's multi-tensor ops ----------------------------------------------------------------------------
def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``, asynchronously where that is safe.

    A copy *to* an accelerator is stream-ordered: the kernels that read it run after it. A copy to the CPU is
    not: with ``non_blocking=True`` the host could read the buffer before the copy lands, so it blocks.
    """
    return tensor.to(device, non_blocking=device.type != "cpu")


_IS_SPARSE = operator.attrgetter("is_sparse")


def _values_of_sparse(tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """``tensors``, each sparse COO one (``nn.Embedding(sparse=True)``'s grad) as its values: what the elementwise
    checks and multiplies below read and write (``_values()``, coalesced or not, shares the tensor's memory).
    ``tensors`` itself where none is sparse, with no Python call per tensor."""
    if not any(map(_IS_SPARSE, tensors)):
        return tensors
    return [tensor._values() if tensor.is_sparse else tensor for tensor in tensors]


def unscale_and_check_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad, in place, and set ``found_inf`` to 1.0 if any grad is inf or NaN.

    The inf/NaN check looks at the values *before* the multiply. ``found_inf`` is a one-element float32
    tensor; it is only ever raised, never cleared, so several calls accumulate into one flag. This is the one
    unscale-and-check path of the package: the loss scalers, Apex's ``amp_C`` ops and the master step all
    come here (and :func:`check_finite_` when there is nothing to multiply).
    """
    for (device, (dtype,)), (group,) in grouped(_values_of_sparse(grads)):
        flag = _flag_on(found_inf, device)
        scale = to_device(inv_scale, device).reshape(1)
        if takes(UNSCALE, device, dtype):
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, scale)
        else:
            _check_by_norms(group, flag)
            _mul_in_fp32_(group, scale.reshape(()))
        _fold_flag(found_inf, flag)


# bf16 CPU tensors at least this large are checked by a sum (see check_finite_); smaller ones by the kernel.
_SUM_CHECK_MIN_NUMEL = 1 << 15


#: A check of a list of tensors of one dtype on one device: ``fused(grads, flag, checked)`` raises ``flag`` (a
#: one-element fp32 tensor on their device) if any holds an inf or NaN, never clears it, and returns True; or returns
#: False, having done nothing, where it does not run (then the caller checks another way). ``checked``: the caller
#: knows every grad to be a contiguous plain tensor (what a kernel taking raw pointers reads); otherwise the check
#: finds out itself (:func:`contiguous_plain`), once it knows it runs at all, so that where it does not (the CPU)
#: nothing reads the grads for it.
FusedCheck = Callable[[list[Tensor], Tensor, bool], bool]

_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter))


def check_finite_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    one: Tensor,
    key: GroupKey | None = None,
    fused: FusedCheck | None = None,
) -> None:
    """Set ``found_inf`` to 1.0 if any grad is inf or NaN, leaving every grad's value as it is (no scale).

    ``key``: the ``(device, (dtype,))`` that every one of ``grads`` (plain tensors) is known to have, so that they
    are not grouped again (the kernel step's plan has just checked each of them: reading a device per tensor is
    most of this function's host time).

    ``fused``: a one-launch check (the master step's Triton kernel, ``ampinit._masters``, which runs where the
    kernels do: CUDA) offered every group of contiguous plain tensors on ``found_inf``'s device first. It reads
    each grad once and writes nothing. What it replaces: for bf16 on CUDA, which torch's unscale kernel refuses,
    the inf-norms below (a reduction with one output tensor per grad, a ``stack`` of them and five small ops, on a
    GPU host work that grows with the number of tensors); for fp16, torch's unscale kernel by 1, which writes every
    grad back as it reads it (2 B per element more) in a launch per chunk of tensors. Measured on an H200
    (2026-11-27, 124M parameters): O2's master step spent 332 us in that kernel (7 launches); with this check, 107
    us in one, its device time 1.42 -> 1.18 ms.

    Mostly the unscale kernel with ``one`` (a persistent one-element 1.0, so the step allocates nothing) as its
    multiplier. Where that kernel refuses the dtype (bf16 on CUDA: :data:`KERNEL_DTYPES`), one inf-norm
    reduction per group reads the grads once instead. The other exception is bf16 on CPU: torch's CPU unscale kernel
    converts bf16 element by element, and on the Intel Xeon with AMX-BF16 it costs 1.07x an fp32 fused AdamW
    step over as many elements (fp16: 0.37x, fp32: 0.36x; ``benchmarks/README.md``). A plain ``sum()`` reads
    the same bf16 grads once, vectorised, in 0.22x, and is non-finite exactly when a term is: an inf or NaN term
    makes the float accumulator inf or NaN (``+inf`` and ``-inf`` together make NaN). The one false alarm is a
    sum of finite terms beyond bf16's (= fp32's) largest value, 3.4e38, i.e. grads averaging 1e31 or more: a
    step that no optimizer would survive, skipped instead. So large bf16 CPU grads are summed, one reduction
    per tensor: from 32768 elements on, the Python call costs under a tenth of what the sum saves.
    """
    groups = grouped(_values_of_sparse(grads)) if key is None else [(key, [list(grads)])]
    for (device, (dtype,)), (group,) in groups:
        flag = _flag_on(found_inf, device)
        # A key says the caller has checked each grad (plain, contiguous, on the device): not read again.
        if fused is not None and flag is found_inf and fused(group, flag, key is not None):
            continue
        if not takes(UNSCALE, device, dtype):
            _check_by_norms(group, flag)
            group = []
        elif device.type == "cpu" and dtype == torch.bfloat16:
            small = [n < _SUM_CHECK_MIN_NUMEL for n in map(Tensor.numel, group)]
            large = [g for g, is_small in zip(group, small) if not is_small]
            group = [g for g, is_small in zip(group, small) if is_small]
            if large:
                sums = torch.stack([g.sum() for g in large])
                flag.add_(sums.isfinite().logical_not().any()).clamp_(max=1.0)
        if group:
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, to_device(one, device).reshape(1))
        _fold_flag(found_inf, flag)


def contiguous_plain(group: list[Tensor]) -> bool:
    """Whether every tensor of ``group`` is a contiguous plain tensor (what a kernel taking raw pointers reads)."""
    return _PLAIN_TYPES.issuperset(map(type, group)) and all(map(Tensor.is_contiguous, group))


def _check_by_norms(group: list[Tensor], flag: Tensor) -> None:
    """Raise ``flag`` if a tensor of ``group`` holds an inf or NaN, for dtypes the unscale kernel refuses.

    The inf-norm is the largest magnitude, NaN propagating (``max_propagate_nan`` in ATen's kernel), so it is
    finite exactly when every element is. ATen refuses the inf-norm of an empty tensor, which has nothing to check.
    """
    nonempty = [g for g in group if g.numel()]
    if nonempty:
        norms = torch.stack(list(foreach_norm(nonempty, ord=float("inf"))))
        flag.add_(norms.isfinite().logical_not().any()).clamp_(max=1.0)


def _flag_on(found_inf: Tensor, device: torch.device) -> Tensor:
    return found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)


def _fold_flag(found_inf: Tensor, flag: Tensor) -> None:
    if flag is not found_inf:
        found_inf.add_(to_device(flag, found_inf.device)).clamp_(max=1.0)


def copy_(destinations: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (casting between dtypes), one kernel per group."""
    with torch.no_grad():
        for _, (dst, src) in grouped(destinations, sources):
            if _HAS_FOREACH_COPY:
                torch._foreach_copy_(dst, src)
            else:  # pragma: no cover - only on a torch without _foreach_copy_
                for d, s in zip(dst, src):
                    d.copy_(s)


def mul_(tensors: Sequence[Tensor], factor: Tensor) -> None:
    """``t *= factor`` for each tensor, ``factor`` being a 0-d tensor (kept on device: no host sync).

    Runs on the unscale kernel with ``factor`` as its multiplier and a scratch flag where the kernel takes the
    dtype: on CPU, ``torch._foreach_mul_`` by a tensor takes a slow per-tensor path (about 10x the time of this
    kernel). Elsewhere (bf16 on CUDA) the product is taken in float32 (:func:`_mul_in_fp32_`), with no check to
    pay for.
    """
    for (device, (dtype,)), (group,) in grouped(_values_of_sparse(tensors)):
        scale = to_device(factor, device).reshape(1)
        if takes(UNSCALE, device, dtype):
            scratch = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, scratch, scale)
        else:
            _mul_in_fp32_(group, scale.reshape(()))


def _mul_in_fp32_(group: list[Tensor], factor: Tensor) -> None:
    """``t *= factor`` for tensors of one dtype, with the float32 ``factor`` (0-d, on their device) unrounded.

    ``torch._foreach_mul_`` (and ``mul_``) by a 0-d tensor of another dtype first casts it to the tensors' dtype:
    on CUDA a bf16 grad times 1/3 became a product with 0.333984 (the H100 check: 1.5391 * 1/3 gave 0.5156, not
    the float32 product's rounding, 0.5117). A power of two survives that cast exactly, but the factor lives on
    the device and cannot be looked at, so narrower tensors are multiplied through a float32 copy, one tensor at
    a time (this path is taken only where the unscale kernel refuses the dtype: bf16 on CUDA).
    """
    if group[0].dtype in (torch.float32, torch.float64):
        foreach_mul_(group, factor)
        return
    for tensor in group:
        tensor.copy_(tensor.float().mul_(factor))


def add_(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> None:
    """``t += other`` for each pair."""
    for _, (group, other) in grouped(tensors, others):
        foreach_add_(group, other)


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """GradScaler's update rule in one kernel, in place and on device.

    An overflow multiplies ``scale`` by ``backoff_factor`` and resets ``growth_tracker``; a clean step counts
    it up, and reaching ``growth_interval`` multiplies ``scale`` by ``growth_factor`` (unless that would make
    it non-finite) and resets the tracker.
    """
    if _HAS_UPDATE_SCALE_KERNEL:
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return
    found = found_inf.reshape(()) > 0  # pragma: no cover - only on a torch without the private kernel
    tracker = torch.where(found, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = tracker == growth_interval
    grown = scale * growth_factor
    scale.copy_(torch.where(found, scale * backoff_factor, torch.where(grow & grown.isfinite(), grown, scale)))
    growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))


# -- float32 work lists of the optimizers ---------------------------------------------------------------------
def fp32_copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Fresh float32 copies (same shapes and strides) of ``tensors``."""
    copies = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    if copies:
        copy_(copies, tensors)
    return copies


def fp32_work(tensors: Sequence[Tensor], *, private: bool = False) -> list[Tensor]:
    """Tensors to do float32 math on.

    Float32 tensors are used in place unless ``private`` asks for copies (needed when a skipped step must
    leave the originals untouched). Other dtypes always get float32 copies, written back later with
    :func:`write_back`; this keeps half-precision parameters on Apex's numerics (fp32 math, one rounding).
    """
    if not private and all(t.dtype == torch.float32 for t in tensors):
        return list(tensors)
    return fp32_copies(tensors)


def write_back(targets: Sequence[Tensor], work: Sequence[Tensor], skip: Tensor | None = None) -> None:
    """Store ``work`` into ``targets`` (rounded to their dtype), except where the 0-d bool ``skip`` is true.

    Pairs whose work tensor *is* the target were updated in place already and are left alone.
    """
    pairs = [(t, w) for t, w in zip(targets, work) if t is not w]
    if not pairs:
        return
    if skip is None:
        copy_([t for t, _ in pairs], [w for _, w in pairs])
        return
    for target, value in pairs:
        # torch has no foreach `where`; one select per tensor keeps the skip decision on the device.
        torch.where(skip, target, value.to(target.dtype), out=target)


def device_scalar(value: float, device: torch.device) -> Tensor:
    """A 0-d float32 tensor holding ``value`` on ``device``.

    Made by a fill kernel that takes ``value`` as a kernel argument, never by ``torch.tensor(value,
    device=...)``, which stages the number in host memory and copies it (a blocking host-to-device copy on
    CUDA, and a copy of a host buffer that a CUDA graph would replay stale).
    """
    return torch.full((), value, dtype=torch.float32, device=device)


# -- norms ---------------------------------------------------------------------------------------------------
# torch's CPU norm kernels accumulate long vectors with too few partial sums: about 1e-3 relative error on
# fp32 tensors of tens of millions of elements (1e-5 at 1M, 1e-7 at 4k). Tensors above NORM_CHUNK * 4
# elements are therefore reduced the way Apex's kernel does it: fp32 sums of squares per chunk, then a
# (pairwise) sum of the chunk results. That costs one small temporary per tensor (numel / NORM_CHUNK floats).
NORM_CHUNK = 2048


def _chunked_norm(tensor: Tensor) -> Tensor:
    flat = tensor.reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    rows = flat[:whole].view(-1, NORM_CHUNK)
    squares = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square().sum()
    tail = flat[whole:]
    if tail.numel():
        squares = squares + torch.linalg.vector_norm(tail, dtype=torch.float32).square()
    root: Tensor = squares.sqrt()
    return root


def l2_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Float32 L2 norm (0-d) of each tensor, in input order, accurate to ~1e-7 relative at any size.

    Small tensors share one ``foreach_norm`` per (device, dtype) group; large ones are reduced by chunks
    (see ``NORM_CHUNK``).
    """
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    if not tensors:
        return norms
    for indices in group_indices([tensors]).values():
        small = [i for i in indices if tensors[i].numel() <= NORM_CHUNK * 4]
        if small:
            for i, norm in zip(small, foreach_norm(pick(tensors, small), 2, dtype=torch.float32)):
                norms[i] = norm
        for i in indices:
            if tensors[i].numel() > NORM_CHUNK * 4:
                norms[i] = _chunked_norm(tensors[i])
    return norms


def total_norm(norms: Sequence[Tensor], device: torch.device) -> Tensor:
    """L2 norm (shape [1], float32, on ``device``) of a list of per-tensor L2 norms."""
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    norm: Tensor = torch.linalg.vector_norm(stacked)
    return norm.reshape(1)


def advance_steps_(steps: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
    """Count one optimizer step in each of ``steps`` (device tensors), or none where ``found_inf`` is set.

    As torch's fused Adam does with its ``found_inf`` argument: the count is raised and lowered again on the
    device, so a skipped step leaves it where it was without a host read.
    """
    torch._foreach_add_(steps, 1.0)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))
