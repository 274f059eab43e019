"""Triton kernels for Apex's fp32 ``gelu`` on a half input: the cast, the op and the cast's backward in one pass.

With Apex's lists (``cast_policy="apex"``: what ``ampinit run`` and the ``apex.amp`` aliases give legacy code) a
``gelu`` on a bf16/fp16 tensor runs as ``gelu(x.float())``: a cast pass, an fp32 pass, and in the backward an fp32
``gelu_backward`` over the fp32 copy it saved and a pass rounding the input's grad back to half. These kernels read
the half input directly and write what those passes end with: the fp32 output, and the half input grad rounded once
from the fp32 one. Per element that is 6 bytes moved forward and 10 backward where the unfused path moves 14 and 22
(plus the 4 B/element of the saved fp32 copy, which becomes the 2 of the half input native autocast saves too).

The arithmetic is torch's CUDA kernel's (``GeluCUDAKernelImpl`` / ``GeluBackwardCUDAKernelImpl``, the exact-erf
form), in the same order, with libdevice's ``erff`` and ``expf`` (the CUDA math library's, which nvcc's ``::erf``
and ``expf`` come from), keeping subnormals as torch's build does: every launch passes ``enable_reflect_ftz=False``,
where Triton's default would have libdevice take its flush-to-zero branches. Where the compiler may fuse a multiply
into an add, the result depends on which pair it fuses; the ``VARIANT`` constant picks one way of writing the sum,
and ``ampinit._casting.fused_gelu`` takes a variant only after it has reproduced torch's bits on every value of the
half dtype on that device (65,536 inputs: all there are).

Whether one does depends on the two builds of ``erff``. On the H200 check of 2026-11-27 (torch 2.11.0+cu130, Triton
3.6) none did, with or without flushing: the forward differed from torch's by one ulp at 71 bf16 and 576 fp16
values, every one with ``x`` in about [-1.7, -1.4] (``erff`` near -1.1), and the backward at the same inputs. So
there, Apex's unfused gelu runs (docs/cast-policy.md has its cost).

Imported only when ``triton`` is importable. On Triton's interpreter (CPU tests) the libdevice calls, which it cannot
run, are ``tl.math``'s, so the interpreted kernels compute the same formula with other math functions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ampinit._masters import triton_launch
from ampinit._masters.triton_kernels import _ld, _round_to_bf16, _st

try:
    from triton.language.extra import libdevice
except ImportError:  # Triton before 3.0 kept the CUDA functions here only
    from triton.language.extra.cuda import libdevice

BLOCK = 1024

# torch's constants, as its C++ computes them: <cmath>'s literals (parsed to the same doubles), their products in
# double, rounded to fp32 where the kernel uses them (Triton rounds a Python float constant to nearest).
_M_SQRT1_2 = 0.70710678118654752440
_M_2_SQRTPI = 1.12837916709551257390
_ALPHA = _M_SQRT1_2  # kAlpha
_BETA = _M_2_SQRTPI * _M_SQRT1_2 * 0.5  # kBeta of the backward

#: The ways of writing the backward's ``cdf + x * pdf`` the check tries, as (VARIANT, enable_fp_fusion): the
#: expression as torch writes it with the compiler free to fuse (what nvcc does by default), the same with every
#: operation rounded, and each of the two fused multiply-adds the compiler could have chosen.
BACKWARD_VARIANTS: tuple[tuple[int, bool], ...] = ((0, True), (0, False), (1, False), (2, False))
#: The forward has one sum, ``1 + erf(...)``; only whether the compiler may fuse into it can differ.
FORWARD_VARIANTS: tuple[tuple[int, bool], ...] = ((0, True), (0, False))


@triton.jit
def _erf(v, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.erf(v)
    else:
        return tl.math.erf(v)


@triton.jit
def _exp(v, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _widen(x, IS_BF16: tl.constexpr):
    # bf16 -> fp32 is the bits shifted up (exact, subnormals included, which Triton 3.9's interpreter flushes).
    if IS_BF16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _forward_block(
    x_ptr, y_ptr, offs, mask, ALPHA, IS_BF16: tl.constexpr, LIBDEVICE: tl.constexpr, MASKED: tl.constexpr
):
    x = _widen(_ld(x_ptr + offs, mask, MASKED), IS_BF16)
    _st(y_ptr + offs, x * 0.5 * (1.0 + _erf(x * ALPHA, LIBDEVICE)), mask, MASKED)


@triton.jit
def _forward_kernel(
    x_ptr,
    y_ptr,
    n,
    ALPHA: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: a tensor may hold more than 2**31 elements
    offs = start + tl.arange(0, BLOCK)
    # A whole block without a mask, so that its accesses are vectors (Triton's launcher tells the compiler which
    # pointers start on 16 bytes); the last, partial one masked.
    if start + BLOCK <= n:
        _forward_block(x_ptr, y_ptr, offs, offs < n, ALPHA, IS_BF16, LIBDEVICE, False)
    else:
        _forward_block(x_ptr, y_ptr, offs, offs < n, ALPHA, IS_BF16, LIBDEVICE, True)


@triton.jit
def _backward_block(
    dy_ptr,
    x_ptr,
    dx_ptr,
    offs,
    mask,
    ALPHA,
    BETA,
    IS_BF16: tl.constexpr,
    VARIANT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    MASKED: tl.constexpr,
):
    dy = _ld(dy_ptr + offs, mask, MASKED)
    x = _widen(_ld(x_ptr + offs, mask, MASKED), IS_BF16)
    one_plus_erf = 1.0 + _erf(x * ALPHA, LIBDEVICE)
    pdf = _exp(-0.5 * x * x, LIBDEVICE) * BETA
    if VARIANT == 1:  # fma(x, pdf, cdf)
        slope = tl.fma(x, pdf, 0.5 * one_plus_erf)
    elif VARIANT == 2:  # fma(0.5, 1 + erf, x * pdf)
        slope = tl.fma(tl.full(x.shape, 0.5, tl.float32), one_plus_erf, x * pdf)
    else:  # cdf + x * pdf, as torch writes it
        slope = 0.5 * one_plus_erf + x * pdf
    dx = dy * slope
    if dx_ptr.dtype.element_ty == tl.bfloat16:
        _st(dx_ptr + offs, _round_to_bf16(dx), mask, MASKED)
    else:  # fp16 rounded to nearest even; fp32 (the check's view of the slope) as computed
        _st(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _backward_kernel(
    dy_ptr,
    x_ptr,
    dx_ptr,
    n,
    ALPHA: tl.constexpr,
    BETA: tl.constexpr,
    IS_BF16: tl.constexpr,
    VARIANT: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: a tensor may hold more than 2**31 elements
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _backward_block(dy_ptr, x_ptr, dx_ptr, offs, offs < n, ALPHA, BETA, IS_BF16, VARIANT, LIBDEVICE, False)
    else:
        _backward_block(dy_ptr, x_ptr, dx_ptr, offs, offs < n, ALPHA, BETA, IS_BF16, VARIANT, LIBDEVICE, True)


def _libdevice(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _options(fused: bool) -> dict[str, bool]:
    """Triton's launch options of a variant (``fused``: whether multiply-adds may fuse); subnormals kept always."""
    return {"enable_fp_fusion": fused, "enable_reflect_ftz": False}


