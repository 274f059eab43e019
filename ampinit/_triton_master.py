"""Triton kernels for the master-weight step: the fused twins of ``ampinit._fused_master``'s reference functions.

Imported only when ``triton`` is importable (``ampinit._fused_master.triton_available``). Each public function
takes exactly the arguments of the reference function of the same name and gives the same bits:

- one launch per list (per dtype combination): every tensor's data pointer goes into a small int64 table, and a
  block table maps each program to (tensor, offset), as Apex's multi-tensor apply does with its chunk lists;
- fp32 math in the reference's order, each operation rounded (``enable_fp_fusion=False``: no fused
  multiply-add), division and square root correctly rounded (``div_rn``, ``sqrt_rn``);
- fp32 -> bf16 rounds to nearest-even with integer ops of our own: Triton's interpreter truncates that cast,
  and writing it out keeps one code path for the GPU and for the interpreter that tests it on CPU;
- the overflow flag masks every load and store, so a flagged step reads and writes nothing, without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ampinit._types import TensorList

_BLOCK = 1024

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
def _block(ptrs, numels, block_tensor, block_start, flag_ptr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    limit = tl.load(numels + t)
    if HAS_FLAG:
        limit = tl.where(tl.load(flag_ptr) == 0, limit, 0)  # a raised flag masks everything out
    return t, offs, offs < limit


@triton.jit
def _check_kernel(ptrs, numels, block_tensor, block_start, flag_ptr, GRAD_T: tl.constexpr, BLOCK: tl.constexpr):
    t, offs, mask = _block(ptrs, numels, block_tensor, block_start, flag_ptr, False, BLOCK)
    g = tl.load(tl.load(ptrs + t).to(tl.pointer_type(GRAD_T)) + offs, mask=mask, other=0.0).to(tl.float32)
    bad = (g != g) | (tl.abs(g) == float("inf"))
    # Every bad lane writes the same 1.0 to the flag: a benign race, and no reduction needed.
    tl.store(flag_ptr + offs * 0, tl.where(bad, 1.0, 0.0), mask=bad)


@triton.jit
def _load_grad(
    ptrs, t, offs, mask, inv_scale_ptr, GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr
):
    """The fp32, unscaled (and for ``maximize`` negated) grad of tensor ``t``, the first list of ``ptrs``."""
    g_ptr = tl.load(ptrs + t).to(tl.pointer_type(GRAD_T))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(inv_scale_ptr)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _adam_update(
    g, p, m_ptr, v_ptr, offs, mask, t, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    weight_decay, decay_factor, DECAY: tl.constexpr,
):  # fmt: skip
    """Adam/AdamW on fp32 master values ``p`` (``ampinit._fused_master.adam_``): stores m and v, returns p."""
    if DECAY == 1:
        g = g + p * weight_decay
    if DECAY == 2:
        p = p * decay_factor
    m = tl.load(m_ptr + offs, mask=mask, other=0.0) * beta1 + g * one_minus_beta1
    v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + (g * g) * one_minus_beta2
    step_size = tl.load(step_scalars + 2 * t)
    bias_correction2_sqrt = tl.load(step_scalars + 2 * t + 1)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt) + eps
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    return p - tl.math.div_rn(step_size * m, denom)


@triton.jit
def _sgd_update(
    g, p, ptrs, buf_list, n_tensors, t, offs, mask, neg_lr, momentum, one_minus_dampening, weight_decay,
    HAS_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
):  # fmt: skip
    """SGD on fp32 master values ``p`` (``ampinit._fused_master.sgd_``); the momentum buffers are list
    ``buf_list`` of ``ptrs``. Stores the buffer, returns p."""
    if HAS_DECAY:
        g = g + p * weight_decay
    if HAS_MOMENTUM:
        b_ptr = tl.load(ptrs + buf_list * n_tensors + t).to(tl.pointer_type(tl.float32))
        if FIRST_STEP:  # noqa: SIM108  (branches on constexprs are compiled away; keep them as statements)
            buf = g
        else:
            buf = tl.load(b_ptr + offs, mask=mask, other=0.0) * momentum + g * one_minus_dampening
        tl.store(b_ptr + offs, buf, mask=mask)
        if NESTEROV:  # noqa: SIM108
            g = g + buf * momentum
        else:
            g = buf
    return p + g * neg_lr


@triton.jit
def _adam_kernel(
    ptrs,
    numels,
    block_tensor,
    block_start,
    n_tensors,
    step_scalars,
    inv_scale_ptr,
    flag_ptr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    decay_factor,
    GRAD_T: tl.constexpr,
    WEIGHT_T: tl.constexpr,
    WEIGHT_IS_BF16: tl.constexpr,
    WRITE_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,  # 0: none, 1: L2 (Adam), 2: decoupled (AdamW)
    BLOCK: tl.constexpr,
):
    t, offs, mask = _block(ptrs, numels, block_tensor, block_start, flag_ptr, HAS_FLAG, BLOCK)
    p_ptr = tl.load(ptrs + n_tensors + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(ptrs + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(ptrs + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    g = _load_grad(ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    p = _adam_update(
        g, p, m_ptr, v_ptr, offs, mask, t, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
        weight_decay, decay_factor, DECAY,
    )  # fmt: skip
    tl.store(p_ptr + offs, p, mask=mask)
    if WRITE_WEIGHT:
        w_ptr = tl.load(ptrs + 4 * n_tensors + t).to(tl.pointer_type(WEIGHT_T))
        tl.store(w_ptr + offs, _to_weight(p, WEIGHT_IS_BF16, WEIGHT_T), mask=mask)


@triton.jit
def _sgd_kernel(
    ptrs,
    numels,
    block_tensor,
    block_start,
    n_tensors,
    inv_scale_ptr,
    flag_ptr,
    neg_lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    GRAD_T: tl.constexpr,
    WEIGHT_T: tl.constexpr,
    WEIGHT_IS_BF16: tl.constexpr,
    WRITE_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, offs, mask = _block(ptrs, numels, block_tensor, block_start, flag_ptr, HAS_FLAG, BLOCK)
    p_ptr = tl.load(ptrs + n_tensors + t).to(tl.pointer_type(tl.float32))
    g = _load_grad(ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    p = _sgd_update(
        g, p, ptrs, 2, n_tensors, t, offs, mask, neg_lr, momentum, one_minus_dampening, weight_decay,
        HAS_DECAY, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
    )  # fmt: skip
    tl.store(p_ptr + offs, p, mask=mask)
    if WRITE_WEIGHT:
        w_ptr = tl.load(ptrs + 3 * n_tensors + t).to(tl.pointer_type(WEIGHT_T))
        tl.store(w_ptr + offs, _to_weight(p, WEIGHT_IS_BF16, WEIGHT_T), mask=mask)


# -- launching ------------------------------------------------------------------------------------------------
_block_tables: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}


def _tables(device: torch.device, numels: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(numels, block -> tensor, block -> start offset, block count), cached per tensor-size signature."""
    key = (device, numels)
    cached = _block_tables.get(key)
    if cached is None:
        blocks = [(t, start) for t, n in enumerate(numels) for start in range(0, n, _BLOCK)]
        sizes = torch.tensor(numels, dtype=torch.int64)
        block_tensor = torch.tensor([b[0] for b in blocks], dtype=torch.int32)
        block_start = torch.tensor([b[1] for b in blocks], dtype=torch.int64)
        cached = (sizes.to(device), block_tensor.to(device), block_start.to(device), len(blocks))
        if len(_block_tables) > 64:
            _block_tables.clear()
        _block_tables[key] = cached
    return cached


