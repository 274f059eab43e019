"""``ampinit doctor``: what this machine offers for mixed precision, measured, and which opt level to use.

Everything reported is read from this torch build or measured in this process: the torch version, the devices,
the CPU flags that decide bf16/fp16 speed, the autocast dtypes each device accepts, how fast a small training
step (an MLP: forward, loss, backward, AdamW step; repeated, the dtypes interleaved, the median kept) runs under
fp32, bf16 autocast and fp16 autocast, an fp16 probe of the operations that can be slow where matmuls are not
(a matmul and a convolution forward + backward, each against fp32), whether torch's fused optimizer kernels run
here, and a recommendation that follows from those figures.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ampinit._version import __version__
from ampinit.demo.machine import busy_reasons, cpu_flags, cpu_model, load_average, relative_spread

#: fp16 work at least this many times slower than fp32 counts as emulated (no fp16 arithmetic units).
SLOW_FP16 = 2.0
#: A compute dtype must make the training step at least this many times faster than fp32 to be recommended.
MIN_SPEEDUP = 1.15
#: Timed rounds of the training step at least, whatever the budget.
MIN_ROUNDS = 5
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DeviceReport:
    device: str
    name: str
    autocast_dtypes: list[str]
    #: Median ms of one training step per compute dtype ("float32": no autocast).
    step_ms: dict[str, float]
    #: Interquartile range / median of those step times.
    step_spread: dict[str, float]
    speedup_vs_fp32: dict[str, float]
    #: fp16 time / fp32 time per probed operation ("matmul", "conv fwd+bwd"); empty where not probed.
    fp16_probe: dict[str, float]
    fused_optimizers: dict[str, bool]


@dataclass
class Report:
    ampinit: str
    torch: str
    python: str
    cpu_capability: str
    threads: int
    cpu_flags: dict[str, bool] = field(default_factory=dict)
    load_average: float | None = None
    devices: list[DeviceReport] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    recommendation: str = ""
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def _device_name(device: str) -> str:
    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    if device == "cpu":
        return cpu_model() or platform.processor() or platform.machine()
    return device


def _autocast_dtypes(device: str) -> list[str]:
    accepted = []
    for dtype in (torch.float16, torch.bfloat16):
        try:
            with torch.autocast(device, dtype=dtype):
                probe = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
            if probe.dtype == dtype:
                accepted.append(str(dtype).replace("torch.", ""))
        except (RuntimeError, AssertionError):
            continue
    return accepted


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step_functions(device: str, dtypes: list[str]) -> dict[str, Callable[[], None]]:
    """One training step of a small MLP per compute dtype, each on its own copy of the same model: forward and
    loss under autocast (none for fp32), backward, AdamW step: what O0, O4 (bf16) and O1 (fp16) compute."""
    from ampinit.demo.tasks import make_mlp

    batch, features = (128, 256) if device == "cpu" else (1024, 2048)
    work = make_mlp(0, batch_size=batch, features=features, depth=2)
    inputs, target = work.inputs.to(device), work.target.to(device)
    steps: dict[str, Callable[[], None]] = {}
    for name in dtypes:
        model = copy.deepcopy(work.model).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(
            model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer, name: str = name
        ) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=_DTYPES[name], enabled=name != "float32"):
                loss = work.loss_fn(model(inputs), target)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()

        steps[name] = step
    return steps


def _training_step_ms(device: str, dtypes: list[str], budget_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per step and the spread of the step times, per compute dtype, timed in interleaved rounds (the
    order rotated each round) for ``budget_s`` seconds and at least ``MIN_ROUNDS`` rounds. A dtype whose steps
    have used half the budget (fp16 where it is emulated) stops being timed after ``MIN_ROUNDS`` rounds."""
    steps = _step_functions(device, dtypes)
    for step in steps.values():  # warm-up: first-call allocations, kernel selection
        step()
        step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < MIN_ROUNDS or time.perf_counter() < deadline:
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            if len(samples[name]) >= MIN_ROUNDS and sum(samples[name]) > budget_s / 2:
                continue
            _sync(device)
            start = time.perf_counter()
            steps[name]()
            _sync(device)
            samples[name].append(time.perf_counter() - start)
        rounds += 1
    medians = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    return medians, {name: relative_spread(v) for name, v in samples.items()}


