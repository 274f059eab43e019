"""``ampinit doctor``: what this machine offers for mixed precision, measured, and which opt level to use.

Everything reported is read from this torch build or measured in this process: the torch version, the devices,
the autocast dtypes each device accepts, whether bf16/fp16 matmuls are actually faster than fp32 here (a short
micro-benchmark, about a second), whether torch's fused optimizer kernels run here, and a recommendation.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ampinit._version import __version__


@dataclass
class DeviceReport:
    device: str
    name: str
    autocast_dtypes: list[str]
    matmul_ms: dict[str, float]
    speedup_vs_fp32: dict[str, float]
    fused_optimizers: dict[str, bool]


@dataclass
class Report:
    ampinit: str
    torch: str
    python: str
    cpu_capability: str
    threads: int
    devices: list[DeviceReport] = field(default_factory=list)
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
        return platform.processor() or platform.machine()
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


def _matmul_ms(device: str, budget_s: float) -> dict[str, float]:
    """Median time of one square matmul per dtype, interleaved, within ``budget_s`` seconds overall."""
    size = 512 if device == "cpu" else 4096
    operands = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            a = torch.randn(size, size, device=device).to(dtype)
            (a @ a).sum()
            operands[dtype] = a
        except RuntimeError:
            continue
    samples: dict[torch.dtype, list[float]] = {dtype: [] for dtype in operands}
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or min(len(v) for v in samples.values()) < 1:
        for dtype, a in operands.items():
            if samples[dtype] and sum(samples[dtype]) > budget_s / 2:
                continue  # a dtype with no fast kernel here (fp16 on most CPUs): one sample says enough
            _sync(device)
            start = time.perf_counter()
            a @ a
            _sync(device)
            samples[dtype].append(time.perf_counter() - start)
    return {str(d).replace("torch.", ""): statistics.median(v) * 1e3 for d, v in samples.items()}


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
    if bf16 >= 1.3 and "bfloat16" in best.autocast_dtypes:
        return "O5", (
            f"bf16 matmuls run {bf16:.1f}x faster than fp32 on {best.device} here, and bf16 keeps fp32's exponent "
            "range (no loss scaling needed). O5 trains a bf16 model with fp32 master weights; choose O4 to keep "
            "fp32 weights with a bf16 cast policy instead."
        )
    if fp16 >= 1.3 and "float16" in best.autocast_dtypes:
        return "O1", (
            f"fp16 matmuls run {fp16:.1f}x faster than fp32 on {best.device} here, bf16 does not help enough "
            f"({bf16:.1f}x). O1 (fp16 cast policy, dynamic loss scaling) is the safe start; O2 is faster still."
        )
    return "O0", (
        f"neither bf16 ({bf16:.1f}x) nor fp16 ({fp16:.1f}x) matmuls are clearly faster than fp32 on {best.device} "
        "here, so mixed precision would cost accuracy for little speed. Use O0 here; O4/O5 pay off on hardware "
        "with bf16 units (AMX/AVX512-BF16 CPUs, Ampere+ GPUs)."
    )


def diagnose(budget_s: float = 1.0) -> Report:
    """Measure and describe this machine; ``budget_s`` bounds the matmul micro-benchmark per device."""
    report = Report(
        ampinit=__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
        threads=torch.get_num_threads(),
    )
    for device in _devices():
        timings = _matmul_ms(device, budget_s / len(_devices()))
        fp32 = timings.get("float32", float("nan"))
        report.devices.append(
            DeviceReport(
                device=device,
                name=_device_name(device),
                autocast_dtypes=_autocast_dtypes(device),
                matmul_ms=timings,
                speedup_vs_fp32={d: fp32 / t for d, t in timings.items() if d != "float32"},
                fused_optimizers=_fused_optimizers(device),
            )
        )
    report.recommendation, report.reason = _recommend(report.devices)
    return report


def format_report(report: Report) -> str:
    lines = [
        f"ampinit {report.ampinit} | torch {report.torch} | python {report.python}",
        f"CPU capability: {report.cpu_capability}, {report.threads} threads",
        "",
    ]
    for dev in report.devices:
        lines.append(f"[{dev.device}] {dev.name}")
        lines.append(f"  autocast dtypes : {', '.join(dev.autocast_dtypes) or 'none'}")
        timings = ", ".join(f"{d} {ms:.2f} ms" for d, ms in dev.matmul_ms.items())
        lines.append(f"  matmul          : {timings}")
        speedups = ", ".join(f"{d} {s:.2f}x" for d, s in dev.speedup_vs_fp32.items())
        lines.append(f"  vs fp32         : {speedups}")
        fused = ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in dev.fused_optimizers.items())
        lines.append(f"  fused optimizers: {fused}")
    lines += ["", f"Recommended opt level: {report.recommendation}", f"  why: {report.reason}"]
    return "\n".join(lines)
