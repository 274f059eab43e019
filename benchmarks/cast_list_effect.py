"""Which of Apex's extra cast-list entries change results on this device: the candidates to leave out of the default.

``cast_policy="apex"`` registers, on each device's autocast key, a kernel for every aten overload of Apex's lists
(and of PyTorch's CUDA lists) that the device's native autocast lacks (``ampinit._casting.lists.plan``): about a
hundred on the CPU, a few dozen on CUDA. Each costs a Python call per use. This measures, entry by entry, with
native autocast plus that one entry registered (``KERNELS.restricted_to``):

1. **op level**: hand-written probes (the Python calls a model makes: ``F.gelu``, ``x.std(-1)``, ``nn.LSTM``...,
   on realistic inputs: half activations, fp32 weights) run under native autocast and with the entry; an entry is
   measured by the probes that reach it (its kernel is called). Both outputs are rounded the way the probe's
   consumer rounds them (``half``: to the autocast dtype, as a following matmul does; ``fp32``: kept, as a loss
   or an fp32 op keeps them) and compared bitwise, with the largest difference in units in the last place of
   that dtype. An entry that no probe reaches is "not reached" (no verdict);
2. **model level**: a few O1/O4 training steps of the decoder of ``benchmarks/gpu_train_step.py`` and of the MLP
   of ``benchmarks/models.py`` (plain SGD) with Apex's full lists, with native autocast's, and with native plus
   each entry that (1) reached: the loss after the last step and its relative difference to native;
3. **cost**: per reached entry, its first probe's time per call with the entry against native autocast,
   interleaved round by round, medians.

The entries reached and changing nothing are the candidates to leave out of the default list on this device.
The default lists are decided on CUDA (``scripts/gpu_check.sh`` runs this); CPU figures only show the method.

    python -m benchmarks.cast_list_effect --device cpu --dtype bf16 --out benchmarks/results
    python -m benchmarks.cast_list_effect --tiny --device cpu --dtype bf16 --out /tmp/x     # seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

import ampinit
from ampinit._casting import kernels
from ampinit._casting.lists import Policy, plan
from ampinit._casting.policy import CastPolicy
from ampinit._types import OptLevel
from benchmarks.gpu_train_step import TINY, GPTShape, lm_loss, make_workload
from benchmarks.models import make_mlp

log = logging.getLogger("cast_list_effect")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Consumer = Literal["half", "fp32"]
Inputs = Callable[[torch.device, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Probe:
    """A Python call a model makes, and how its consumer rounds the output (see the module docstring)."""

    name: str
    call: Callable[[torch.device, torch.dtype], Any]
    consumer: Consumer


# While a probe runs for its gradients, the tensors ``_rand`` makes: each a leaf that requires grad (None: plain).
_made: list[torch.Tensor] | None = None


def _rand(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    if _made is not None:
        _made.append(tensor.requires_grad_())
    return tensor


@contextmanager
def _making_leaves() -> Iterator[list[torch.Tensor]]:
    """The tensors the probe makes inside, as leaves that require grad."""
    global _made
    made: list[torch.Tensor] = []
    _made = made
    try:
        yield made
    finally:
        _made = None


def _probes() -> list[Probe]:
    # Activations arrive in the autocast dtype (a matmul made them), weights are fp32 parameters; inputs of the
    # lower-precision ops come from fp32 ops (native CPU autocast runs them in fp32). Shapes are small: what is
    # measured is rounding, which does not depend on size beyond a reduction's length (64-256 here).
    def h(*shape: int, seed: int = 0) -> Callable[[torch.device, torch.dtype], torch.Tensor]:
        return lambda d, t: _rand(*shape, device=d, dtype=t, seed=seed)

    act = h(8, 64)
    img = h(2, 4, 8, 8)

    def positive(d: torch.device, t: torch.dtype) -> torch.Tensor:
        return act(d, t).abs() + 0.1

    def unit(d: torch.device, t: torch.dtype) -> torch.Tensor:
        return torch.tanh(act(d, t)) * 0.9

    def unary(fn: Callable[[torch.Tensor], torch.Tensor], arg: Inputs) -> Callable[[torch.device, torch.dtype], Any]:
        return lambda d, t: fn(arg(d, t))

    def f(*shape: int, seed: int = 1) -> Callable[[torch.device], torch.Tensor]:
        return lambda d: _rand(*shape, device=d, seed=seed)

    layers: dict[tuple[str, str], nn.Module] = {}  # built once per device: a probe times the call, not the build

    def layer(key: str, d: torch.device, build: Callable[[], nn.Module]) -> nn.Module:
        if (key, str(d)) not in layers:
            torch.manual_seed(0)
            layers[key, str(d)] = build().to(d)
        return layers[key, str(d)]

    def rnn(kind: Callable[..., nn.Module], **options: Any) -> Callable[[torch.device, torch.dtype], Any]:
        def call(d: torch.device, t: torch.dtype) -> Any:
            module = layer(f"{kind}{options}", d, lambda: kind(16, 16, batch_first=True, **options))
            return module(f(2, 5, 16)(d))[0]

        return call

    def cell(kind: Callable[..., nn.Module]) -> Callable[[torch.device, torch.dtype], Any]:
        def call(d: torch.device, t: torch.dtype) -> Any:
            out = layer(str(kind), d, lambda: kind(16, 16))(f(4, 16)(d))
            return out[0] if isinstance(out, tuple) else out

        return call

    def ln(d: torch.device, t: torch.dtype) -> torch.Tensor:
        return F.layer_norm(act(d, t), (64,), f(64)(d) + 1, f(64, seed=2)(d))

    def conv(name: str) -> Callable[[torch.device, torch.dtype], torch.Tensor]:
        conv_op = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[name]
        dims = {"conv1d": 1, "conv2d": 2, "conv3d": 3}[name]
        return lambda d, t: conv_op(f(2, 4, *[6] * dims)(d), f(4, 4, *[3] * dims)(d), padding="same")

    def upsample(mode: str, dims: int, **options: Any) -> Callable[[torch.device, torch.dtype], torch.Tensor]:
        return lambda d, t: F.interpolate(h(2, 3, *[5] * dims)(d, t), scale_factor=2, mode=mode, **options)

    def chain_matmul(d: torch.device, t: torch.dtype) -> torch.Tensor:
        with warnings.catch_warnings():  # deprecated in favour of linalg.multi_dot, but still Apex-listed code
            warnings.simplefilter("ignore", UserWarning)
            return torch.chain_matmul(f(8, 16)(d), f(16, 8, seed=2)(d))  # type: ignore[no-untyped-call,no-any-return]

    def target(d: torch.device) -> torch.Tensor:
        return torch.arange(8, device=d) % 64

    probes = [
        Probe("F.gelu", lambda d, t: F.gelu(act(d, t)), "half"),
        Probe("F.gelu tanh", lambda d, t: F.gelu(act(d, t), approximate="tanh"), "half"),
        Probe("F.layer_norm", ln, "half"),
        Probe("F.group_norm", lambda d, t: F.group_norm(img(d, t), 2, f(4)(d) + 1, f(4, seed=2)(d)), "half"),
        Probe("F.softmax", lambda d, t: F.softmax(act(d, t) * 4, -1), "half"),
        Probe("F.log_softmax", lambda d, t: F.log_softmax(act(d, t) * 4, -1), "fp32"),
        Probe("F.softplus", lambda d, t: F.softplus(act(d, t)), "half"),
        Probe("F.cross_entropy", lambda d, t: F.cross_entropy(act(d, t) * 4, target(d)), "fp32"),
        Probe("F.nll_loss", lambda d, t: F.nll_loss(act(d, t), target(d)), "fp32"),
        Probe(
            "F.binary_cross_entropy",
            lambda d, t: F.binary_cross_entropy(torch.sigmoid(act(d, t)), torch.rand(8, 64, device=d)),
            "fp32",
        ),
        Probe("F.cosine_similarity", lambda d, t: F.cosine_similarity(act(d, t), h(8, 64, seed=3)(d, t)), "half"),
        Probe("F.pdist", lambda d, t: F.pdist(act(d, t)), "fp32"),
        Probe("torch.cdist", lambda d, t: torch.cdist(act(d, t), h(8, 64, seed=3)(d, t)), "fp32"),
        Probe("torch.dist", lambda d, t: torch.dist(act(d, t), h(8, 64, seed=3)(d, t)), "fp32"),
        Probe("torch.logsumexp", lambda d, t: torch.logsumexp(act(d, t), -1), "fp32"),
        Probe("x.sum()", lambda d, t: act(d, t).sum(), "fp32"),
        Probe("x.sum(-1)", lambda d, t: act(d, t).sum(-1), "fp32"),
        Probe("x.mean(-1)", lambda d, t: act(d, t).mean(-1), "fp32"),
        Probe("x.cumsum(-1)", lambda d, t: act(d, t).cumsum(-1), "half"),
        Probe("x.cumprod(-1)", lambda d, t: (1 + act(d, t) / 64).cumprod(-1), "half"),
        Probe("x.std()", lambda d, t: act(d, t).std(), "fp32"),
        Probe("x.std(-1)", lambda d, t: act(d, t).std(-1), "fp32"),
        Probe("x.var(-1, correction=0)", lambda d, t: act(d, t).var(-1, correction=0), "fp32"),
        Probe("x.var()", lambda d, t: act(d, t).var(), "fp32"),
        Probe("x.norm()", lambda d, t: act(d, t).norm(), "fp32"),
        Probe("x.norm(dim=-1)", lambda d, t: act(d, t).norm(dim=-1), "fp32"),
        Probe("torch.linalg.norm", lambda d, t: torch.linalg.norm(act(d, t)), "fp32"),
        Probe("torch.linalg.vector_norm", lambda d, t: torch.linalg.vector_norm(act(d, t), dim=-1), "fp32"),
        Probe("torch.linalg.matrix_norm", lambda d, t: torch.linalg.matrix_norm(h(4, 16, 16)(d, t)), "fp32"),
        Probe("torch.renorm", lambda d, t: torch.renorm(act(d, t), 2, 0, 1.0), "half"),
        Probe("x ** 2", lambda d, t: act(d, t) ** 2, "half"),
        Probe("torch.pow(x, y)", lambda d, t: torch.pow(positive(d, t), h(8, 64, seed=3)(d, t)), "half"),
        Probe("2 ** x", lambda d, t: 2 ** act(d, t), "half"),
        *(
            Probe(f"torch.{name}", unary(getattr(torch, name), arg), "half")
            for name, arg in (
                ("exp", act),
                ("expm1", act),
                ("log", positive),
                ("log2", positive),
                ("log10", positive),
                ("log1p", positive),
                ("reciprocal", positive),
                ("rsqrt", positive),
                ("sinh", act),
                ("cosh", act),
                ("tan", unit),
                ("acos", unit),
                ("asin", unit),
                ("erfinv", unit),
            )
        ),
        Probe("torch.mv", lambda d, t: torch.mv(f(16, 64)(d), f(64, seed=2)(d)), "half"),
        Probe("torch.addmv", lambda d, t: torch.addmv(f(16)(d), f(16, 64)(d), f(64, seed=2)(d)), "half"),
        Probe("torch.addr", lambda d, t: torch.addr(f(16, 16)(d), f(16, seed=2)(d), f(16, seed=3)(d)), "half"),
        Probe("torch.einsum", lambda d, t: torch.einsum("ij,jk->ik", f(16, 64)(d), f(64, 16, seed=2)(d)), "half"),
        Probe(
            "torch.linalg.multi_dot",
            lambda d, t: torch.linalg.multi_dot([f(8, 16)(d), f(16, 16, seed=2)(d), f(16, 8, seed=3)(d)]),
            "half",
        ),
        Probe("torch.chain_matmul", chain_matmul, "half"),
        Probe("F.conv1d same", conv("conv1d"), "half"),
        Probe("F.conv2d same", conv("conv2d"), "half"),
        Probe("F.conv3d same", conv("conv3d"), "half"),
        Probe("F.prelu", lambda d, t: F.prelu(act(d, t), f(1)(d)), "half"),
        Probe("nn.LSTM", rnn(nn.LSTM), "half"),
        Probe("nn.GRU", rnn(nn.GRU), "half"),
        Probe("nn.RNN tanh", rnn(nn.RNN), "half"),
        Probe("nn.RNN relu", rnn(nn.RNN, nonlinearity="relu"), "half"),
        Probe("nn.LSTMCell", cell(nn.LSTMCell), "half"),
        Probe("nn.GRUCell", cell(nn.GRUCell), "half"),
        Probe("nn.RNNCell", cell(nn.RNNCell), "half"),
        Probe("F.bilinear", lambda d, t: F.bilinear(h(4, 8)(d, t), f(4, 8)(d), f(3, 8, 8)(d)), "half"),
        Probe("torch.dot", lambda d, t: torch.dot(h(64)(d, t), f(64)(d)), "fp32"),
        Probe("torch.vdot", lambda d, t: torch.vdot(h(64)(d, t), f(64)(d)), "fp32"),
        Probe("torch.cross", lambda d, t: torch.cross(h(4, 3)(d, t), f(4, 3)(d), dim=-1), "half"),
        Probe("torch.linalg.cross", lambda d, t: torch.linalg.cross(h(4, 3)(d, t), f(4, 3)(d)), "half"),
        Probe("torch.tensordot", lambda d, t: torch.tensordot(h(4, 8)(d, t), f(8, 4)(d), dims=1), "half"),
        Probe(
            "torch.index_put",
            lambda d, t: torch.index_put(
                f(8, 64)(d), (torch.tensor([1, 3], device=d),), h(2, 64)(d, t), accumulate=True
            ),
            "half",
        ),
        Probe(
            "torch.scatter_add",
            lambda d, t: torch.scatter_add(
                f(8, 64)(d), 0, torch.zeros(2, 64, dtype=torch.long, device=d), h(2, 64)(d, t)
            ),
            "half",
        ),
        Probe("F.interpolate nearest 1d", upsample("nearest", 1), "half"),
        Probe("F.interpolate nearest 2d", upsample("nearest", 2), "half"),
        Probe("F.interpolate nearest 3d", upsample("nearest", 3), "half"),
        Probe("F.interpolate nearest-exact 2d", upsample("nearest-exact", 2), "half"),
        Probe("F.interpolate linear", upsample("linear", 1), "half"),
        Probe("F.interpolate bilinear", upsample("bilinear", 2), "half"),
        Probe("F.interpolate bilinear aa", upsample("bilinear", 2, antialias=True), "half"),
        Probe("F.interpolate bicubic", upsample("bicubic", 2), "half"),
        Probe("F.interpolate bicubic aa", upsample("bicubic", 2, antialias=True), "half"),
        Probe("F.interpolate trilinear", upsample("trilinear", 3), "half"),
        Probe("F.ctc_loss", _ctc_loss, "fp32"),
    ]
    return probes


def _ctc_loss(d: torch.device, t: torch.dtype) -> torch.Tensor:
    log_probs = F.log_softmax(_rand(12, 2, 6, device=d), -1).to(t)
    targets = torch.tensor([[1, 2, 3], [2, 3, 4]], device=d)
    lengths = torch.tensor([12, 12], device=d)
    return F.ctc_loss(log_probs, targets, lengths, torch.tensor([3, 3], device=d))


# -- comparing outputs ---------------------------------------------------------------------------------------------
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """The float's bits as an integer that orders like the value (sign-magnitude to two's complement)."""
    bits = x.view(_INT_VIEW[x.dtype]).to(torch.int64)
    lowest = -(1 << (8 * x.element_size() - 1))
    return torch.where(bits < 0, lowest - bits, bits)


def ulp_difference(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> int:
    """Largest distance between ``a`` and ``b`` rounded to ``dtype``, in representable steps (0: bitwise equal).

    Positions where both are NaN count as equal; a NaN against a number counts as the dtype's whole range.
    """
    a, b = a.detach().to(dtype).flatten().cpu(), b.detach().to(dtype).flatten().cpu()
    both_nan = a.isnan() & b.isnan()
    one_nan = a.isnan() ^ b.isnan()
    steps = (_ordered(a) - _ordered(b)).abs().masked_fill(both_nan, 0)
    if bool(one_nan.any()):
        return 1 << (8 * a.element_size())
    return int(steps.max()) if steps.numel() else 0


def _floating(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _floating(item)]
    return []


def compare(native: Any, entry: Any, consumer: Consumer, dtype: torch.dtype) -> dict[str, Any]:
    """Both outputs rounded as ``consumer`` rounds them: bitwise equal, largest ulp and relative difference."""
    rounding = dtype if consumer == "half" else torch.float32
    pairs = list(zip(_floating(native), _floating(entry), strict=True))
    ulps = max((ulp_difference(a, b, rounding) for a, b in pairs), default=0)
    rel = max(
        (float(((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30))) for a, b in pairs),
        default=0.0,
    )
    return {"equal": ulps == 0, "max_ulp": ulps, "rel": rel, "rounding": str(rounding).removeprefix("torch.")}


def compare_grads(native: list[torch.Tensor | None], entry: list[torch.Tensor | None]) -> dict[str, Any]:
    """The gradients of the same tensors with and without the entry, each in its own dtype (a half activation's
    is half, an fp32 weight's fp32): bitwise equal, and the largest ulp difference (None: a tensor got a gradient
    on one side only)."""
    ulps: int | None = 0
    for a, b in zip(native, entry, strict=True):
        if a is None or b is None:
            if a is not b:
                ulps = None
            continue
        if ulps is not None:
            ulps = max(ulps, ulp_difference(a, b, a.dtype))
    return {"grad_equal": ulps == 0, "grad_max_ulp": ulps}


# -- native + one entry ----------------------------------------------------------------------------------------------
@contextmanager
def counted_kernels() -> Iterator[dict[str, int]]:
    """Count the calls of every extra kernel registered inside (overload name -> calls): whether a probe reached it."""
    calls: dict[str, int] = {}
    make = kernels.make_kernel

    def counting(op: torch._ops.OpOverload, policy: Policy, device_type: str) -> Callable[..., Any]:
        kernel = make(op, policy, device_type)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[str(op)] = calls.get(str(op), 0) + 1
            return kernel(*args, **kwargs)

        return wrapper

    with mock.patch.object(kernels, "make_kernel", counting):
        yield calls


@contextmanager
def cast_policy(
    device: torch.device, dtype: torch.dtype, entries: Sequence[torch._ops.OpOverload] | None
) -> Iterator[None]:
    """Native autocast (``entries`` empty), native plus ``entries``, or Apex's full lists (``entries`` None)."""
    if entries is not None and not entries:
        policy = CastPolicy([device.type], dtype, policy="native")
        policy.activate()
        try:
            yield
        finally:
            policy.deactivate()
        return
    restriction = kernels.KERNELS.restricted_to(entries) if entries is not None else _nothing()
    with restriction:
        policy = CastPolicy([device.type], dtype, policy="apex")
        policy.activate()
    try:
        yield
    finally:
        policy.deactivate()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _run(probe: Probe, device: torch.device, dtype: torch.dtype) -> tuple[Any, str | None]:
    try:
        with torch.no_grad():
            return probe.call(device, dtype), None
    except Exception as error:  # an error is a result too: native autocast refuses mixed dtypes Apex promoted
        return None, _error(error)


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _run_with_grads(
    probe: Probe, device: torch.device, dtype: torch.dtype
) -> tuple[Any, list[torch.Tensor | None] | None, str | None]:
    """The probe's output, and the gradients of the tensors it made after a backward from a fixed upstream
    gradient (None where no output takes one); or the error of either pass."""
    try:
        with _making_leaves() as made:
            output = probe.call(device, dtype)
    except Exception as error:
        return None, None, _error(error)
    outputs = [o for o in _floating(output) if o.requires_grad]
    detached = _detached(output)
    if not outputs:
        return detached, None, None
    # What the consumer's backward hands over: a half consumer's gradient is a half value (a matmul's input grad).
    rounding = dtype if probe.consumer == "half" else torch.float32
    upstream = [
        _rand(*o.shape, device=device, seed=100 + i).to(rounding).to(o.dtype) for i, o in enumerate(outputs)
    ]  # fmt: skip
    try:
        torch.autograd.backward(outputs, upstream)
    except Exception as error:  # a backward the entry makes possible or impossible is a result too
        return detached, None, _error(error)
    return detached, [t.grad for t in made], None


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, (tuple, list)):
        return type(output)(_detached(item) for item in output)
    return output