def forward(x: torch.Tensor, variant: tuple[int, bool]) -> torch.Tensor:
    """``gelu(x.float())`` of a contiguous half ``x``, as fp32 (``variant``: one of ``FORWARD_VARIANTS``)."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        constants = {"ALPHA": _ALPHA, "IS_BF16": x.dtype == torch.bfloat16, "BLOCK": BLOCK, "LIBDEVICE": _libdevice(x)}
        triton_launch.launch(
            _forward_kernel, triton.cdiv(n, BLOCK), (x, y, n), constants, _options(variant[1]), x.device
        )
    return y


def backward(
    dy: torch.Tensor, x: torch.Tensor, variant: tuple[int, bool], out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``gelu_backward(dy, x.float()).to(x.dtype)`` of a contiguous fp32 ``dy`` and half ``x`` (``out_dtype``
    float32: not rounded, the same arithmetic; for the check, which compares the slope ``dy = 1`` gives)."""
    dx = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    n = x.numel()
    if n:
        constants = {
            "ALPHA": _ALPHA,
            "BETA": _BETA,
            "IS_BF16": x.dtype == torch.bfloat16,
            "VARIANT": variant[0],
            "BLOCK": BLOCK,
            "LIBDEVICE": _libdevice(x),
        }
        triton_launch.launch(
            _backward_kernel, triton.cdiv(n, BLOCK), (dy, x, dx, n), constants, _options(variant[1]), x.device
        )
    return dx
