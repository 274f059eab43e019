"""Triton kernels for the precision dial's step: the fused twins of ``reference.adam_dial_`` and ``sgd_dial_``.

Same arguments, same bits, one launch per list (the launch tables, grad loading and the overflow flag are
``ampinit._masters.triton_kernels``'). Each program takes ``BLOCK`` elements of one tensor, a whole number of
8-bit blocks (``QBLOCK``), and in one pass reads the half grad, the master's storage and the moments' storage,
decodes them to fp32, runs the reference's per-element math (fp32, each op rounded, no fused multiply-add), and
encodes what it stores:

- random bits ``mix32(key ^ i)`` per element in uint32 arithmetic, the key of each tensor and purpose read from
  the caller's key tables (``ampinit._masters.precision``);
- stochastic rounding on the signed fp32 bits, as the reference: bf16 weights, bf16 moments, 8-bit remainders;
- 8-bit moments: each QBLOCK's absmax by a row maximum of the ``[BLOCK // QBLOCK, QBLOCK]`` view, the quotient
  correctly rounded (``div_rn``), the code by 8 halvings over the 256 decision points of the map (the last one
  ``+inf``), decoding by a gather from the 256-entry map;
- as in ``triton_kernels``, a whole block (every block but a tensor's last) loads and stores without a mask, and
  where every tensor of every list of the launch starts on 16 bytes (``ALIGNED``, from the launch tables) the
  pointers say so, so that the compiler moves each thread's run of elements in vector accesses: 16 bytes for fp32
  and 16-bit lists, 8 for the 1-byte codes and remainders (a thread holds 8 elements of a block). A tensor's last,
  partial block stays masked, its partial 8-bit block's absmax taken over the elements it holds.

Bytes each launch reads and writes per parameter element (from the kernels' loads and stores; a bf16 model, bf16
grads; the 8-bit absmax adds 4 bytes per 256 elements each way, the key tables and maps a few bytes per program):

====================  =========================  ======  =======
storage               what is loaded / stored    read    written
====================  =========================  ======  =======
grad                  bf16 grad                  2       0
``"fp32"`` masters    fp32 master, bf16 weight   4       4 + 2
``"remainder"``       bf16 weight + int16        2 + 2   2 + 2
``"remainder8"``      bf16 weight + int8         2 + 1   2 + 1
``"stochastic"``      bf16 weight                2       2
moment, ``"fp32"``    fp32, per moment           4       4
moment, ``"bf16"``    bf16, per moment           2       2
moment, ``"8bit"``    uint8 code, per moment     1       1
====================  =========================  ======  =======

So an AdamW step over ``"remainder8"`` masters and 8-bit moments moves 2 + 3 + 2 = 7 bytes in and 3 + 2 = 5 out
per parameter; fp32 masters with fp32 moments (today's O5 kernels) 14 in and 14 out.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ampinit._masters import triton_launch
from ampinit._masters.precision import QBLOCK, QuantMap
from ampinit._masters.reference import AdamSettings, Masters, Moments, SgdSettings
from ampinit._masters.triton_kernels import (
    _BLOCK,
    _OPTIONS,
    _TL_DTYPES,
    ListDtype,
    ListRead,
    _launch_tables,
    _ld,
    _load_grad,
    _span,
    _st,
    _tensor_ptr,
    _to_weight,
)
from ampinit._types import TensorList

# The launch tables cut tensors into _BLOCK elements: a multiple of QBLOCK, so a program's 8-bit blocks are its own.
assert _BLOCK % QBLOCK == 0

_KINDS = {"fp32": 0, "remainder": 2, "remainder8": 3, "stochastic": 4}  # 1: fp32 masters and half weights
_FORMATS = {"fp32": 0, "bf16": 1, "8bit": 2}


@triton.jit
def _mix32(x):
    # On uint32, modulo 2**32; the casts keep a product that a constant promoted to a wider type at 32 bits.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _bits(keys, t, offs):
    """The random bits (uint32) of the elements ``offs`` of tensor ``t``, whose key is ``keys[t]``."""
    key = tl.load(keys + t).to(tl.uint32)
    return _mix32(key ^ offs.to(tl.uint32))


@triton.jit
def _signed_bits(x):
    return tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))


@triton.jit
def _widen(bits16):
    # A bf16 pattern (int16) as fp32: the upper half, exact.
    return (bits16.to(tl.int32) * 65536).to(tl.float32, bitcast=True)


@triton.jit
def _stochastic_bf16(x, bits):
    """fp32 ``x`` stochastically rounded to bf16, as an int16 pattern (``precision.round_bf16_stochastic``)."""
    return ((_signed_bits(x) + (bits & 0xFFFF).to(tl.int32)) >> 16).to(tl.int16)


@triton.jit
def _list_ptr(ptrs, n_tensors, which, t, T: tl.constexpr, ALIGNED: tl.constexpr):
    return _tensor_ptr(ptrs, which * n_tensors + t, T, ALIGNED)


@triton.jit
def _load_master(
    ptrs, n_tensors, first, t, offs, mask, KIND: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr
):
    """The fp32 master of tensor ``t`` from lists ``first`` and ``first + 1`` (``Masters.master``)."""
    if KIND <= 1:
        p = _ld(_list_ptr(ptrs, n_tensors, first, t, tl.float32, ALIGNED) + offs, mask, MASKED)
    else:
        w = _ld(_list_ptr(ptrs, n_tensors, first, t, tl.int16, ALIGNED) + offs, mask, MASKED)
        if KIND == 2:
            r = _ld(_list_ptr(ptrs, n_tensors, first + 1, t, tl.int16, ALIGNED) + offs, mask, MASKED)
            p = (w.to(tl.int32) * 65536 + r.to(tl.int32)).to(tl.float32, bitcast=True)
        elif KIND == 3:
            r = _ld(_list_ptr(ptrs, n_tensors, first + 1, t, tl.int8, ALIGNED) + offs, mask, MASKED)
            p = ((w.to(tl.int32) * 256 + r.to(tl.int32)) * 256).to(tl.float32, bitcast=True)
        else:
            p = _widen(w)
    return p


@triton.jit
def _store_master(
    p, ptrs, n_tensors, first, t, offs, mask, keys, KIND: tl.constexpr, WEIGHT_T: tl.constexpr,
    WEIGHT_IS_BF16: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Store the updated master ``p`` where :func:`_load_master` read it (``Masters.store``)."""
    if KIND <= 1:
        _st(_list_ptr(ptrs, n_tensors, first, t, tl.float32, ALIGNED) + offs, p, mask, MASKED)
        if KIND == 1:
            w_ptr = _list_ptr(ptrs, n_tensors, first + 1, t, WEIGHT_T, ALIGNED)
            _st(w_ptr + offs, _to_weight(p, WEIGHT_IS_BF16, WEIGHT_T), mask, MASKED)
    else:
        w_ptr = _list_ptr(ptrs, n_tensors, first, t, tl.int16, ALIGNED)
        if KIND == 4:
            _st(w_ptr + offs, _stochastic_bf16(p, _bits(keys, t, offs)), mask, MASKED)
        else:
            b = _signed_bits(p)
            if KIND == 3:
                b = (b + (_bits(keys, t, offs) & 0xFF).to(tl.int32)) >> 8  # 24 bits, stochastically rounded
                w = (b + 0x80) >> 8
                r_ptr = _list_ptr(ptrs, n_tensors, first + 1, t, tl.int8, ALIGNED)
                _st(r_ptr + offs, (b - w * 256).to(tl.int8), mask, MASKED)
            else:
                w = (b + 0x8000) >> 16
                r_ptr = _list_ptr(ptrs, n_tensors, first + 1, t, tl.int16, ALIGNED)
                _st(r_ptr + offs, (b - w * 65536).to(tl.int16), mask, MASKED)
            _st(w_ptr + offs, w.to(tl.int16), mask, MASKED)


