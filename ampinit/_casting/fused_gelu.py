"""Apex's fp32 ``gelu`` of a half tensor in one pass each way, where it gives torch's bits.

With Apex's lists, ``gelu`` is an fp32 op: a bf16/fp16 input is cast to fp32, ``gelu`` runs in fp32, and the fp32
output goes on. On an H100 that cost O4 4 ms of a 45 ms GPT-2-small step and 574 MiB (docs/cast-policy.md), and no
combination of torch's kernels removes it exactly: CUDA's elementwise kernels compute in their *output's* dtype.
``ampinit._casting.triton_gelu`` fuses the cast into the op (forward: half in, fp32 out) and the cast's backward into
``gelu_backward`` (fp32 grad and the saved half input in, half grad out), and saves the half input rather than an
fp32 copy, as native autocast's bf16 ``gelu`` does.

It is used only where it is exact. For each (device, half dtype) it is tried once on every value of the dtype (65,536
inputs: all of them) against torch's own ``gelu`` and ``gelu_backward`` in fp32 on that device: the forward's fp32
output, the backward's fp32 slope (its result for an upstream grad of 1, left unrounded) and its half result for
random upstream grads. The first of the kernels' ways of writing the arithmetic (``triton_gelu.*_VARIANTS``) that
matches bit for bit (NaN payloads aside) is kept, and if none does, that device and dtype keep the unfused path.
Each output element is a function of its own input value, and backward of one IEEE product of the slope with its
upstream grad, then one rounding: so agreement on every input value is agreement everywhere.

The check runs when an O1/O4 session with Apex's ``gelu`` entry takes its CUDA kernels (``initialize``/``init``), for
the current device and the session's half dtype; a ``gelu`` on another device or of the other dtype runs it at its
first call, except under CUDA graph capture or ``torch.cuda.set_sync_debug_mode`` (the check reads its verdict on the
host), where that call takes the unfused path. ``status()`` says what was decided.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ampinit._types import HALF_DTYPES

logger = logging.getLogger("ampinit")

#: Test switch: the fused path also for CPU tensors, through Triton's interpreter (TRITON_INTERPRET=1 when
#: ``triton_gelu`` is imported). The interpreter's math functions are not CUDA's, so there it is exact only
#: where a test makes the check's reference the interpreter's.
ON_CPU = False


class Choice(NamedTuple):
    """The kernels' variants that reproduced torch's bits: ``(VARIANT, enable_fp_fusion)`` each way."""

    forward: tuple[int, bool]
    backward: tuple[int, bool]


_lock = threading.Lock()
# (device, dtype) -> the variants to use, or None: the unfused path (no kernels, or none matched).
_choices: dict[tuple[torch.device, torch.dtype], Choice | None] = {}
_UNDECIDED = object()


def status() -> dict[str, str]:
    """What each checked (device, dtype) decided: ``"fused (forward variant ..., backward variant ...)"`` or
    ``"unfused"``; for ``benchmarks/gpu_train_step.py`` and the GPU check's report."""
    with _lock:
        return {
            f"{device} {str(dtype).removeprefix('torch.')}": (
                "unfused" if choice is None else f"fused (forward {choice.forward}, backward {choice.backward})"
            )
            for (device, dtype), choice in _choices.items()
        }


def forget() -> None:
    """Drop every decision (tests; a later call checks again)."""
    with _lock:
        _choices.clear()


def runs_on_type(device_type: str) -> bool:
    """Whether the fused gelu may run on ``device_type`` (CUDA; the CPU only in tests)."""
    return device_type == "cuda" or (ON_CPU and device_type == "cpu")


def _runs_on(device: torch.device) -> bool:
    return runs_on_type(device.type)


def _kernels() -> ModuleType | None:
    try:
        from ampinit._casting import triton_gelu
    except ImportError:  # no triton (torch's CPU wheels): nothing to fuse with
        return None
    return triton_gelu


def _host_reads_allowed(device: torch.device) -> bool:
    """Whether the check may read its verdict on the host now (not while a graph is captured or syncs are
    reported as errors or warnings)."""
    if device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0


def prepare(device_type: str, dtype: torch.dtype) -> None:
    """Decide for the current device of ``device_type`` and the half ``dtype`` a session casts to, now (when the
    session takes the device's kernels; the other half dtype, if a gelu ever gets one, at its first call)."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    if dtype in HALF_DTYPES and _runs_on(device) and _host_reads_allowed(device):
        _choice(device, dtype)


def decide(device: torch.device, dtype: torch.dtype) -> Choice | None:
    """The variants to use on ``device`` for ``dtype``, checked now if not yet (None: the unfused path); for
    ``ampinit doctor``."""
    if dtype not in HALF_DTYPES or not _runs_on(device) or not _host_reads_allowed(device):
        return None
    return _choice(device, dtype)


def _choice(device: torch.device, dtype: torch.dtype) -> Choice | None:
    with _lock:
        if (device, dtype) in _choices:
            return _choices[(device, dtype)]
        choice = _check(device, dtype)
        _choices[(device, dtype)] = choice
        return choice


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, any NaN equal to any NaN (CUDA and CPU round a NaN to half with different payloads)."""
    unsigned = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return bool(((a.view(unsigned) == b.view(unsigned)) | (a.isnan() & b.isnan())).all())


