"""Triton kernels for the master-weight step: the fused twins of ``ampinit._masters.reference``'s functions.

Imported only when ``triton`` is importable (``ampinit._masters.kernel_step.kernels_for``). Each public function
takes exactly the arguments of the reference function of the same name and gives the same bits:

- one launch per list (per dtype combination), one program per block of each tensor: every tensor's data pointer
  goes into a small int64 table, and each program finds its tensor by a binary search of the tensors' first
  programs (a table of one entry per tensor, where Apex's multi-tensor apply lists every chunk); the grads'
  pointers have a table of their own, as they are the tensors that move from step to step (fresh grads);
- fp32 math in the reference's order, each operation rounded (``enable_fp_fusion=False``: no fused
  multiply-add), division and square root correctly rounded (``div_rn``, ``sqrt_rn``);
- fp32 -> bf16 rounds to nearest-even with integer ops of our own: Triton's interpreter truncates that cast,
  and writing it out keeps one code path for the GPU and for the interpreter that tests it on CPU;
- the overflow flag masks every load and store, so a flagged step reads and writes nothing, without a host sync;
- launched through ``ampinit._masters.triton_launch``, which calls the compiled kernel Triton made for the same
  specialisation instead of binding every argument again (about half a launch's host time);
- a whole block (every block but a tensor's last) loads and stores without a mask, and where every tensor of the
  launch starts on a 16-byte boundary (``ALIGNED``, checked on the host when the tables are built: a view into a
  flat buffer may not) the pointers say so: the compiler then moves 16 bytes per thread and instruction, as torch's
  fused optimizers do, instead of one element (the PTX is checked in tests/test_triton_compile.py).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ampinit._masters import triton_launch
from ampinit._masters.reference import AdamSettings, Masters, SgdSettings
from ampinit._types import TensorList

try:
    from triton.language.extra import libdevice
except ImportError:  # Triton before 3.0 kept the CUDA functions here only
    from triton.language.extra.cuda import libdevice

_BLOCK = 1024

#: Every launch's options: no fused multiply-add (the reference rounds each product). Said even where a kernel has
#: no arithmetic to fuse, so that Triton 3.9 (whose default is changing) does not warn that it was left unset.
_OPTIONS = {"enable_fp_fusion": False}
#: The step scalars' powers are libdevice's float64 ``pow``; its float64 code has no flushing branch, and
#: ``enable_reflect_ftz=False`` says so for any float32 code libdevice might bring (as the fused gelu's launches do).
_POW_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

_TL_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


@triton.jit
def _round_to_bf16(x):
    # Round-to-nearest-even on the bit pattern: add 0x7FFF plus the lowest kept bit, keep the upper half.
    # Overflow carries into the exponent and gives inf, as it should; NaN becomes torch's quiet NaN 0x7FC0.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_weight(x, WEIGHT_IS_BF16: tl.constexpr, WEIGHT_T: tl.constexpr):
    if WEIGHT_IS_BF16:
        return _round_to_bf16(x)
    else:
        return x.to(WEIGHT_T)


@triton.jit
def _span(numels, first_blocks, flag_ptr, HAS_FLAG: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tensor ``t``, the start of its block (a multiple of ``BLOCK``) and the tensor's length (0
    where a raised overflow flag masks everything out).

    ``first_blocks`` holds each tensor's first program, in order, then ``INT32_MAX`` up to ``2**SEARCH`` entries:
    ``t`` is the last tensor whose first program is at most this one (an empty tensor's first program is its
    successor's, so it is never chosen), found in ``SEARCH`` halvings of a table of 4 bytes per tensor, which stays
    in the L1 cache, where a table entry per block took 12 B per 1024 parameters on the device and a Python loop
    over every block to build."""
    pid = tl.program_id(0)
    t = pid * 0  # int32 zero: tensor 0's first program is 0, at most any program's
    for level in tl.static_range(SEARCH):
        probe = t + (1 << (SEARCH - 1 - level))
        t = tl.where(tl.load(first_blocks + probe) <= pid, probe, t)
    start = tl.multiple_of((pid - tl.load(first_blocks + t)).to(tl.int64) * BLOCK, BLOCK)
    limit = tl.load(numels + t)
    if HAS_FLAG:
        limit = tl.where(tl.load(flag_ptr) == 0, limit, 0)
    return t, start, limit


@triton.jit
def _ld(ptr, mask, MASKED: tl.constexpr):
    """A load of a tensor's last, partial block (``MASKED``), or of a whole one, without a mask to vectorise."""
    if MASKED:
        return tl.load(ptr, mask=mask, other=0)
    else:
        return tl.load(ptr)


@triton.jit
def _st(ptr, value, mask, MASKED: tl.constexpr):
    """The store of :func:`_ld`'s block."""
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)