@dataclass
class EntryResult:
    entry: str
    policy: str
    probes: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = "not reached"
    us_native: float | None = None
    us_entry: float | None = None
    models: dict[str, Any] = field(default_factory=dict)


def op_level(
    device: torch.device,
    dtype: torch.dtype,
    entries: dict[torch._ops.OpOverload, Policy],
    probes: list[Probe],
    after_each: Callable[[list[EntryResult]], None] | None = None,
) -> list[EntryResult]:
    """Each entry's verdict from the probes that reach it; ``after_each`` gets the results so far after every
    entry (a run cut by its time limit keeps the entries it finished)."""
    with cast_policy(device, dtype, []):
        native = {p.name: _run_with_grads(p, device, dtype) for p in probes}
    results = []
    for op, policy in entries.items():
        result = EntryResult(str(op), policy)
        with counted_kernels() as calls, cast_policy(device, dtype, [op]):
            for probe in probes:
                before = calls.get(str(op), 0)
                output, grads, error = _run_with_grads(probe, device, dtype)
                if calls.get(str(op), 0) == before:
                    continue
                native_output, native_grads, native_error = native[probe.name]
                row: dict[str, Any] = {"probe": probe.name, "consumer": probe.consumer}
                if error is not None or native_error is not None:
                    row.update(equal=error == native_error, native_error=native_error, error=error)
                else:
                    row.update(compare(native_output, output, probe.consumer, dtype))
                    if grads is not None and native_grads is not None:
                        row.update(compare_grads(native_grads, grads))
                    elif grads is not native_grads:
                        row.update(grad_equal=False, grad_max_ulp=None)
                result.probes.append(row)
        if result.probes:
            changed = any(not row["equal"] or not row.get("grad_equal", True) for row in result.probes)
            result.verdict = "changes" if changed else "no change"
        results.append(result)
        if after_each is not None:
            after_each(results)
    return results