def every_value(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each of the 65,536 bit patterns of a 16-bit float ``dtype``, once."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


class Reference(NamedTuple):
    """What the check compares the kernels with: the unfused path's fp32 ops (tests give others)."""

    forward: Any  # (x fp32) -> gelu(x)
    backward: Any  # (dy fp32, x fp32) -> gelu_backward(dy, x)


TORCH = Reference(torch.ops.aten.gelu.default, torch.ops.aten.gelu_backward.default)


def _check(device: torch.device, dtype: torch.dtype, reference: Reference = TORCH) -> Choice | None:
    kernels = _kernels()
    if kernels is None:
        return None
    try:
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            x = every_value(dtype, device)
            wide = x.float()
            expected_y = reference.forward(wide)
            forward = next((v for v in kernels.FORWARD_VARIANTS if _same_bits(kernels.forward(x, v), expected_y)), None)
            # Backward: the slope (the fp32 result for an upstream grad of 1), so that one IEEE product with any
            # upstream grad, then one rounding, gives the same bits; and the half result itself for random grads.
            ones = torch.ones_like(wide)
            expected_slope = reference.backward(ones, wide)
            generator = torch.Generator().manual_seed(0)
            upstream = torch.randn(x.shape, generator=generator).to(device)
            expected_dx = reference.backward(upstream, wide).to(dtype)
            backward = next(
                (
                    v
                    for v in kernels.BACKWARD_VARIANTS
                    if _same_bits(kernels.backward(ones, x, v, torch.float32), expected_slope)
                    and _same_bits(kernels.backward(upstream, x, v), expected_dx)
                ),
                None,
            )
    except Exception as error:  # a compile or launch failure: this device keeps the unfused path
        logger.warning("ampinit: the fused fp32 gelu failed on %s (%s); Apex's unfused gelu is used", device, error)
        return None
    if forward is None or backward is None:
        logger.info(
            "ampinit: the fused fp32 gelu does not reproduce torch's %s bits on %s for %s; Apex's unfused gelu is used",
            "forward" if forward is None else "backward",
            device,
            dtype,
        )
        return None
    logger.debug("ampinit: fused fp32 gelu on %s for %s (forward %s, backward %s)", device, dtype, forward, backward)
    return Choice(forward, backward)


def gelu(x: Any, approximate: str) -> torch.Tensor | None:
    """``gelu(x.float(), approximate=approximate)`` by the fused kernels, with its autograd; None where they do not
    apply (not a plain contiguous half tensor on a checked device, ``approximate="tanh"``, functorch transforms)
    or did not match torch's bits: then the caller runs Apex's unfused path."""
    # A subclass (FakeTensor, FunctionalTensor, DTensor...) is not ``torch.Tensor`` itself.
    if type(x) is not torch.Tensor or x.dtype not in HALF_DTYPES or approximate != "none":
        return None
    device = x.device
    if not _runs_on(device) or not x.is_contiguous() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return None
    choice = _choices.get((device, x.dtype), _UNDECIDED)
    if choice is _UNDECIDED:
        if not _host_reads_allowed(device):
            return None
        choice = _choice(device, x.dtype)
    if choice is None:
        return None
    assert isinstance(choice, Choice)
    result: torch.Tensor = _apply_fused(x, choice)
    return result


def _unfused_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = torch.ops.aten.gelu_backward.default(dy.float(), x.float())
    return result


class _FusedGelu(torch.autograd.Function):
    """fp32 ``gelu`` of a half ``x``: the cast and the op forward, ``gelu_backward`` and the cast's backward
    backward, saving ``x`` itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, choice: Choice) -> torch.Tensor:
        kernels = _kernels()
        assert kernels is not None
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.choice = choice
        y: torch.Tensor = kernels.forward(x, choice.forward)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the unfused path's ops, which autograd can differentiate again (the same values).
            return _unfused_backward(dy, x).to(x.dtype), None
        kernels = _kernels()
        assert kernels is not None
        return kernels.backward(dy.float().contiguous(), x, ctx.choice.backward), None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor, _: None) -> torch.Tensor:
        # Forward-mode AD, as the unfused path's: the cast's tangent is the tangent widened, gelu's is its backward.
        (x,) = ctx.saved_tensors
        return _unfused_backward(x_t, x)


# torch 2.14 types ``Function.apply``, 2.13 does not: taken as a plain callable, the call type-checks under both.
_apply_fused: Callable[..., Any] = _FusedGelu.apply