@triton.jit
def _tensor_ptr(table, index, T: tl.constexpr, ALIGNED: tl.constexpr):
    """Entry ``index`` of a pointer ``table``, as a pointer to ``T``; ``ALIGNED``: known to start on 16 bytes."""
    ptr = tl.load(table + index).to(tl.pointer_type(T))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _step_scalars_kernel(
    powers, steps, flag_ptr, scalars, n, lr: tl.float64,
    HAS_FLAG: tl.constexpr, POW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Adam's step scalars from ``powers`` (``[beta1**step; beta2**step]``, float64, 2 x n) and, with a flag, the
    counts' advance taken back where it is raised: ``kernel_step.step_scalars``' last four ops and the counts'
    ``sub_``, in float64 and each rounded once to fp32, as those ops do (division and square root correctly
    rounded in float64: PTX's ``div.rn.f64``/``sqrt.rn.f64``, NumPy's in the interpreter).

    ``POW`` (CUDA only: the interpreter has no libdevice): ``powers`` is ``[beta1, beta2]``, the counts are advanced
    by one here in their dtype (torch's ``add_(1.0)``) and the powers are libdevice's float64 ``pow`` (``__nv_pow``,
    what torch's CUDA ``pow`` of two float64 tensors calls) of each beta and advanced count; the advanced counts are
    written back, less the flag where it is raised."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if POW:
        counts = tl.load(steps + offs, mask=mask, other=0.0) + 1.0
        exponent = counts.to(tl.float64)
        power1 = libdevice.pow(tl.broadcast_to(tl.load(powers), [BLOCK]), exponent)
        power2 = libdevice.pow(tl.broadcast_to(tl.load(powers + 1), [BLOCK]), exponent)
    else:
        power1 = tl.load(powers + offs, mask=mask, other=0.0)
        power2 = tl.load(powers + n + offs, mask=mask, other=0.0)
    bias_correction1 = 1.0 - power1
    bias_correction2 = 1.0 - power2
    # ``lr / bias_correction1`` as torch runs it for a number over a tensor: the reciprocal, times lr.
    tl.store(scalars + 2 * offs, ((1.0 / bias_correction1) * lr).to(tl.float32), mask=mask)
    tl.store(scalars + 2 * offs + 1, tl.sqrt(bias_correction2).to(tl.float32), mask=mask)
    if POW:
        if HAS_FLAG:
            counts = counts - tl.load(flag_ptr)
        tl.store(steps + offs, counts, mask=mask)
    elif HAS_FLAG:
        tl.store(steps + offs, tl.load(steps + offs, mask=mask) - tl.load(flag_ptr), mask=mask)


@triton.jit
def _scale_update_kernel(
    scale_ptr, tracker_ptr, flag_ptr, inv_ptr,
    growth: tl.float64, backoff: tl.float64, interval, min_scale, max_scale,
    HAS_MIN: tl.constexpr,
):  # fmt: skip
    """A dynamic loss scale's update in one program: torch's ``_amp_update_scale_`` (an overflow multiplies the scale
    by ``backoff`` and resets the tracker; a clean step counts up, and reaching ``interval`` multiplies it by
    ``growth`` unless that is not finite, and resets the tracker; each product in float64 rounded once to fp32, as
    its kernels compute with double factors), then its ``clamp_(min_scale, max_scale)`` (a NaN stays, as torch's
    clamp keeps it) and ``1 / scale`` correctly rounded (``reciprocal``) into ``inv_ptr``."""
    scale = tl.load(scale_ptr)
    tracker = tl.load(tracker_ptr)
    found = tl.load(flag_ptr) != 0.0  # torch's test of the flag: any nonzero value, a NaN too
    backed = (scale.to(tl.float64) * backoff).to(tl.float32)
    successful = tracker + 1
    grows = successful == interval
    grown = (scale.to(tl.float64) * growth).to(tl.float32)
    finite = (grown == grown) & (tl.abs(grown) != float("inf"))
    new_scale = tl.where(found, backed, tl.where(grows & finite, grown, scale))
    new_tracker = tl.where(found | grows, 0, successful)
    if HAS_MIN:
        new_scale = tl.where(new_scale < min_scale, min_scale, new_scale)
    new_scale = tl.where(new_scale > max_scale, max_scale, new_scale)
    tl.store(scale_ptr, new_scale)
    tl.store(tracker_ptr, new_tracker)
    tl.store(inv_ptr, tl.math.div_rn(1.0, new_scale))


@triton.jit
def _check_kernel(
    ptrs, numels, first_blocks, flag_ptr,
    GRAD_T: tl.constexpr, ALIGNED: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, start, limit = _span(numels, first_blocks, flag_ptr, False, SEARCH, BLOCK)
    if start + BLOCK <= limit:
        _check_block(ptrs, t, start, limit, flag_ptr, GRAD_T, False, ALIGNED, BLOCK)
    else:
        _check_block(ptrs, t, start, limit, flag_ptr, GRAD_T, True, ALIGNED, BLOCK)


@triton.jit
def _check_block(
    ptrs, t, start, limit, flag_ptr, GRAD_T: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = start + tl.arange(0, BLOCK)
    mask = offs < limit
    g = _ld(_tensor_ptr(ptrs, t, GRAD_T, ALIGNED) + offs, mask, MASKED).to(tl.float32)  # a masked lane reads 0
    bad = (g != g) | (tl.abs(g) == float("inf"))
    # Every bad lane writes the same 1.0 to the flag: a benign race, and no reduction needed.
    tl.store(flag_ptr + offs * 0, tl.where(bad, 1.0, 0.0), mask=bad)


@triton.jit
def _load_grad(
    grad_ptrs, t, offs, mask, inv_scale_ptr, GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr,
    MASKED: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """The fp32, unscaled (and for ``maximize`` negated) grad of tensor ``t`` (its pointer in ``grad_ptrs``)."""
    g = _ld(_tensor_ptr(grad_ptrs, t, GRAD_T, ALIGNED) + offs, mask, MASKED).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(inv_scale_ptr)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _adam_update(
    g, p, m_ptr, v_ptr, offs, mask, t, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    weight_decay, decay_factor, DECAY: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Adam/AdamW on fp32 master values ``p`` (``ampinit._masters.reference.adam_``): stores m and v, returns p."""
    if DECAY == 1:
        g = g + p * weight_decay
    if DECAY == 2:
        p = p * decay_factor
    m = _ld(m_ptr + offs, mask, MASKED) * beta1 + g * one_minus_beta1
    v = _ld(v_ptr + offs, mask, MASKED) * beta2 + (g * g) * one_minus_beta2
    step_size = tl.load(step_scalars + 2 * t)
    bias_correction2_sqrt = tl.load(step_scalars + 2 * t + 1)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt) + eps
    _st(m_ptr + offs, m, mask, MASKED)
    _st(v_ptr + offs, v, mask, MASKED)
    return p - tl.math.div_rn(step_size * m, denom)


@triton.jit
def _sgd_update(
    g, p, ptrs, buf_list, n_tensors, t, offs, mask, lr, momentum, one_minus_dampening, weight_decay,
    HAS_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
    MASKED: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """SGD on fp32 master values ``p`` (``ampinit._masters.reference.sgd_``); the momentum buffers are list
    ``buf_list`` of ``ptrs``. Stores the buffer, returns p."""
    if HAS_DECAY:
        g = g + p * weight_decay
    if HAS_MOMENTUM:
        b_ptr = _tensor_ptr(ptrs, buf_list * n_tensors + t, tl.float32, ALIGNED)
        if FIRST_STEP:  # noqa: SIM108  (branches on constexprs are compiled away; keep them as statements)
            buf = g
        else:
            buf = _ld(b_ptr + offs, mask, MASKED) * momentum + g * one_minus_dampening
        _st(b_ptr + offs, buf, mask, MASKED)
        if NESTEROV:  # noqa: SIM108
            g = g + buf * momentum
        else:
            g = buf
    # p - g*lr is bitwise p + g*(-lr), torch's form (IEEE defines x - y as x + -y, and negation is exact), and
    # never hands the kernel a -0.0: Triton 3.8's interpreter reads a -0.0 argument as +0.0 (lr=0 warm-up steps).
    return p - g * lr


# -- where the masters live ------------------------------------------------------------------------------------
# Each kernel's pointer table holds its own lists first, then two lists that hold the masters (STORAGE):
_MASTER = 0  # fp32 masters, updated in place; nothing else is written
_MASTER_AND_WEIGHT = 1  # fp32 masters, and the half model weights, written from them
_REMAINDER = 2  # bf16 weights and int16 remainders (ampinit._masters.remainder): joined, updated, split back


@triton.jit
def _join_master(weight_bits, remainder):
    # (weight << 16) + remainder on the int16 bit patterns, read back as fp32: ampinit._masters.remainder.join.
    return (weight_bits.to(tl.int32) * 65536 + remainder.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(p):
    # ampinit._masters.remainder.split_: NaN made canonical, then the upper half rounded half up on the signed bits
    # (ties away from zero on the magnitude) and what is left below it.
    bits = tl.where(p != p, 0x7FC00000, p.to(tl.int32, bitcast=True))
    upper = (bits + 0x8000) >> 16
    return upper.to(tl.int16), (bits - upper * 65536).to(tl.int16)


@triton.jit
def _load_master(
    ptrs, n_tensors, first_list, t, offs, mask, STORAGE: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr
):
    """The fp32 masters of tensor ``t``, from lists ``first_list`` (and the next) of ``ptrs``."""
    if STORAGE == 2:
        w_ptr = _tensor_ptr(ptrs, first_list * n_tensors + t, tl.int16, ALIGNED)
        r_ptr = _tensor_ptr(ptrs, (first_list + 1) * n_tensors + t, tl.int16, ALIGNED)
        p = _join_master(_ld(w_ptr + offs, mask, MASKED), _ld(r_ptr + offs, mask, MASKED))
    else:
        p = _ld(_tensor_ptr(ptrs, first_list * n_tensors + t, tl.float32, ALIGNED) + offs, mask, MASKED)
    return p


@triton.jit
def _store_master(
    p, ptrs, n_tensors, first_list, t, offs, mask, STORAGE: tl.constexpr, WEIGHT_T: tl.constexpr,
    WEIGHT_IS_BF16: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Store the updated masters ``p`` where :func:`_load_master` read them (and the half weights, if written)."""
    if STORAGE == 2:
        w_ptr = _tensor_ptr(ptrs, first_list * n_tensors + t, tl.int16, ALIGNED)
        r_ptr = _tensor_ptr(ptrs, (first_list + 1) * n_tensors + t, tl.int16, ALIGNED)
        weight_bits, remainder = _split_master(p)
        _st(w_ptr + offs, weight_bits, mask, MASKED)
        _st(r_ptr + offs, remainder, mask, MASKED)
    else:
        _st(_tensor_ptr(ptrs, first_list * n_tensors + t, tl.float32, ALIGNED) + offs, p, mask, MASKED)
        if STORAGE == 1:
            w_ptr = _tensor_ptr(ptrs, (first_list + 1) * n_tensors + t, WEIGHT_T, ALIGNED)
            _st(w_ptr + offs, _to_weight(p, WEIGHT_IS_BF16, WEIGHT_T), mask, MASKED)


@triton.jit
def _adam_kernel(
    grad_ptrs, ptrs, numels, first_blocks, n_tensors, inv_scale_ptr, flag_ptr,
    step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FLAG: tl.constexpr, MAXIMIZE: tl.constexpr,
    STORAGE: tl.constexpr, WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr,
    DECAY: tl.constexpr,  # 0: none, 1: L2 (Adam), 2: decoupled (AdamW)
    ALIGNED: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, start, limit = _span(numels, first_blocks, flag_ptr, HAS_FLAG, SEARCH, BLOCK)
    if start + BLOCK <= limit:
        _adam_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, beta1, one_minus_beta1, beta2,
            one_minus_beta2, eps, weight_decay, decay_factor, t, start, limit, GRAD_T, HAS_SCALE, MAXIMIZE, STORAGE,
            WEIGHT_T, WEIGHT_IS_BF16, DECAY, False, ALIGNED, BLOCK,
        )  # fmt: skip
    else:
        _adam_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, beta1, one_minus_beta1, beta2,
            one_minus_beta2, eps, weight_decay, decay_factor, t, start, limit, GRAD_T, HAS_SCALE, MAXIMIZE, STORAGE,
            WEIGHT_T, WEIGHT_IS_BF16, DECAY, True, ALIGNED, BLOCK,
        )  # fmt: skip


@triton.jit
def _adam_block(
    grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    weight_decay, decay_factor, t, start, limit,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, STORAGE: tl.constexpr,
    WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, DECAY: tl.constexpr, MASKED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Lists of ptrs: exp_avgs, exp_avg_sqs, then the masters' two (STORAGE).
    offs = start + tl.arange(0, BLOCK)
    mask = offs < limit
    m_ptr = _tensor_ptr(ptrs, t, tl.float32, ALIGNED)
    v_ptr = _tensor_ptr(ptrs, n_tensors + t, tl.float32, ALIGNED)
    g = _load_grad(grad_ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE, MASKED, ALIGNED)
    p = _load_master(ptrs, n_tensors, 2, t, offs, mask, STORAGE, MASKED, ALIGNED)
    p = _adam_update(
        g, p, m_ptr, v_ptr, offs, mask, t, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
        weight_decay, decay_factor, DECAY, MASKED,
    )  # fmt: skip
    _store_master(p, ptrs, n_tensors, 2, t, offs, mask, STORAGE, WEIGHT_T, WEIGHT_IS_BF16, MASKED, ALIGNED)


@triton.jit
def _sgd_kernel(
    grad_ptrs, ptrs, numels, first_blocks, n_tensors, inv_scale_ptr, flag_ptr,
    lr, momentum, one_minus_dampening, weight_decay,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FLAG: tl.constexpr, MAXIMIZE: tl.constexpr,
    STORAGE: tl.constexpr, WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
    ALIGNED: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, start, limit = _span(numels, first_blocks, flag_ptr, HAS_FLAG, SEARCH, BLOCK)
    if start + BLOCK <= limit:
        _sgd_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, lr, momentum, one_minus_dampening, weight_decay, t, start,
            limit, GRAD_T, HAS_SCALE, MAXIMIZE, STORAGE, WEIGHT_T, WEIGHT_IS_BF16, HAS_DECAY, HAS_MOMENTUM,
            FIRST_STEP, NESTEROV, False, ALIGNED, BLOCK,
        )  # fmt: skip
    else:
        _sgd_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, lr, momentum, one_minus_dampening, weight_decay, t, start,
            limit, GRAD_T, HAS_SCALE, MAXIMIZE, STORAGE, WEIGHT_T, WEIGHT_IS_BF16, HAS_DECAY, HAS_MOMENTUM,
            FIRST_STEP, NESTEROV, True, ALIGNED, BLOCK,
        )  # fmt: skip


@triton.jit
def _sgd_block(
    grad_ptrs, ptrs, n_tensors, inv_scale_ptr, lr, momentum, one_minus_dampening, weight_decay, t, start, limit,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, STORAGE: tl.constexpr,
    WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Lists of ptrs: momentum buffers, then the masters' two (STORAGE).
    offs = start + tl.arange(0, BLOCK)
    mask = offs < limit
    g = _load_grad(grad_ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE, MASKED, ALIGNED)
    p = _load_master(ptrs, n_tensors, 1, t, offs, mask, STORAGE, MASKED, ALIGNED)
    p = _sgd_update(
        g, p, ptrs, 0, n_tensors, t, offs, mask, lr, momentum, one_minus_dampening, weight_decay,
        HAS_DECAY, HAS_MOMENTUM, FIRST_STEP, NESTEROV, MASKED, ALIGNED,
    )  # fmt: skip
    _store_master(p, ptrs, n_tensors, 1, t, offs, mask, STORAGE, WEIGHT_T, WEIGHT_IS_BF16, MASKED, ALIGNED)


# -- launching ------------------------------------------------------------------------------------------------
class _Tables(NamedTuple):
    """What a launch reads besides its scalars: the pointer table, and per tensor its size and first program."""

    pointers: torch.Tensor  # int64: each list's data pointers, list after list
    numels: torch.Tensor  # int64, per tensor of the first list
    first_blocks: torch.Tensor  # int32, per tensor its first program, padded to 2**search entries (``_span``)
    n_blocks: int
    search: int  # the kernels' SEARCH: halvings to find a program's tensor in first_blocks
    sizes: tuple[int, ...]  # numels, on the host
    aligned: bool  # every tensor starts on a 16-byte boundary (the kernels' ALIGNED)


#: Tables by the storage of the tensors they point at: ``(device, the first list's sizes, each list's dtype and data
#: pointers)``. A step over the same tensors (every step, unless one is reallocated: a checkpoint load, a ``.data``
#: swap, fresh grads at new addresses) builds, checks and copies nothing; its key costs a ``data_ptr()`` per tensor.
_tables_by_storage: dict[tuple[Any, ...], _Tables] = {}
_MAX_CACHED = 64  # a few optimizers x dtype lists x the grads' addresses (a caching allocator cycles through few)


#: What a caller read of a launch's last two lists when it checked them: the sizes (of every list, which
#: ``_build_tables`` makes sure of) and each list's data pointers (``kernel_step.Launch.known``).
Known = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class ListRead(NamedTuple):
    """What a launch's kernel reads one of its lists as: each tensor holds ``name``s of ``dtype``, one element per
    ``per`` elements of its tensor of the launch's first list (1: the same size; an 8-bit moment's absmax: one
    per block)."""

    name: str
    dtype: torch.dtype
    per: int = 1


#: A list's :class:`ListRead`, or None (not checked: a dtype the launch passes to the kernel as a constant, or a
#: list the kernel does not read).
ListDtype = ListRead | None
_FP32_MOMENTS: tuple[ListDtype, ...] = (ListRead("exp_avg", torch.float32), ListRead("exp_avg_sq", torch.float32))


def _storage_key(
    device: torch.device, lists: Sequence[Sequence[torch.Tensor]], known: Known | None = None
) -> tuple[Any, ...]:
    # The sizes too: they set the blocks, and memory freed and reallocated can hold another size.
    # Read with ``map`` over the methods: a loop in C, no Python call per tensor. Every pointer is read here, at
    # the launch: a tensor given other memory since it was checked (a ``.data`` assignment between the scale_loss
    # exit and the step) must not be written through its old address. ``known``: the sizes and the last two lists'
    # pointers as the caller read them when it checked them; where those pointers still hold, its sizes are taken
    # (the tensors are the ones checked, at the same addresses) instead of read again.
    pointers = [tuple(map(torch.Tensor.data_ptr, tensors)) for tensors in lists]
    if known is not None and pointers[-2:] == list(known[1:]):  # the last two lists: the masters and the weights
        sizes = known[0]
    else:
        sizes = tuple(map(torch.Tensor.numel, lists[0]))
    return (device, sizes, *((tensors[0].dtype if tensors else None, p) for tensors, p in zip(lists, pointers)))


def _tables(
    device: torch.device,
    *lists: Sequence[torch.Tensor],
    known: Known | None = None,
    same_sizes: bool = False,
    dtypes: Sequence[ListDtype] = (),
) -> _Tables:
    """The tables of a launch over ``lists`` (the first list sets the blocks), from the cache when the same
    storage was launched on before; built, checked and copied to the device once otherwise. ``known``: see
    ``_storage_key``; ``same_sizes``: every list must have the first one's sizes; ``dtypes``: what the kernel reads
    each list as (both checked when built: the key holds each list's dtype and sizes)."""
    key = _storage_key(device, lists, known)
    cached = _tables_by_storage.get(key)
    if cached is None:
        cached = _build_tables(device, lists, same_sizes, dtypes)
        if len(_tables_by_storage) >= _MAX_CACHED:
            _tables_by_storage.clear()
        _tables_by_storage[key] = cached
    return cached


#: The grads' pointer tables and whether they are aligned, by the same kind of key (the grads' sizes must be those
#: of the other lists).
_grad_tables_by_storage: dict[tuple[Any, ...], tuple[torch.Tensor, bool]] = {}


def _grad_table(
    device: torch.device, grads: Sequence[torch.Tensor], sizes: tuple[int, ...], key: tuple[Any, ...] | None = None
) -> tuple[torch.Tensor, bool]:
    """The grads' pointers and whether every grad starts on 16 bytes, from the cache when these grads were launched
    on before; ``sizes`` (the other lists') are what each grad must hold. ``key``: ``_storage_key(device,
    [grads])``, where the caller has just read it."""
    if key is None:
        key = _storage_key(device, [grads])
    cached = _grad_tables_by_storage.get(key)
    if cached is None:
        _check_lists(device, [grads])
        _, grad_sizes, (_, addresses) = key  # _storage_key of one list: (device, sizes, (dtype, data pointers))
        if grad_sizes != sizes:
            raise ValueError("the fused master step needs a grad of its master's size for every master")
        cached = _to_device(torch.tensor(addresses, dtype=torch.int64), device), _aligned(addresses)
        if len(_grad_tables_by_storage) >= _MAX_CACHED:
            _grad_tables_by_storage.clear()
        _grad_tables_by_storage[key] = cached
    return cached


def _launch_tables(
    grads: TensorList,
    *lists: TensorList,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
    same_sizes: bool = False,
    dtypes: Sequence[ListDtype] = (),
) -> tuple[_Tables, torch.Tensor, bool]:
    """A step launch's tables over ``lists`` (the state: masters and moments), cached by their storage, and the
    grads' own pointer table, cached by theirs; and whether every tensor of both starts on 16 bytes.

    The grads are kept out of the state's tables: a training loop makes them afresh each step, and where the caching
    allocator places them elsewhere (another model's step between two, variable-length batches) a key holding their
    pointers rebuilt every table, then a Python loop over every block of the model (on the H200 check of
    2026-11-27, the 8-bit dial's launch, which keyed them so: 38 ms of host time a step for 124M parameters, against
    a 37 ms step). A move costs a table of one entry per grad.

    ``grad_key``: ``_storage_key(device, [grads])`` as read when these grads were checked (the finite check's, at
    the ``scale_loss`` exit that planned this step: the plan holds the same grad tensors); ``known`` likewise the
    sizes and the last two lists' pointers (``kernel_step.Launch.known``: the masters and weights, as the plan read
    them when it checked them). The pointers are read again here and the sizes taken where they still hold: a
    tensor may have been given other memory in between (``p.grad.data = p.grad.clamp(...)`` after the block),
    and a launch through its old address would read freed memory. ``same_sizes``, ``dtypes``: see ``_tables``."""
    device = grads[0].device
    tables = _tables(device, *lists, known=known, same_sizes=same_sizes, dtypes=dtypes)
    if grad_key is not None and tuple(map(torch.Tensor.data_ptr, grads)) != grad_key[2][1]:
        grad_key = None  # a grad given other memory since it was checked (``.data`` assigned): its key read afresh
    grad_table, grads_aligned = _grad_table(device, grads, tables.sizes, grad_key)
    return tables, grad_table, tables.aligned and grads_aligned


def _check_lists(
    device: torch.device,
    lists: Sequence[Sequence[torch.Tensor]],
    same_sizes: bool = False,
    dtypes: Sequence[ListDtype] = (),
) -> None:
    """Raise unless every tensor is contiguous on ``device``, each list is of one dtype, (``same_sizes``) every
    non-empty list's sizes are the first list's, and each list is what ``dtypes`` says the kernel reads it as (by
    position; None or a missing entry: anything)."""
    firsts = [t.numel() for t in lists[0]] if lists else []
    for tensors, wanted in itertools.zip_longest(lists, dtypes[: len(lists)]):
        for tensor in tensors:
            if not tensor.is_contiguous() or tensor.device != device:
                raise ValueError(f"the fused master step needs contiguous tensors on {device}, got {tensor.device}")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError(
                f"the fused master step needs one dtype per list, got {sorted({str(t.dtype) for t in tensors})}"
            )
        if not tensors:
            continue  # an empty list is unread
        numels = [t.numel() for t in tensors]
        # The fp32-master kernels read every list with the first one's sizes (an optimizer state loaded from a
        # checkpoint of another model would be read and written out of its bounds).
        if same_sizes and numels != firsts:
            raise ValueError(
                "the fused master step needs the same sizes in every list (masters, weights, optimizer state: was "
                f"an optimizer state of another model loaded?), got {firsts} and {numels}"
            )
        # The kernels read each list through raw pointers as one dtype and size: an optimizer state of another
        # precision (bf16 moments assigned into ``opt.state``) would be read as fp32 and written twice its bytes.
        if wanted is not None:
            if tensors[0].dtype != wanted.dtype:
                raise ValueError(
                    f"the fused master step reads every {wanted.name} as {wanted.dtype}, got {tensors[0].dtype} (was "
                    "an optimizer state of another precision put in opt.state? torch's load_state_dict casts it to "
                    "the masters' dtype)"
                )
            expected = [-(-n // wanted.per) for n in firsts]
            if numels != expected:
                raise ValueError(
                    f"the fused master step needs {expected} elements in its {wanted.name} list (one per "
                    f"{wanted.per} of the masters' {firsts}), got {numels} (was an optimizer state of another model "
                    "put in opt.state?)"
                )


def _build_tables(
    device: torch.device,
    lists: Sequence[Sequence[torch.Tensor]],
    same_sizes: bool = False,
    dtypes: Sequence[ListDtype] = (),
) -> _Tables:
    """A launch's tables: its own pointer table, and the block tables of its sizes, which the finite check's launch
    over grads of these sizes shares."""
    _check_lists(device, lists, same_sizes, dtypes)
    addresses = [t.data_ptr() for tensors in lists for t in tensors]
    blocks = _size_tables(device, tuple(t.numel() for t in lists[0]))
    pointers = _to_device(torch.tensor(addresses, dtype=torch.int64), device)
    return blocks._replace(pointers=pointers, aligned=_aligned(addresses))


def _tables_on(device: torch.device, numels: Sequence[int]) -> _Tables:
    """The block tables of tensors of ``numels`` elements (one program per block of each), copied to ``device``, with
    an empty pointer table (a launch's own goes in by ``_replace``): each tensor's first program, which the kernels
    search (``_span``), so a table entry per tensor, not per block (the H100 check of 2026-11-27: a table per block,
    12 B per 1024 parameters, kept O5 remainder's peak 1.3 MiB over its bound, and its Python loop over 121k blocks
    took tens of milliseconds at each rebuild)."""
    firsts = list(itertools.accumulate((-(-n // _BLOCK) for n in numels), initial=0))
    n_blocks = firsts.pop()  # the end of the last tensor's programs
    search = max(len(numels) - 1, 0).bit_length()  # 2**search >= len(numels)
    padded = firsts + [_MAX_PROGRAMS] * ((1 << search) - len(firsts))  # never at most a program's index
    host = (
        torch.tensor(numels, dtype=torch.int64),
        torch.tensor(padded, dtype=torch.int32),
    )
    sizes, first_blocks = (_to_device(t, device) for t in host)
    pointers = torch.empty(0, dtype=torch.int64, device=device)
    return _Tables(pointers, sizes, first_blocks, n_blocks, search, tuple(numels), True)


#: The padding of ``first_blocks``: above every program's index (a CUDA grid has at most 2**31 - 1 programs).
_MAX_PROGRAMS = 2**31 - 1


#: Block tables by ``(device, sizes)`` alone, shared by every launch over tensors of those sizes (the finite check's
#: over grads, and through ``_build_tables`` the steps'): grads, which a training loop makes afresh each step and the
#: caching allocator may place elsewhere (variable-length batches move every activation), take their pointers from
#: ``_grad_table`` (one table of as many entries as tensors), so a move rebuilds nothing else.
_tables_by_sizes: dict[tuple[torch.device, tuple[int, ...]], _Tables] = {}


def _size_tables(device: torch.device, sizes: tuple[int, ...]) -> _Tables:
    key = (device, sizes)
    cached = _tables_by_sizes.get(key)
    if cached is None:
        cached = _tables_on(device, sizes)
        if len(_tables_by_sizes) >= _MAX_CACHED:
            _tables_by_sizes.clear()
        _tables_by_sizes[key] = cached
    return cached


def forget_tables() -> None:
    """Empty the table caches (``kernel_step.forget_tables``)."""
    _tables_by_storage.clear()
    _grad_tables_by_storage.clear()
    _tables_by_sizes.clear()


def _aligned(addresses: Sequence[int]) -> bool:
    """Whether every one of the tensors at ``addresses`` starts on a 16-byte boundary: torch's allocators place every
    tensor they allocate on one; a view into a flat buffer, a slice, may start anywhere. (One OR over the
    addresses: the grads' table is rebuilt whenever they move, so this runs in steps, and adds no call per tensor.)"""
    return functools.reduce(operator.or_, addresses, 0) % 16 == 0


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return table  # Triton's interpreter (tests): the table is already where the kernel reads it
    # From pinned memory the copy is asynchronous for real (from pageable memory CUDA stages it through a pinned
    # buffer on the host first); torch's pinned allocator keeps the buffer until the copy has run.
    return table.pin_memory().to(device, non_blocking=True)


#: Programs of the step-scalars launch take this many tensors each: one program for any model's few hundred.
_SCALARS_BLOCK = 256


def step_scalars_(
    powers: torch.Tensor, lr: float, steps: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
) -> torch.Tensor:
    """``[[step_size, sqrt(bias_correction2)], ...]`` (fp32, one row per tensor) from ``powers``, the float64
    ``2 x n`` powers ``[beta1**step; beta2**step]`` of the counts: in one launch, with its bits, what
    ``kernel_step.step_scalars`` does after its ``pow`` (four ops). With ``found_inf``, the counts ``steps`` (already
    advanced by one) are taken back by it (their ``sub_``), after the powers were read: a step the flag skips uses no
    scalar. Without a flag the counts are not read."""
    if powers.dtype != torch.float64 or powers.dim() != 2 or powers.shape[0] != 2 or not powers.is_contiguous():
        raise ValueError(f"the step scalars need contiguous float64 powers of shape (2, n), got {powers.dtype} "
                         f"of shape {tuple(powers.shape)}")  # fmt: skip
    n = powers.shape[1]
    if found_inf is None:
        counts = flag = powers  # unread: the kernel's HAS_FLAG is off (one specialisation whatever the counts)
    elif steps is None or steps.shape != (n,) or not steps.is_contiguous() or steps.device != powers.device:
        raise ValueError("the counts a flag takes back must be contiguous, one per tensor, on the powers' device")
    else:
        counts, flag = steps, found_inf
    scalars = torch.empty((n, 2), dtype=torch.float32, device=powers.device)
    if n:
        triton_launch.launch(
            _step_scalars_kernel,
            triton.cdiv(n, _SCALARS_BLOCK),
            (powers, counts, flag, scalars, n, float(lr)),
            {"HAS_FLAG": found_inf is not None, "POW": False, "BLOCK": _SCALARS_BLOCK},
            _OPTIONS,
            powers.device,
        )
    return scalars


def update_scale_(
    scale: torch.Tensor,
    tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float | None,
    max_scale: float,
) -> torch.Tensor:
    """A dynamic loss scale's update with hysteresis 1, in place, and its new ``1 / scale`` (a new tensor), in one
    launch: what ``_amp_update_scale_``, ``clamp_`` and ``reciprocal`` do in three (``reference.update_scale_``),
    two launches fewer at each O2 ``scale_loss`` exit. ``scale`` is the 0-d fp32 scale, ``tracker`` its 0-d int32
    count of clean steps, ``found_inf`` the one-element fp32 flag, all on one device."""
    if (scale.dtype, scale.dim(), tracker.dtype, tracker.dim()) != (torch.float32, 0, torch.int32, 0):
        raise ValueError(
            "a scale update takes a 0-d float32 scale and a 0-d int32 tracker, got a "
            f"{scale.dim()}-d {scale.dtype} scale and a {tracker.dim()}-d {tracker.dtype} tracker"
        )
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise ValueError(
            f"a scale update takes a one-element float32 flag, got {found_inf.dtype} {tuple(found_inf.shape)}"
        )
    if not (scale.device == tracker.device == found_inf.device):
        raise ValueError(
            f"a scale update's tensors must be on one device, got {scale.device}, {tracker.device}, {found_inf.device}"
        )
    inv_scale = torch.empty((), dtype=torch.float32, device=scale.device)
    triton_launch.launch(
        _scale_update_kernel,
        1,
        (
            scale, tracker, found_inf, inv_scale, float(growth_factor), float(backoff_factor), int(growth_interval),
            0.0 if min_scale is None else float(min_scale), float(max_scale),
        ),
        {"HAS_MIN": min_scale is not None},
        _OPTIONS,
        scale.device,
    )  # fmt: skip
    return inv_scale


def advance_step_scalars_(
    steps: torch.Tensor, betas: torch.Tensor, lr: float, found_inf: torch.Tensor | None = None
) -> torch.Tensor:
    """On CUDA, in one launch: the counts ``steps`` advanced by one (taken back where ``found_inf`` is raised), the
    float64 powers of ``betas`` (``[beta1, beta2]``, float64) to the advanced counts, and the step scalars of
    :func:`step_scalars_` from them: the counts' ``add_``, torch's ``pow`` and that launch, meant to give their bits
    (the powers by libdevice's ``pow``, the function torch's CUDA ``pow`` calls; ``kernel_step.POWERS_IN_LAUNCH``
    says whether the step takes it: not until a GPU check has compared the bits). Two launches fewer a step, each
    10-25 us of host time on the H100 checks' hosts."""
    device = steps.device
    if steps.dim() != 1 or not steps.is_contiguous() or steps.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the step scalars need contiguous 1-D float32 or float64 counts, got {steps.dtype} of "
                         f"shape {tuple(steps.shape)} and strides {steps.stride()}")  # fmt: skip
    if betas.dtype != torch.float64 or betas.numel() != 2 or not betas.is_contiguous() or betas.device != device:
        raise ValueError(f"the step scalars need the two betas as contiguous float64 on {device}, got {betas.dtype} "
                         f"of shape {tuple(betas.shape)} on {betas.device}")  # fmt: skip
    if device.type != "cuda":
        raise ValueError(f"the step scalars' powers are computed in the launch on CUDA only (libdevice's pow), got "
                         f"counts on {device}: use step_scalars_ after torch's pow")  # fmt: skip
    n = steps.shape[0]
    scalars = torch.empty((n, 2), dtype=torch.float32, device=device)
    if n:
        triton_launch.launch(
            _step_scalars_kernel,
            triton.cdiv(n, _SCALARS_BLOCK),
            (betas, steps, steps if found_inf is None else found_inf, scalars, n, float(lr)),
            {"HAS_FLAG": found_inf is not None, "POW": True, "BLOCK": _SCALARS_BLOCK},
            _POW_OPTIONS,
            device,
        )
    return scalars


def check_finite_(grads: TensorList, found_inf: torch.Tensor) -> tuple[Any, ...] | None:
    """See ``ampinit._masters.reference.check_finite_``. Returns the storage key of ``grads`` it read (their sizes
    and data pointers, for a step's launch over the same grads: ``_launch_tables``' ``grad_key``), None where
    nothing was launched."""
    if not grads:
        return None
    device = grads[0].device
    key = _storage_key(device, [grads])  # read once: the sizes for the blocks, the pointers for the grads' table
    tables = _size_tables(device, key[1])
    if not tables.n_blocks:
        return None  # empty grads only: nothing to read (and a launch of no programs is refused on CUDA)
    grad_table, aligned = _grad_table(device, grads, tables.sizes, key)
    triton_launch.launch(
        _check_kernel,
        tables.n_blocks,
        (grad_table, tables.numels, tables.first_blocks, found_inf),
        {"GRAD_T": _TL_DTYPES[grads[0].dtype], "ALIGNED": aligned, "SEARCH": tables.search, "BLOCK": _BLOCK},
        _OPTIONS,
        device,
    )
    return key


def _storage(masters: Masters) -> tuple[TensorList, TensorList, dict[str, Any]]:
    """The kernels' last two lists, and their STORAGE constants (the weight dtype matters only when written). What
    the kernels read them as: :data:`_STORAGE_DTYPES`."""
    if masters.kind not in ("fp32", "remainder"):
        # An int8 remainder would be read as int16, a bare bf16 weight as an fp32 master: triton_dial steps these.
        raise ValueError(
            f"the fused master step takes masters of kind 'fp32' or 'remainder', got {masters.kind!r} "
            "(ampinit._masters.triton_dial steps the precision dial's kinds)"
        )
    if masters.remainders:
        storage, lists, weight_dtype = _REMAINDER, (masters.weights, masters.remainders), torch.bfloat16
    elif masters.weights:
        storage, lists, weight_dtype = _MASTER_AND_WEIGHT, (masters.masters, masters.weights), masters.weights[0].dtype
    else:
        storage, lists, weight_dtype = _MASTER, (masters.masters, []), torch.float16
    weight_t, weight_is_bf16 = _TL_DTYPES[weight_dtype], weight_dtype == torch.bfloat16
    return *lists, {"STORAGE": storage, "WEIGHT_T": weight_t, "WEIGHT_IS_BF16": weight_is_bf16}


#: By STORAGE, what the kernels read ``_storage``'s two lists as (a model weight's dtype is the WEIGHT_T constant).
_STORAGE_DTYPES: dict[int, tuple[ListDtype, ListDtype]] = {
    _REMAINDER: (ListRead("bf16 weight", torch.bfloat16), ListRead("remainder", torch.int16)),
    _MASTER_AND_WEIGHT: (ListRead("master", torch.float32), None),
    _MASTER: (ListRead("master", torch.float32), None),
}


#: A step launch's tables, made before the launch (``_prepare``): its tables, the grads' pointer table, whether every
#: tensor starts on 16 bytes, and the STORAGE constants of its masters.
Prepared = tuple[_Tables, torch.Tensor, bool, dict[str, Any]]


def _prepare(
    grads: TensorList,
    lists: Sequence[TensorList],
    list_dtypes: Sequence[ListDtype],
    masters: Masters,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
) -> Prepared:
    """The tables of a launch over ``grads`` (not empty), ``lists`` and ``masters``, each list checked as the kernel
    reads it (``list_dtypes``; ``grad_key``, ``known``: see ``_launch_tables``; ``known`` describes the masters and
    their weights)."""
    first, second, storage = _storage(masters)
    if masters.remainders:
        known = None  # its last lists are the weights and remainders, not what ``known`` describes
    dtypes = (*list_dtypes, *_STORAGE_DTYPES[storage["STORAGE"]])
    tables, grad_table, aligned = _launch_tables(
        grads, *lists, first, second, grad_key=grad_key, known=known, same_sizes=True, dtypes=dtypes
    )
    return tables, grad_table, aligned, storage


def _launch(
    kernel: Any,
    grads: TensorList,
    lists: Sequence[TensorList],
    list_dtypes: Sequence[ListDtype],
    masters: Masters,
    scalars: Sequence[object],
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    maximize: bool,
    constants: dict[str, Any],
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
    prepared: Prepared | None = None,
) -> None:
    """One launch of ``kernel`` over ``grads``, ``lists`` and ``masters``, one program per block of each tensor
    (``list_dtypes``, ``grad_key``, ``known``: see :func:`_prepare`). ``prepared``: what :func:`_prepare` made of
    these lists earlier in the same step (then nothing is read again)."""
    if not grads:
        return
    if prepared is None:
        prepared = _prepare(grads, lists, list_dtypes, masters, grad_key, known)
    tables, grad_table, aligned, storage = prepared
    unread = grads[0]  # passed for an absent scale or flag: the kernel never reads it
    triton_launch.launch(
        kernel,
        tables.n_blocks,
        (
            grad_table,
            tables.pointers,
            tables.numels,
            tables.first_blocks,
            len(grads),
            unread if inv_scale is None else inv_scale,
            unread if found_inf is None else found_inf,
            *scalars,
        ),
        {
            "GRAD_T": _TL_DTYPES[grads[0].dtype],
            "HAS_SCALE": inv_scale is not None,
            "HAS_FLAG": found_inf is not None,
            "MAXIMIZE": maximize,
            "ALIGNED": aligned,
            "SEARCH": tables.search,
            "BLOCK": _BLOCK,
            **storage,
            **constants,
        },
        _OPTIONS,
        grads[0].device,
    )


def adam_(
    grads: TensorList,
    masters: Masters,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    step_scalars: torch.Tensor,
    settings: AdamSettings,
    *,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
    prepared: Prepared | None = None,
) -> None:
    """See ``ampinit._masters.reference.adam_`` (same arguments, same bits; ``grad_key``: the storage key of
    ``grads`` where the caller read it when it checked them, ``check_finite_``'s; ``known``: the masters' sizes and
    data pointers and the weights' pointers, likewise, ``kernel_step.Launch.known``; ``prepared``: what
    :func:`adam_tables` made of the same lists earlier in the step)."""
    s = settings
    betas = (s.beta1, 1 - s.beta1, s.beta2, 1 - s.beta2)
    scalars = (step_scalars.contiguous(), *betas, s.eps, s.weight_decay, 1 - s.lr * s.weight_decay)
    constants = {"DECAY": 0 if s.weight_decay == 0 else (2 if s.decoupled else 1)}
    _launch(
        _adam_kernel, grads, (exp_avgs, exp_avg_sqs), _FP32_MOMENTS, masters, scalars, inv_scale, found_inf,
        s.maximize, constants, grad_key, known, prepared,
    )  # fmt: skip


def adam_tables(
    grads: TensorList,
    masters: Masters,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    *,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
) -> Prepared | None:
    """The tables :func:`adam_` would make of these lists, each checked (a ``ValueError`` where it would refuse
    them), for a step that makes every launch's before its first launch: a step of several launches refused at a
    later one would have written the earlier ones. None for no grads (nothing launched)."""
    return _prepare(grads, (exp_avgs, exp_avg_sqs), _FP32_MOMENTS, masters, grad_key, known) if grads else None


def sgd_(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: TensorList,
    settings: SgdSettings,
    *,
    first_step: bool,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
    prepared: Prepared | None = None,
) -> None:
    """See ``ampinit._masters.reference.sgd_`` (same arguments, same bits; ``grad_key``, ``known`` and ``prepared``:
    as :func:`adam_`'s, ``prepared`` made by :func:`sgd_tables`)."""
    s = settings
    scalars = (s.lr, s.momentum, 1 - s.dampening, s.weight_decay)
    flags = {"HAS_DECAY": s.weight_decay != 0, "HAS_MOMENTUM": s.momentum != 0, "NESTEROV": s.nesterov}
    constants = {**flags, "FIRST_STEP": first_step}
    buffers, read_as = _sgd_lists(masters, momentum_buffers)
    _launch(
        _sgd_kernel, grads, buffers, read_as, masters, scalars, inv_scale, found_inf, s.maximize, constants,
        grad_key, known, prepared,
    )  # fmt: skip


def sgd_tables(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: TensorList,
    *,
    grad_key: tuple[Any, ...] | None = None,
    known: Known | None = None,
) -> Prepared | None:
    """The tables :func:`sgd_` would make of these lists, each checked: as :func:`adam_tables`."""
    if not grads:
        return None
    buffers, read_as = _sgd_lists(masters, momentum_buffers)
    return _prepare(grads, buffers, read_as, masters, grad_key, known)


def _sgd_lists(masters: Masters, momentum_buffers: TensorList) -> tuple[tuple[TensorList], tuple[ListDtype]]:
    """The SGD kernel's own list and what it reads it as: the momentum buffers, or without momentum the masters'
    first list again (the same sizes, unread)."""
    if momentum_buffers:
        return (momentum_buffers,), (ListRead("momentum_buffer", torch.float32),)
    return (masters.weights if masters.remainders else masters.masters,), (None,)