def _pointers(device: torch.device, *lists: Sequence[torch.Tensor]) -> torch.Tensor:
    for tensors in lists:
        for tensor in tensors:
            if not tensor.is_contiguous() or tensor.device != device:
                raise ValueError(f"the fused master step needs contiguous tensors on {device}, got {tensor.device}")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError(
                f"the fused master step needs one dtype per list, got {sorted({str(t.dtype) for t in tensors})}"
            )
    table = [t.data_ptr() for tensors in lists for t in tensors]
    return torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)


def _weight_args(weights: TensorList) -> tuple[Any, bool, bool]:
    if not weights:
        return tl.float16, False, False
    return _TL_DTYPES[weights[0].dtype], weights[0].dtype == torch.bfloat16, True


def check_finite_(grads: TensorList, found_inf: torch.Tensor) -> None:
    """See ``ampinit._fused_master.check_finite_``."""
    if not grads:
        return
    device = grads[0].device
    sizes, block_tensor, block_start, n_blocks = _tables(device, tuple(g.numel() for g in grads))
    _check_kernel[(n_blocks,)](
        _pointers(device, grads), sizes, block_tensor, block_start, found_inf, _TL_DTYPES[grads[0].dtype], _BLOCK
    )


def adam_(
    weights: TensorList,
    grads: TensorList,
    masters: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    step_scalars: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """See ``ampinit._fused_master.adam_`` (same arguments, same bits)."""
    if not masters:
        return
    device = masters[0].device
    sizes, block_tensor, block_start, n_blocks = _tables(device, tuple(m.numel() for m in masters))
    weight_t, weight_is_bf16, write_weight = _weight_args(weights)
    decay = 0 if weight_decay == 0 else (2 if decoupled else 1)
    _adam_kernel[(n_blocks,)](
        _pointers(device, grads, masters, exp_avgs, exp_avg_sqs, weights),
        sizes,
        block_tensor,
        block_start,
        len(masters),
        step_scalars.contiguous(),
        masters[0] if inv_scale is None else inv_scale,
        masters[0] if found_inf is None else found_inf,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        weight_decay,
        1 - lr * weight_decay,
        GRAD_T=_TL_DTYPES[grads[0].dtype],
        WEIGHT_T=weight_t,
        WEIGHT_IS_BF16=weight_is_bf16,
        WRITE_WEIGHT=write_weight,
        HAS_SCALE=inv_scale is not None,
        HAS_FLAG=found_inf is not None,
        MAXIMIZE=maximize,
        DECAY=decay,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )


def sgd_(
    weights: TensorList,
    grads: TensorList,
    masters: TensorList,
    momentum_buffers: TensorList,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first_step: bool,
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """See ``ampinit._fused_master.sgd_`` (same arguments, same bits)."""
    if not masters:
        return
    device = masters[0].device
    sizes, block_tensor, block_start, n_blocks = _tables(device, tuple(m.numel() for m in masters))
    weight_t, weight_is_bf16, write_weight = _weight_args(weights)
    _sgd_kernel[(n_blocks,)](
        # Without momentum the buffer column holds the masters, unread, so the weights' column stays put.
        _pointers(device, grads, masters, momentum_buffers or masters, weights),
        sizes,
        block_tensor,
        block_start,
        len(masters),
        masters[0] if inv_scale is None else inv_scale,
        masters[0] if found_inf is None else found_inf,
        -lr,
        momentum,
        1 - dampening,
        weight_decay,
        GRAD_T=_TL_DTYPES[grads[0].dtype],
        WEIGHT_T=weight_t,
        WEIGHT_IS_BF16=weight_is_bf16,
        WRITE_WEIGHT=write_weight,
        HAS_SCALE=inv_scale is not None,
        HAS_FLAG=found_inf is not None,
        MAXIMIZE=maximize,
        HAS_DECAY=weight_decay != 0,
        HAS_MOMENTUM=momentum != 0,
        FIRST_STEP=first_step,
        NESTEROV=nesterov,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )


# -- remainder masters (ampinit._remainder): the master is the bf16 weight plus an int16 remainder -----------
@triton.jit
def _join_master(weight_bits, remainder):
    # (weight << 16) + remainder on the int16 bit patterns, read back as fp32: ampinit._remainder.join.
    return (weight_bits.to(tl.int32) * 65536 + remainder.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(p):
    # ampinit._remainder.split_: NaN made canonical, then the upper half rounded half up on the signed bits
    # (ties away from zero on the magnitude) and what is left below it.
    bits = tl.where(p != p, 0x7FC00000, p.to(tl.int32, bitcast=True))
    upper = (bits + 0x8000) >> 16
    return upper.to(tl.int16), (bits - upper * 65536).to(tl.int16)


@triton.jit
def _adam_remainder_kernel(
    ptrs,
    numels,
    block_tensor,
    block_start,
    n_tensors,
    step_scalars,
    inv_scale_ptr,
    flag_ptr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    decay_factor,
    GRAD_T: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,  # 0: none, 1: L2 (Adam), 2: decoupled (AdamW)
    BLOCK: tl.constexpr,
):
    t, offs, mask = _block(ptrs, numels, block_tensor, block_start, flag_ptr, HAS_FLAG, BLOCK)
    w_ptr = tl.load(ptrs + n_tensors + t).to(tl.pointer_type(tl.int16))
    r_ptr = tl.load(ptrs + 2 * n_tensors + t).to(tl.pointer_type(tl.int16))
    m_ptr = tl.load(ptrs + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(ptrs + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
    g = _load_grad(ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE)
    p = _join_master(tl.load(w_ptr + offs, mask=mask, other=0), tl.load(r_ptr + offs, mask=mask, other=0))
    p = _adam_update(
        g, p, m_ptr, v_ptr, offs, mask, t, step_scalars, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
        weight_decay, decay_factor, DECAY,
    )  # fmt: skip
    weight_bits, remainder = _split_master(p)
    tl.store(w_ptr + offs, weight_bits, mask=mask)
    tl.store(r_ptr + offs, remainder, mask=mask)


@triton.jit
def _sgd_remainder_kernel(
    ptrs,
    numels,
    block_tensor,
    block_start,
    n_tensors,
    inv_scale_ptr,
    flag_ptr,
    neg_lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    GRAD_T: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, offs, mask = _block(ptrs, numels, block_tensor, block_start, flag_ptr, HAS_FLAG, BLOCK)
    w_ptr = tl.load(ptrs + n_tensors + t).to(tl.pointer_type(tl.int16))
    r_ptr = tl.load(ptrs + 2 * n_tensors + t).to(tl.pointer_type(tl.int16))
    g = _load_grad(ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE)
    p = _join_master(tl.load(w_ptr + offs, mask=mask, other=0), tl.load(r_ptr + offs, mask=mask, other=0))
    p = _sgd_update(
        g, p, ptrs, 3, n_tensors, t, offs, mask, neg_lr, momentum, one_minus_dampening, weight_decay,
        HAS_DECAY, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
    )  # fmt: skip
    weight_bits, remainder = _split_master(p)
    tl.store(w_ptr + offs, weight_bits, mask=mask)
    tl.store(r_ptr + offs, remainder, mask=mask)


def adam_remainder_(
    weights: TensorList,
    remainders: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    step_scalars: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """See ``ampinit._remainder.adam_`` (same arguments, same bits)."""
    if not weights:
        return
    device = weights[0].device
    sizes, block_tensor, block_start, n_blocks = _tables(device, tuple(w.numel() for w in weights))
    decay = 0 if weight_decay == 0 else (2 if decoupled else 1)
    _adam_remainder_kernel[(n_blocks,)](
        _pointers(device, grads, weights, remainders, exp_avgs, exp_avg_sqs),
        sizes,
        block_tensor,
        block_start,
        len(weights),
        step_scalars.contiguous(),
        exp_avgs[0] if inv_scale is None else inv_scale,
        exp_avgs[0] if found_inf is None else found_inf,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        weight_decay,
        1 - lr * weight_decay,
        GRAD_T=_TL_DTYPES[grads[0].dtype],
        HAS_SCALE=inv_scale is not None,
        HAS_FLAG=found_inf is not None,
        MAXIMIZE=maximize,
        DECAY=decay,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )


def sgd_remainder_(
    weights: TensorList,
    remainders: TensorList,
    grads: TensorList,
    momentum_buffers: TensorList,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first_step: bool,
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """See ``ampinit._remainder.sgd_`` (same arguments, same bits)."""
    if not weights:
        return
    device = weights[0].device
    sizes, block_tensor, block_start, n_blocks = _tables(device, tuple(w.numel() for w in weights))
    _sgd_remainder_kernel[(n_blocks,)](
        # Without momentum the buffer column repeats the grads, unread.
        _pointers(device, grads, weights, remainders, momentum_buffers or grads),
        sizes,
        block_tensor,
        block_start,
        len(weights),
        grads[0] if inv_scale is None else inv_scale,
        grads[0] if found_inf is None else found_inf,
        -lr,
        momentum,
        1 - dampening,
        weight_decay,
        GRAD_T=_TL_DTYPES[grads[0].dtype],
        HAS_SCALE=inv_scale is not None,
        HAS_FLAG=found_inf is not None,
        MAXIMIZE=maximize,
        HAS_DECAY=weight_decay != 0,
        HAS_MOMENTUM=momentum != 0,
        FIRST_STEP=first_step,
        NESTEROV=nesterov,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )
