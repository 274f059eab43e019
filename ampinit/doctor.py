"""``ampinit doctor``: what this machine offers for mixed precision, measured, and which opt level to use.

Everything reported is read from this torch build or measured in this process: the torch version, the devices,
the CPU flags that decide bf16/fp16 speed, the autocast dtypes each device accepts, an fp16 probe of the
operations that can be slow where matmuls are not (a matmul and a convolution forward + backward, each against
fp32), whether torch's fused optimizer kernels run here, and how fast the opt levels train the demo's small MLP.

That last figure is the demo's own measurement (:func:`ampinit.demo.interleaved.train_interleaved`: the levels
interleaved in blocks, per-step times, the median after the warm-up steps, the interquartile spread), and the
recommendation is the demo's verdict (:func:`ampinit.demo.verdict.choose_level`) on it, so that the doctor and
``ampinit demo`` cannot disagree by method: on a loaded machine the recommendation is tentative, and where the
noise check rejects a figure it would rest on, there is none.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ampinit._version import __version__
from ampinit.demo.interleaved import train_interleaved, warm_up
from ampinit.demo.machine import NOISY_SPREAD, busy_reasons, cpu_flags, cpu_model, load_average, load_reasons
from ampinit.demo.progress import Clock
from ampinit.demo.results import RunResult, _fill_speedups
from ampinit.demo.verdict import LevelOutcome, Verdict, choose_level
from ampinit.demo.workloads import _make_task

#: fp16 work at least this many times slower than fp32 counts as emulated (no fp16 arithmetic units).
SLOW_FP16 = 2.0
#: The demo task the levels are timed on (its ``--quick`` size), in blocks of ``BLOCK`` steps per level.
TASK = "mlp"
BLOCK = 5
#: Steps per level at least, whatever the budget (four blocks: enough for a median and a spread), and at most.
MIN_STEPS = 4 * BLOCK
MAX_STEPS = 1000


@dataclass
class DeviceReport:
    device: str
    name: str
    autocast_dtypes: list[str]
    #: Steps every level trained (the same for all).
    steps: int
    #: Median ms of one training step of the demo's quick MLP per opt level.
    step_ms: dict[str, float]
    #: Interquartile range / median of those step times.
    step_spread: dict[str, float]
    speedup_vs_o0: dict[str, float]
    #: Training loss at the last common step, and test accuracy, per level (what "trains like fp32" reads).
    loss: dict[str, float]
    accuracy: dict[str, float]
    #: fp16 time / fp32 time per probed operation ("matmul", "conv fwd+bwd"); empty where not probed.
    fp16_probe: dict[str, float]
    fused_optimizers: dict[str, bool]
    #: Apex's fp32 gelu (O1/O4 with Apex's lists) per half dtype: "fused" where its one-pass kernels give torch's
    #: bits on this device, else "unfused"; empty where they never run (the CPU).
    fused_gelu: dict[str, str] = field(default_factory=dict)


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
    #: The level to use, or ``None`` where the measurement cannot support one (``reason`` says why).
    recommendation: str | None = None
    reason: str = ""
    #: Measured on a loaded machine: rerun when it is idle before relying on it.
    tentative: bool = False

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


def _levels(dtypes: list[str], fp16_emulated: bool) -> list[str]:
    """O0 and the levels this device can run fast enough to be worth timing: the bf16 ones where autocast takes
    bf16, the fp16 ones where it takes fp16 and fp16 is not emulated (an emulated fp16 step would spend the
    budget, and the probe already rules those levels out)."""
    levels = ["O0"]
    if "bfloat16" in dtypes:
        levels += ["O4", "O5"]
    if "float16" in dtypes and not fp16_emulated:
        levels += ["O1", "O2"]
    return levels


def measure_levels(device: str, levels: list[str], budget_s: float, clock: Clock) -> list[RunResult]:
    """Train the demo's ``--quick`` MLP at each level, timed exactly as the demo times it, for ``budget_s``
    seconds (and ``MIN_STEPS`` steps at least)."""
    where = torch.device(device)
    task = _make_task(TASK, True, where)
    warm_up(task, 0, where)
    runs = train_interleaved(
        task,
        levels,
        steps=MAX_STEPS,
        block=BLOCK,
        seconds=budget_s,
        seed=0,
        device=where,
        clock=clock,
        min_steps=MIN_STEPS,
    )
    try:
        results = [run.finish(MAX_STEPS) for run in runs]
    finally:
        for run in runs:
            run.shutdown()
    _fill_speedups(results)
    return results


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


def _fused_gelu(device: str) -> dict[str, str]:
    from ampinit._casting import fused_gelu

    where = torch.device(device)
    if not fused_gelu.runs_on_type(where.type):
        return {}
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    return {
        str(dtype).removeprefix("torch."): "unfused" if fused_gelu.decide(where, dtype) is None else "fused"
        for dtype in (torch.bfloat16, torch.float16)
    }


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


def _fp16_note(probe: dict[str, float]) -> str:
    slow = {op: ratio for op, ratio in probe.items() if ratio >= SLOW_FP16}
    if not slow:
        return ""
    ops = ", ".join(f"{op} {ratio:.1f}x" for op, ratio in slow.items())
    return (
        f" fp16 is emulated here for some operations (fp16 time / fp32 time: {ops}): avoid O1-O3, above all for "
        "convolutional models."
    )


def recommend(device: DeviceReport, loaded: bool) -> Verdict:
    """The demo's verdict on the doctor's measurement of ``device``: tentative when ``loaded``, none when the noise
    check rejected a figure it would rest on."""
    outcomes = [
        LevelOutcome(TASK, level, device.loss[level], device.accuracy[level], device.speedup_vs_o0.get(level))
        for level in device.step_ms
    ]
    noisy = {(TASK, level) for level, spread in device.step_spread.items() if spread > NOISY_SPREAD}
    verdict = choose_level(outcomes, busy=loaded, noisy=noisy)
    return Verdict(verdict.level, verdict.reason + _fp16_note(device.fp16_probe), verdict.tentative)


def diagnose(
    budget_s: float = 2.0, clock: Clock = time.perf_counter, load: Callable[[], float | None] = load_average
) -> Report:
    """Measure and describe this machine; ``budget_s`` bounds the training-step benchmark per device. ``clock``
    times the steps and ``load`` reads the load average (both replaceable, for tests)."""
    report = Report(
        ampinit=__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
        threads=torch.get_num_threads(),
        cpu_flags=cpu_flags(),
        load_average=load(),
    )
    devices = _devices()
    for device in devices:
        dtypes = _autocast_dtypes(device)
        probe = fp16_probe(device)
        emulated = any(ratio >= SLOW_FP16 for ratio in probe.values())
        results = measure_levels(device, _levels(dtypes, emulated), budget_s / len(devices), clock)
        steps = min(result.steps for result in results)
        report.devices.append(
            DeviceReport(
                device=device,
                name=_device_name(device),
                autocast_dtypes=dtypes,
                steps=steps,
                step_ms={r.level: r.ms_per_step for r in results},
                step_spread={r.level: r.step_time_spread for r in results},
                speedup_vs_o0={r.level: r.speedup_vs_o0 for r in results if r.speedup_vs_o0 is not None},
                loss={r.level: r.losses[steps - 1] for r in results},
                accuracy={r.level: r.accuracy for r in results},
                fp16_probe=probe,
                fused_optimizers=_fused_optimizers(device),
                fused_gelu=_fused_gelu(device),
            )
        )
    spreads = {f"{dev.device} {level}": spread for dev in report.devices for level, spread in dev.step_spread.items()}
    load_after = load()
    cpus = os.cpu_count() or 1
    report.busy = busy_reasons(report.load_average, load_after, cpus, report.threads, spreads)
    loaded = bool(load_reasons(report.load_average, load_after, cpus, report.threads))
    verdict = recommend(report.devices[-1], loaded)  # an accelerator when there is one
    report.recommendation, report.reason, report.tentative = verdict.level, verdict.reason, verdict.tentative
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
        timings = ", ".join(
            f"{level} {ms:.2f} ms (spread {dev.step_spread[level]:.0%})" for level, ms in dev.step_ms.items()
        )
        lines.append(f"  training step   : {timings}")
        lines.append(
            f"                    [the demo's quick MLP, {dev.steps} steps per level, levels interleaved in blocks of "
            f"{BLOCK}, median ms/step after the warm-up: as `ampinit demo` measures]"
        )
        speedups = ", ".join(f"{level} {s:.2f}x" for level, s in dev.speedup_vs_o0.items() if level != "O0")
        lines.append(f"  speed vs O0     : {speedups or 'no mixed-precision level runs here'}")
        if dev.fp16_probe:
            probe = ", ".join(f"{op} {ratio:.2f}x" for op, ratio in dev.fp16_probe.items())
            lines.append(f"  fp16 time / fp32: {probe}  [one thread; above {SLOW_FP16:.0f}x: emulated fp16]")
        fused = ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in dev.fused_optimizers.items())
        lines.append(f"  fused optimizers: {fused}")
        if dev.fused_gelu:
            gelu = ", ".join(f"{dtype} {decision}" for dtype, decision in dev.fused_gelu.items())
            lines.append(f"  Apex's fp32 gelu: {gelu}  [O1/O4 with Apex's lists; fused only where bit for bit torch's]")
    if report.busy:
        lines += ["", "!! THIS MACHINE IS BUSY: the timings above are not trustworthy; rerun when it is idle."]
        lines += [f"!!   - {reason}" for reason in report.busy]
    if report.recommendation is None:
        head = "Recommended opt level: none"
    else:
        head = f"Recommended opt level: {report.recommendation}"
        if report.tentative:
            head += " (TENTATIVE: measured on a busy machine, rerun when it is idle)"
    lines += ["", head, f"  why: {report.reason}"]
    return "\n".join(lines)