def _fastest(run: Callable[[], object], tries: int) -> float:
    run()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def fp16_probe(device: str) -> dict[str, float]:
    """fp16 time over fp32 time for a 256 x 256 matmul and for a 3x3 convolution's forward + backward, on one
    thread, the fastest of a few tries (so that other processes slow neither side). On a CPU without fp16
    arithmetic the two can differ widely (matmuls converted to fp32 internally, convolutions emulated), which is
    why both are probed. Empty on CUDA, where fp16 has tensor cores."""
    if device != "cpu":
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratios = {}
        a = torch.randn(256, 256)
        times = {}
        for dtype in (torch.float32, torch.float16):
            operand = a.to(dtype)

            def matmul(operand: torch.Tensor = operand) -> None:
                operand @ operand

            times[dtype] = _fastest(matmul, 5)
        ratios["matmul"] = times[torch.float16] / times[torch.float32]
        conv = torch.nn.Conv2d(16, 16, 3, padding=1)
        image = torch.randn(4, 16, 16, 16)
        for dtype in (torch.float32, torch.float16):
            layer, x = copy.deepcopy(conv).to(dtype), image.to(dtype).requires_grad_()

            def forward_backward(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> None:
                layer(x).sum().backward()

            times[dtype] = _fastest(forward_backward, 3)
        ratios["conv fwd+bwd"] = times[torch.float16] / times[torch.float32]
    finally:
        torch.set_num_threads(threads)
    return ratios


def _fused_optimizers(device: str) -> dict[str, bool]:
    works = {}
    for name, make in (
        ("AdamW", lambda p: torch.optim.AdamW(p, fused=True)),
        ("SGD", lambda p: torch.optim.SGD(p, lr=0.1, fused=True)),
    ):
        try:
            param = torch.zeros(4, device=device, requires_grad=True)
            param.grad = torch.ones_like(param)
            make([param]).step()
            works[name] = True
        except (RuntimeError, TypeError, ValueError):
            works[name] = False
    return works


def _recommend(devices: list[DeviceReport]) -> tuple[str, str]:
    best = devices[-1]  # an accelerator when there is one
    bf16 = best.speedup_vs_fp32.get("bfloat16", 0.0)
    fp16 = best.speedup_vs_fp32.get("float16", 0.0)
    slow = {op: ratio for op, ratio in best.fp16_probe.items() if ratio >= SLOW_FP16}
    fp16_note = ""
    if slow:
        ops = ", ".join(f"{op} {ratio:.1f}x" for op, ratio in slow.items())
        fp16_note = (
            f" fp16 is emulated here for some operations (fp16 time / fp32 time: {ops}): avoid O1-O3, above all "
            "for convolutional models."
        )
    step = f"a small MLP training step on {best.device}"
    if bf16 >= MIN_SPEEDUP and "bfloat16" in best.autocast_dtypes:
        return "O5", (
            f"{step} ran {bf16:.2f}x as fast with bf16 autocast as in fp32 here, and bf16 keeps fp32's exponent "
            "range (no loss scaling needed). O5 trains a bf16 model with fp32 master weights; choose O4 to keep "
            "fp32 weights with a bf16 cast policy instead." + fp16_note
        )
    if fp16 >= MIN_SPEEDUP and "float16" in best.autocast_dtypes and not slow:
        return "O1", (
            f"{step} ran {fp16:.2f}x as fast with fp16 autocast as in fp32 here, and bf16 gave {bf16:.2f}x. "
            "O1 (fp16 cast policy, dynamic loss scaling) is the safe start; O2 is faster still."
        )
    return "O0", (
        f"{step} was not clearly faster than fp32 with bf16 ({bf16:.2f}x) or fp16 ({fp16:.2f}x) autocast here "
        f"(at least {MIN_SPEEDUP:.2f}x needed), so mixed precision would cost accuracy for little speed: use O0 "
        "on this machine." + fp16_note
    )


def diagnose(budget_s: float = 2.0) -> Report:
    """Measure and describe this machine; ``budget_s`` bounds the training-step benchmark per device."""
    report = Report(
        ampinit=__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
        threads=torch.get_num_threads(),
        cpu_flags=cpu_flags(),
        load_average=load_average(),
    )
    devices = _devices()
    for device in devices:
        dtypes = ["float32", *(d for d in ("bfloat16", "float16") if d in _autocast_dtypes(device))]
        medians, spreads = _training_step_ms(device, dtypes, budget_s / len(devices))
        report.devices.append(
            DeviceReport(
                device=device,
                name=_device_name(device),
                autocast_dtypes=_autocast_dtypes(device),
                step_ms=medians,
                step_spread=spreads,
                speedup_vs_fp32={d: medians["float32"] / t for d, t in medians.items() if d != "float32"},
                fp16_probe=fp16_probe(device),
                fused_optimizers=_fused_optimizers(device),
            )
        )
    cpu_spreads = {f"step {d}": s for d, s in report.devices[0].step_spread.items()}
    report.busy = busy_reasons(report.load_average, load_average(), os.cpu_count() or 1, report.threads, cpu_spreads)
    report.recommendation, report.reason = _recommend(report.devices)
    return report


def format_report(report: Report) -> str:
    lines = [
        f"ampinit {report.ampinit} | torch {report.torch} | python {report.python}",
        f"CPU capability: {report.cpu_capability}, {report.threads} threads",
    ]
    if report.cpu_flags:
        flags = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in report.cpu_flags.items())
        lines.append(f"CPU flags      : {flags}")
    lines.append("")
    for dev in report.devices:
        lines.append(f"[{dev.device}] {dev.name}")
        lines.append(f"  autocast dtypes : {', '.join(dev.autocast_dtypes) or 'none'}")
        timings = ", ".join(f"{d} {ms:.2f} ms (spread {dev.step_spread[d]:.0%})" for d, ms in dev.step_ms.items())
        lines.append(f"  training step   : {timings}  [small MLP, median of interleaved repeats]")
        speedups = ", ".join(f"{d} {s:.2f}x" for d, s in dev.speedup_vs_fp32.items())
        lines.append(f"  speed vs fp32   : {speedups or 'no autocast dtype'}")
        if dev.fp16_probe:
            probe = ", ".join(f"{op} {ratio:.2f}x" for op, ratio in dev.fp16_probe.items())
            lines.append(f"  fp16 time / fp32: {probe}  [one thread; above {SLOW_FP16:.0f}x: emulated fp16]")
        fused = ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in dev.fused_optimizers.items())
        lines.append(f"  fused optimizers: {fused}")
    if report.busy:
        lines += ["", "!! THIS MACHINE IS BUSY: the timings above are not trustworthy; rerun when it is idle."]
        lines += [f"!!   - {reason}" for reason in report.busy]
    lines += ["", f"Recommended opt level: {report.recommendation}", f"  why: {report.reason}"]
    return "\n".join(lines)