def time_entries(
    device: torch.device,
    dtype: torch.dtype,
    results: list[EntryResult],
    probes: list[Probe],
    entries: dict[str, torch._ops.OpOverload],
    rounds: int,
    calls: int,
) -> None:
    """Per reached entry, its first probe's time per call, native against native + the entry, interleaved."""
    by_name = {p.name: p for p in probes}
    for result in results:
        if not result.probes:
            continue
        probe = by_name[result.probes[0]["probe"]]
        samples: dict[str, list[float]] = {"native": [], "entry": []}
        for r in range(rounds):
            for side in ("native", "entry") if r % 2 == 0 else ("entry", "native"):
                with cast_policy(device, dtype, [] if side == "native" else [entries[result.entry]]):
                    _run(probe, device, dtype)  # warm-up: first call's lazy initialisation
                    _sync(device)
                    start = time.perf_counter()
                    for _ in range(calls):
                        _run(probe, device, dtype)
                    _sync(device)
                    samples[side].append((time.perf_counter() - start) / calls * 1e6)
        result.us_native = round(statistics.median(samples["native"]), 1)
        result.us_entry = round(statistics.median(samples["entry"]), 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- model level -------------------------------------------------------------------------------------------------
Workload = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def workloads(device: torch.device, tiny: bool) -> dict[str, Callable[[], Workload]]:
    shape = TINY if tiny or device.type != "cuda" else GPTShape()
    batch = 2 if shape is TINY else 8

    def gpt() -> Workload:
        model, x, y = make_workload(device, shape, batch)
        return model, x, y, lm_loss

    def mlp() -> Workload:
        small = tiny or device.type != "cuda"
        model, x, y, _ = make_mlp(0, features=128 if small else 1024, batch_size=32 if small else 256)
        return model.to(device), x.to(device), y.to(device), F.cross_entropy

    name = f"decoder {shape.layers}x{shape.d_model}, seq {shape.seq}, batch {batch}"
    return {name: gpt, "MLP" + (" (features 128, batch 32)" if tiny or device.type != "cuda" else ""): mlp}


def train_loss(
    build: Callable[[], Workload], level: OptLevel, entries: Sequence[torch._ops.OpOverload] | None, steps: int
) -> float:
    """The loss after ``steps`` O1/O4 steps (SGD), with native (``[]``), native + ``entries`` or Apex's lists."""
    model, x, y, loss_fn = build()
    # Plain SGD: Adam's first steps move each weight by about +-lr whatever the gradient's size, which would hide a
    # gradient that an entry changes by less than its sign.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    restriction = kernels.KERNELS.restricted_to(entries) if entries else _nothing()
    with restriction:
        model, optimizer = ampinit.initialize(
            model,
            optimizer,
            opt_level=level,
            verbosity=0,
            cast_policy="native" if entries == [] else "apex",
        )
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            with ampinit.scale_loss(loss, optimizer) as scaled:
                scaled.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            return float(loss_fn(model(x), y))
    finally:
        ampinit.deinitialize()


def model_level(
    builds: dict[str, Callable[[], Workload]],
    level: OptLevel,
    results: list[EntryResult],
    entries: dict[str, torch._ops.OpOverload],
    steps: int,
) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for name, build in builds.items():
        native = train_loss(build, level, [], steps)
        apex = train_loss(build, level, None, steps)
        totals[name] = {"native": native, "apex": apex, "apex_rel": _rel(apex, native)}
        for result in results:
            # The candidates too: the op level compares forward outputs only, and a backward in fp32 can still
            # change the gradients of an entry whose forward rounds back to the same bits.
            if result.verdict != "not reached":
                loss = train_loss(build, level, [entries[result.entry]], steps)
                result.models[name] = {"loss": loss, "rel": _rel(loss, native)}
    return totals


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


# -- report --------------------------------------------------------------------------------------------------------
def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, torch {torch.__version__}"


def _grad_note(probe: dict[str, Any]) -> str:
    """A probe row's gradient comparison, as the table shows it: ``, grads 0`` (max ulp), ``, grads on one side``."""
    if "grad_max_ulp" not in probe:
        return ""
    ulps = probe["grad_max_ulp"]
    return ", grads on one side" if ulps is None else f", grads {ulps}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f'Cast-list entries of `cast_policy="apex"` beyond native autocast on **{report["device"]}**, '
        f"{report['dtype']} ({report['machine']}); {report['steps']} training steps at {report['level']}.",
        "",
    ]
    if report["device"] != "cuda":
        lines += ["CPU: the default is decided on CUDA, not here.", ""]
    if not report["complete"]:
        lines += ["Incomplete: the run stopped before its last phase (the empty columns were not measured).", ""]
    models = list(report["models"])
    lines += [
        "| entry | policy | verdict | probes reaching it (consumer rounding: max ulp; grads: max ulp) | "
        "us/call native | "
        "with entry | ratio | " + " | ".join(f"loss rel. diff., {m}" for m in models) + " |",
        "|---|---|---|---|---:|---:|---:|" + "---:|" * len(models),
    ]
    for row in report["entries"]:
        probes = "; ".join(
            f"{p['probe']} ({p.get('rounding', 'error')}: "
            + (
                str(p["max_ulp"]) + _grad_note(p)
                if "max_ulp" in p
                else f"native {p['native_error'] or 'ok'}, entry {p['error'] or 'ok'}"
            )
            + ")"
            for p in row["probes"]
        )
        ratio = f"{row['us_entry'] / row['us_native']:.2f}x" if row["us_native"] else ""
        losses = " | ".join(f"{row['models'][m]['rel']:.2e}" if m in row["models"] else "" for m in models)
        lines.append(
            f"| `{row['entry']}` | {row['policy']} | {row['verdict']} | {probes} | {row['us_native'] or ''} | "
            f"{row['us_entry'] or ''} | {ratio} | {losses} |"
        )
    lines += ["", "| model | loss native | loss Apex's lists | rel. diff. |", "|---|---:|---:|---:|"]
    lines += [
        f"| {m} | {v['native']:.6f} | {v['apex']:.6f} | {v['apex_rel']:.2e} |" for m, v in report["models"].items()
    ]
    lines += [
        "",
        f"Candidates to leave out of the default list on {report['device']} (reached, change nothing): "
        + (", ".join(f"`{e}`" for e in report["candidates"]) or "none"),
    ]
    lines += [f"Not reached by any probe (no verdict): {', '.join(f'`{e}`' for e in report['not_reached']) or 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="few steps and rounds: a smoke run, seconds")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model run (5; tiny 2)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per entry (6; tiny 2)")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed block (20; tiny 3)")
    parser.add_argument("--only", nargs="*", default=None, help="only the entries whose name contains one of these")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    level: OptLevel = "O4" if dtype == torch.bfloat16 else "O1"
    steps = args.steps or (2 if args.tiny else 5)
    planned = plan(kernels.AUTOCAST_KEYS[device.type])
    if args.only is not None:
        planned = {op: p for op, p in planned.items() if any(word in str(op) for word in args.only)}
    by_name = {str(op): op for op in planned}
    if device.type == "cuda" and not torch.cuda.is_available():
        log.error("cast_list_effect: --device cuda, but torch.cuda.is_available() is False")
        return 2
    probes = _probes()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cast_list_effect_{device.type}_{args.dtype}"
    report: dict[str, Any] = {
        "benchmark": "cast_list_effect",
        "device": device.type,
        "dtype": args.dtype,
        "level": level,
        "steps": steps,
        "machine": machine(device),
        "torch": torch.__version__,
        "complete": False,
        "models": {},
    }

    def save(results: list[EntryResult]) -> None:
        # Rewritten after each entry of the op level and after each phase: a run cut by its time limit keeps what
        # it measured (an entry the op level did not reach yet is absent).
        report["entries"] = [vars(r) for r in results]
        report["candidates"] = [r.entry for r in results if r.verdict == "no change"]
        report["not_reached"] = [r.entry for r in results if r.verdict == "not reached"]
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))

    log.info("%d entries beyond native autocast on %s; op level...", len(planned), device.type)
    results = op_level(device, dtype, planned, probes, after_each=save)
    log.info("model level...")
    report["models"] = model_level(workloads(device, args.tiny), level, results, by_name, steps)
    save(results)
    log.info("timing...")
    time_entries(
        device,
        dtype,
        results,
        probes,
        by_name,
        args.rounds or (2 if args.tiny else 6),
        args.calls or (3 if args.tiny else 20),
    )
    report["complete"] = True
    save(results)
    log.info("%s", markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