# The absmax through tl.reduce with a combiner of our own: triton.language's tl.max (and tl.zeros) are jit
# functions built when triton is imported, which the interpreter (switched on later, tests/_triton.py) cannot call.
@triton.jit
def _larger(a, b):
    # NaN wins, as in torch's amax (the reference's absmax): a NaN moment makes its 8-bit block's absmax NaN, not
    # the largest other magnitude (which would store the NaN as a finite code).
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _load_moment(
    ptrs, n_tensors, first, t, offs, mask, qmap, FMT: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
    QBLOCK: tl.constexpr,
):  # fmt: skip
    """Moment values (fp32) of tensor ``t`` from lists ``first`` (values) and ``first + 1`` (8-bit absmax)."""
    if FMT == 0:
        m = _ld(_list_ptr(ptrs, n_tensors, first, t, tl.float32, ALIGNED) + offs, mask, MASKED)
    elif FMT == 1:
        m = _widen(_ld(_list_ptr(ptrs, n_tensors, first, t, tl.int16, ALIGNED) + offs, mask, MASKED))
    else:
        codes = _ld(_list_ptr(ptrs, n_tensors, first, t, tl.uint8, ALIGNED) + offs, mask, MASKED)
        absmax_ptr = _list_ptr(ptrs, n_tensors, first + 1, t, tl.float32, ALIGNED)
        m = tl.load(qmap + codes.to(tl.int32)) * _ld(absmax_ptr + offs // QBLOCK, mask, MASKED)
    return m


@triton.jit
def _store_moment(
    m, ptrs, n_tensors, first, t, start, limit, offs, mask, keys, qmap, FMT: tl.constexpr, MASKED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """Store fp32 moment values ``m`` encoded in format ``FMT`` (``Moments.store``); ``qmap`` is the map, its 256
    decision points follow it."""
    if FMT == 0:
        _st(_list_ptr(ptrs, n_tensors, first, t, tl.float32, ALIGNED) + offs, m, mask, MASKED)
    elif FMT == 1:
        bf16 = _stochastic_bf16(m, _bits(keys, t, offs))
        _st(_list_ptr(ptrs, n_tensors, first, t, tl.int16, ALIGNED) + offs, bf16, mask, MASKED)
    else:
        rows: tl.constexpr = BLOCK // QBLOCK
        magnitude = tl.abs(m)
        if MASKED:
            # Past the tensor's end m is not 0 for every scale (0 * an infinite inverse scale is NaN): it must not
            # enter the absmax of the tensor's last 8-bit block.
            magnitude = tl.where(mask, magnitude, 0.0)
        absmax_rows = tl.reduce(tl.reshape(magnitude, (rows, QBLOCK)), 1, _larger)
        absmax = tl.reshape(tl.broadcast_to(absmax_rows[:, None], (rows, QBLOCK)), (BLOCK,))
        y = tl.where(absmax == 0, 0.0, tl.math.div_rn(m, tl.where(absmax == 0, 1.0, absmax)))
        # The code: how many decision points lie strictly below y, by halving over the 256 (the last is +inf).
        code = (offs * 0).to(tl.int32)  # zeros (tl.zeros is one of those jit functions)
        for i in tl.static_range(8):
            probe = code + (128 >> i)
            code = tl.where(tl.load(qmap + 256 + probe - 1) < y, probe, code)
        _st(_list_ptr(ptrs, n_tensors, first, t, tl.uint8, ALIGNED) + offs, code.to(tl.uint8), mask, MASKED)
        row = start // QBLOCK + tl.arange(0, rows)  # the block starts on a multiple of QBLOCK
        absmax_ptr = _list_ptr(ptrs, n_tensors, first + 1, t, tl.float32, ALIGNED)
        _st(absmax_ptr + row, absmax_rows, row * QBLOCK < limit, MASKED)  # the rows holding an element


@triton.jit
def _adam_dial_kernel(
    grad_ptrs, ptrs, numels, first_blocks, n_tensors, inv_scale_ptr, flag_ptr, step_scalars,
    master_keys, m_keys, v_keys, m_map, v_map,
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FLAG: tl.constexpr, MAXIMIZE: tl.constexpr,
    KIND: tl.constexpr, WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, FMT: tl.constexpr,
    DECAY: tl.constexpr,  # 0: none, 1: L2 (Adam), 2: decoupled (AdamW)
    ALIGNED: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    t, start, limit = _span(numels, first_blocks, flag_ptr, HAS_FLAG, SEARCH, BLOCK)
    if start + BLOCK <= limit:
        _adam_dial_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, master_keys, m_keys, v_keys, m_map, v_map, beta1,
            one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, t, start, limit, GRAD_T,
            HAS_SCALE, MAXIMIZE, KIND, WEIGHT_T, WEIGHT_IS_BF16, FMT, DECAY, False, ALIGNED, BLOCK, QBLOCK,
        )  # fmt: skip
    else:
        _adam_dial_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, master_keys, m_keys, v_keys, m_map, v_map, beta1,
            one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, t, start, limit, GRAD_T,
            HAS_SCALE, MAXIMIZE, KIND, WEIGHT_T, WEIGHT_IS_BF16, FMT, DECAY, True, ALIGNED, BLOCK, QBLOCK,
        )  # fmt: skip


@triton.jit
def _adam_dial_block(
    grad_ptrs, ptrs, n_tensors, inv_scale_ptr, step_scalars, master_keys, m_keys, v_keys, m_map, v_map,
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, t, start, limit,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, KIND: tl.constexpr,
    WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, FMT: tl.constexpr, DECAY: tl.constexpr,
    MASKED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    # Lists: the master's two, exp_avg's two (values, absmax), exp_avg_sq's two; the grads in a table of their own.
    offs = start + tl.arange(0, BLOCK)
    mask = offs < limit
    g = _load_grad(grad_ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE, MASKED, ALIGNED)
    p = _load_master(ptrs, n_tensors, 0, t, offs, mask, KIND, MASKED, ALIGNED)
    if DECAY == 1:
        g = g + p * weight_decay
    if DECAY == 2:
        p = p * decay_factor
    m = _load_moment(ptrs, n_tensors, 2, t, offs, mask, m_map, FMT, MASKED, ALIGNED, QBLOCK)
    m = m * beta1 + g * one_minus_beta1
    v = _load_moment(ptrs, n_tensors, 4, t, offs, mask, v_map, FMT, MASKED, ALIGNED, QBLOCK)
    v = v * beta2 + (g * g) * one_minus_beta2
    _store_moment(
        m, ptrs, n_tensors, 2, t, start, limit, offs, mask, m_keys, m_map, FMT, MASKED, ALIGNED, BLOCK, QBLOCK
    )
    _store_moment(
        v, ptrs, n_tensors, 4, t, start, limit, offs, mask, v_keys, v_map, FMT, MASKED, ALIGNED, BLOCK, QBLOCK
    )
    step_size = tl.load(step_scalars + 2 * t)
    bias_correction2_sqrt = tl.load(step_scalars + 2 * t + 1)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.math.div_rn(step_size * m, denom)
    _store_master(p, ptrs, n_tensors, 0, t, offs, mask, master_keys, KIND, WEIGHT_T, WEIGHT_IS_BF16, MASKED, ALIGNED)


@triton.jit
def _sgd_dial_kernel(
    grad_ptrs, ptrs, numels, first_blocks, n_tensors, inv_scale_ptr, flag_ptr,
    master_keys, buf_keys, buf_map, lr, momentum, one_minus_dampening, weight_decay,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FLAG: tl.constexpr, MAXIMIZE: tl.constexpr,
    KIND: tl.constexpr, WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, FMT: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
    ALIGNED: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    t, start, limit = _span(numels, first_blocks, flag_ptr, HAS_FLAG, SEARCH, BLOCK)
    if start + BLOCK <= limit:
        _sgd_dial_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, master_keys, buf_keys, buf_map, lr, momentum,
            one_minus_dampening, weight_decay, t, start, limit, GRAD_T, HAS_SCALE, MAXIMIZE, KIND, WEIGHT_T,
            WEIGHT_IS_BF16, FMT, HAS_DECAY, HAS_MOMENTUM, FIRST_STEP, NESTEROV, False, ALIGNED, BLOCK, QBLOCK,
        )  # fmt: skip
    else:
        _sgd_dial_block(
            grad_ptrs, ptrs, n_tensors, inv_scale_ptr, master_keys, buf_keys, buf_map, lr, momentum,
            one_minus_dampening, weight_decay, t, start, limit, GRAD_T, HAS_SCALE, MAXIMIZE, KIND, WEIGHT_T,
            WEIGHT_IS_BF16, FMT, HAS_DECAY, HAS_MOMENTUM, FIRST_STEP, NESTEROV, True, ALIGNED, BLOCK, QBLOCK,
        )  # fmt: skip


@triton.jit
def _sgd_dial_block(
    grad_ptrs, ptrs, n_tensors, inv_scale_ptr, master_keys, buf_keys, buf_map, lr, momentum, one_minus_dampening,
    weight_decay, t, start, limit,
    GRAD_T: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, KIND: tl.constexpr,
    WEIGHT_T: tl.constexpr, WEIGHT_IS_BF16: tl.constexpr, FMT: tl.constexpr, HAS_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr, MASKED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    # Lists: the master's two, the momentum buffer's two (values, absmax); the grads in a table of their own.
    offs = start + tl.arange(0, BLOCK)
    mask = offs < limit
    g = _load_grad(grad_ptrs, t, offs, mask, inv_scale_ptr, GRAD_T, HAS_SCALE, MAXIMIZE, MASKED, ALIGNED)
    p = _load_master(ptrs, n_tensors, 0, t, offs, mask, KIND, MASKED, ALIGNED)
    if HAS_DECAY:
        g = g + p * weight_decay
    if HAS_MOMENTUM:
        if FIRST_STEP:
            buf = g
        else:
            old = _load_moment(ptrs, n_tensors, 2, t, offs, mask, buf_map, FMT, MASKED, ALIGNED, QBLOCK)
            buf = old * momentum + g * one_minus_dampening
        _store_moment(
            buf, ptrs, n_tensors, 2, t, start, limit, offs, mask, buf_keys, buf_map, FMT, MASKED, ALIGNED, BLOCK,
            QBLOCK,
        )  # fmt: skip
        if NESTEROV:  # noqa: SIM108
            g = g + buf * momentum
        else:
            g = buf
    p = p - g * lr  # as triton_kernels._sgd_update: bitwise torch's p + (-lr)*g
    _store_master(p, ptrs, n_tensors, 0, t, offs, mask, master_keys, KIND, WEIGHT_T, WEIGHT_IS_BF16, MASKED, ALIGNED)


# -- launching ------------------------------------------------------------------------------------------------
def _master_lists(masters: Masters, grads: TensorList) -> tuple[list[TensorList], torch.Tensor, dict[str, Any]]:
    """The master's two lists (a list a kernel does not read repeats the first), its keys and constants."""
    kind = _KINDS[masters.kind]
    weight_dtype = torch.bfloat16
    if masters.kind == "fp32":
        first = masters.masters
        second = masters.weights or first
        if masters.weights:
            kind, weight_dtype = 1, masters.weights[0].dtype
    else:
        first = masters.weights
        second = masters.remainders or first
    keys = grads[0] if masters.keys is None else masters.keys  # unread without stochastic rounding
    constants = {"KIND": kind, "WEIGHT_T": _TL_DTYPES[weight_dtype], "WEIGHT_IS_BF16": weight_dtype == torch.bfloat16}
    return [first, second], keys, constants


def _master_reads(masters: Masters) -> tuple[ListDtype, ListDtype]:
    """What the kernels read :func:`_master_lists`' two lists as (None: a repeated list, or the half weights whose
    dtype is the WEIGHT_T constant)."""
    weight = ListRead("bf16 weight", torch.bfloat16)
    if masters.kind == "fp32":
        return ListRead("master", torch.float32), None
    if masters.kind == "remainder":
        return weight, ListRead("remainder", torch.int16)
    if masters.kind == "remainder8":
        return weight, ListRead("remainder", torch.int8)
    return weight, None  # stochastic: the weights alone


def _moment_reads(moments: Moments, name: str) -> tuple[ListDtype, ListDtype]:
    """What the kernels read :func:`_moment_lists`' two lists as (None: a stand-in, unread)."""
    if not moments.values:
        return None, None
    if moments.format == "8bit":
        return ListRead(f"{name} code", torch.uint8), ListRead(f"{name} absmax", torch.float32, QBLOCK)
    return ListRead(name, torch.float32 if moments.format == "fp32" else torch.bfloat16), None


def _moment_lists(
    moments: Moments, grads: TensorList, stand_in: TensorList
) -> tuple[list[TensorList], torch.Tensor, torch.Tensor]:
    """A moment's two lists, its keys and its map (unread ones are stand-ins: lists ``stand_in``, tensors the first
    grad)."""
    values = moments.values or stand_in  # SGD without momentum: no buffers
    keys = grads[0] if moments.keys is None else moments.keys
    table = grads[0] if moments.qmap is None else _map_table(moments.qmap)
    return [values, moments.absmax or stand_in], keys, table


# The map and its decision points in one tensor, per QuantMap (callers keep one per device and sign): built once,
# not once per launch. The map is held with its table so that its id cannot be reused while cached.
_map_tables: dict[int, tuple[QuantMap, torch.Tensor]] = {}


def forget_tables() -> None:
    """Empty the 8-bit map cache (``kernel_step.forget_tables``; the launch tables are ``triton_kernels``')."""
    _map_tables.clear()


def _map_table(qmap: QuantMap) -> torch.Tensor:
    cached = _map_tables.get(id(qmap))
    if cached is None:
        cached = _map_tables[id(qmap)] = (qmap, torch.cat([qmap.values, qmap.mids]))
    return cached[1]


def _format(*moments: Moments) -> int:
    formats = {m.format for m in moments if m.values}
    if len(formats) > 1:
        raise ValueError(f"one launch stores its moments in one format, got {sorted(formats)}")
    return _FORMATS[formats.pop() if formats else "fp32"]


def _common(
    grads: TensorList, inv_scale: torch.Tensor | None, found_inf: torch.Tensor | None, maximize: bool
) -> dict[str, Any]:
    return {
        "GRAD_T": _TL_DTYPES[grads[0].dtype],
        "HAS_SCALE": inv_scale is not None,
        "HAS_FLAG": found_inf is not None,
        "MAXIMIZE": maximize,
        "BLOCK": _BLOCK,
        "QBLOCK": QBLOCK,
    }


def adam_dial_(
    grads: TensorList,
    masters: Masters,
    exp_avgs: Moments,
    exp_avg_sqs: Moments,
    step_scalars: torch.Tensor,
    settings: AdamSettings,
    *,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """See ``ampinit._masters.reference.adam_dial_`` (same arguments, same bits)."""
    if not grads:
        return
    s = settings
    fmt = _format(exp_avgs, exp_avg_sqs)
    master_lists, master_keys, constants = _master_lists(masters, grads)
    m_lists, m_keys, m_map = _moment_lists(exp_avgs, grads, master_lists[0])
    v_lists, v_keys, v_map = _moment_lists(exp_avg_sqs, grads, master_lists[0])
    # Each list checked against what the kernel reads it as when its tables are built (an optimizer state of
    # another format or size put in opt.state by hand: read and written past its end otherwise).
    reads = (*_master_reads(masters), *_moment_reads(exp_avgs, "exp_avg"), *_moment_reads(exp_avg_sqs, "exp_avg_sq"))
    tables, grad_table, aligned = _launch_tables(grads, *master_lists, *m_lists, *v_lists, dtypes=reads)
    unread = grads[0]
    triton_launch.launch(
        _adam_dial_kernel,
        tables.n_blocks,
        (
            grad_table, tables.pointers, tables.numels, tables.first_blocks, len(grads),
            unread if inv_scale is None else inv_scale, unread if found_inf is None else found_inf,
            step_scalars.contiguous(), master_keys, m_keys, v_keys, m_map, v_map,
            s.beta1, 1 - s.beta1, s.beta2, 1 - s.beta2, s.eps, s.weight_decay, 1 - s.lr * s.weight_decay,
        ),
        {
            "FMT": fmt, "DECAY": 0 if s.weight_decay == 0 else (2 if s.decoupled else 1), "ALIGNED": aligned,
            "SEARCH": tables.search, **constants, **_common(grads, inv_scale, found_inf, s.maximize),
        },
        _OPTIONS,
        grads[0].device,
    )  # fmt: skip


def sgd_dial_(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: Moments,
    settings: SgdSettings,
    *,
    first_step: bool,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """See ``ampinit._masters.reference.sgd_dial_`` (same arguments, same bits)."""
    if not grads:
        return
    s = settings
    master_lists, master_keys, constants = _master_lists(masters, grads)
    buf_lists, buf_keys, buf_map = _moment_lists(momentum_buffers, grads, master_lists[0])
    reads = (*_master_reads(masters), *_moment_reads(momentum_buffers, "momentum_buffer"))
    tables, grad_table, aligned = _launch_tables(grads, *master_lists, *buf_lists, dtypes=reads)
    unread = grads[0]
    flags = {"HAS_DECAY": s.weight_decay != 0, "HAS_MOMENTUM": s.momentum != 0, "NESTEROV": s.nesterov}
    triton_launch.launch(
        _sgd_dial_kernel,
        tables.n_blocks,
        (
            grad_table, tables.pointers, tables.numels, tables.first_blocks, len(grads),
            unread if inv_scale is None else inv_scale, unread if found_inf is None else found_inf,
            master_keys, buf_keys, buf_map, s.lr, s.momentum, 1 - s.dampening, s.weight_decay,
        ),
        {
            "FMT": _format(momentum_buffers), "FIRST_STEP": first_step, "ALIGNED": aligned, "SEARCH": tables.search,
            **flags, **constants, **_common(grads, inv_scale, found_inf, s.maximize),
        },
        _OPTIONS,
        grads[0].device,
    )  # fmt: skip
