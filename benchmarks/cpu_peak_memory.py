"""Peak live tensor bytes of a training step on CPU, and what is live at the peak: a proxy for issue 24's memory
target (``O5 remainder`` <= pure bf16 + 2 B per parameter, judged on a GPU by ``benchmarks/gpu_train_step.py``).

The proxy follows every allocation and free of the CPU allocator under ``torch.profiler`` with
``profile_memory=True`` (the allocator reports the requested bytes of each block it hands out and takes back,
with the address), replays them in order, and keeps the largest sum of bytes allocated and not yet freed. That sum
is exact (requested bytes, no allocator rounding) and counts only what was allocated while tracing, so the trace
starts before the model is built. Each allocation carries the innermost aten op that made it, the innermost Python
frame outside torch that asked for it (ampinit's or the benchmark's code) and the phase it fell in (build, forward,
backward, optimizer step), so the live set at the peak can be named tensor by tensor.

Workload: ``gpu_train_step``'s decoder, its loss, batch and variants (its own ``build``), at a CPU-sized shape.
Each variant is built and stepped alone: build + ``--steps`` steps inside one trace.

    python -m benchmarks.cpu_peak_memory                       # layers 2, d_model 256, vocab 8192, seq 128, batch 4
    python -m benchmarks.cpu_peak_memory --vocab 50257 --json /tmp/peak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.gpu_train_step import PURE_BF16, GPTShape, build

#: The variants compared, with the bytes per parameter each may hold beyond pure bf16 (issue 24's memory target:
#: remainders 2 B; fp32 moments instead of bf16 ones 4 B more; fp32 masters 4 B and fp32 moments 4 B).
ALLOWANCES: dict[str, float] = {
    PURE_BF16: 0.0,
    "O5 remainder + bf16 state": 2.0,
    "O5 remainder": 6.0,
    "O5 AdamW fused": 8.0,
    # Clipping (beyond issue 24): amp.clip_grad_norm_ keeps O5 remainder's allowance; Apex's line over
    # amp.master_params makes an fp32 master and grad per parameter (8 B) until the step.
    "O5 remainder + clip": 6.0,
    "O5 remainder + Apex clip": 6.0,
}
CPU_SHAPE = GPTShape(layers=2, d_model=256, heads=4, seq=128, vocab=8192)
PHASE_BUILD = "build"


@dataclass(frozen=True)
class Allocation:
    """One block the allocator handed out: its address and requested bytes, the aten op that asked for it, the
    innermost Python frame outside torch on the way, and the phase it fell in."""

    ptr: int
    size: int
    op: str
    frame: str
    phase: str


@dataclass(frozen=True)
class PeakTrace:
    """The most bytes live at once while tracing, the allocation that reached it, what was live then, and what is
    live when tracing ends."""

    peak: int
    at: Allocation | None
    live_at_peak: tuple[Allocation, ...]
    live_at_end: tuple[Allocation, ...]


def _kind(labels: Sequence[str]) -> str:
    """What part of a step an allocation belongs to, from the names of the events and Python frames it sits in."""
    if any(label.startswith("autograd::engine") for label in labels):
        return "backward"
    if any("torch/optim/" in label or "ampinit/_masters/" in label or "ampinit/_skip" in label for label in labels):
        return "optimizer step"
    return "forward, loss, zero_grad"


def _own_frame(name: str) -> bool:
    """Whether a Python frame's name (``path(line): function``) is code of this repository, not torch's."""
    return ("ampinit/" in name or "benchmarks/" in name or "tests/" in name) and "cpu_peak_memory" not in name


def _name(node: Any) -> str:
    """An event's name; the profiler can hand back an undecodable one for a C call (seen under pytest), which no
    rule here needs."""
    try:
        return str(node.name)
    except UnicodeDecodeError:
        return "<undecodable>"


def _windows(nodes: Sequence[Any]) -> list[tuple[int, int, str]]:
    """The time windows of the ``record_function`` labels that name a phase (the build, ``step N``)."""
    found: list[tuple[int, int, str]] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        name = _name(node)
        if str(node.tag).endswith("TorchOp") and (name == PHASE_BUILD or name.startswith("step ")):
            found.append((node.start_time_ns, node.end_time_ns, name))
        stack.extend(node.children)
    return found


def _allocations(nodes: Sequence[Any]) -> Iterator[tuple[int, int, Allocation]]:
    """Every allocation (size > 0) and free (size < 0) under ``nodes``: (time, order, allocation)."""
    windows = _windows(nodes)
    order = 0
    stack: list[tuple[Any, tuple[str, ...], str, str]] = [(n, (), "", "") for n in reversed(nodes)]
    while stack:
        node, labels, op, frame = stack.pop()
        tag = str(node.tag)
        fields = node.extra_fields
        if tag.endswith("Allocation"):
            order += 1
            when = node.start_time_ns
            outer = next((name for start, end, name in windows if start <= when <= end), "outside")
            phase = outer if outer in (PHASE_BUILD, "outside") else f"{outer}: {_kind(labels)}"
            yield when, order, Allocation(int(fields.ptr), int(fields.alloc_size), op, frame, phase)
            continue
        name = _name(node)
        if tag.endswith("PyCall") and _own_frame(name):
            frame = name
        elif tag.endswith("TorchOp") and name.startswith("aten::"):
            op = name
        stack.extend((child, (*labels, name), op, frame) for child in reversed(node.children))


def replay(events: Sequence[tuple[int, int, Allocation]]) -> PeakTrace:
    """The live bytes after each event in time order: their maximum, and the live sets at it and at the end. A
    free of a block allocated before tracing (unknown address) changes nothing."""
    ordered = sorted(events, key=lambda event: (event[0], event[1]))
    live: dict[int, Allocation] = {}
    total = peak = 0
    peak_index = -1
    for index, (_, _, allocation) in enumerate(ordered):
        if allocation.size > 0:
            live[allocation.ptr] = allocation
            total += allocation.size
        else:
            freed = live.pop(allocation.ptr, None)
            total -= 0 if freed is None else freed.size
        if total > peak:
            peak, peak_index = total, index
    at_end = tuple(live.values())
    live.clear()
    for _, _, allocation in ordered[: peak_index + 1]:
        if allocation.size > 0:
            live[allocation.ptr] = allocation
        else:
            live.pop(allocation.ptr, None)
    at = ordered[peak_index][2] if peak_index >= 0 else None
    return PeakTrace(peak, at, tuple(live.values()), at_end)


def trace_peak(run: Callable[[], None]) -> PeakTrace:
    """Peak live bytes of the CPU allocator while ``run()`` runs (see the module docstring)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        run()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler recorded nothing")
    return replay(list(_allocations(results.experimental_event_tree())))


def variant_run(name: str, shape: GPTShape, batch: int, steps: int) -> tuple[Callable[[], None], dict[str, int]]:
    """Build + ``steps`` steps of ``gpu_train_step``'s variant ``name`` on CPU, each under its phase label; the
    dict receives the parameter count."""
    facts: dict[str, int] = {}

    def run() -> None:
        with record_function(PHASE_BUILD):
            variant = build(name, torch.device("cpu"), shape, batch)
        facts["params"] = variant.params
        try:
            variant.enter()
            try:
                for index in range(steps):
                    with record_function(f"step {index}"):
                        variant.step()
            finally:
                variant.leave()
        finally:
            variant.close()

    return run, facts


def measure(name: str, shape: GPTShape, batch: int, steps: int) -> tuple[PeakTrace, int]:
    run, facts = variant_run(name, shape, batch, steps)
    peak = trace_peak(run)
    return peak, facts["params"]


def _key(allocation: Allocation) -> tuple[str, str, str, int]:
    # Without the step index and the frame's line: the same tensor made by another step, or by the native and the
    # amp variant's step functions (same name, other lines), is the same entry.
    frame = re.sub(r"\(\d+\)", "", allocation.frame)
    return allocation.phase.split(": ")[-1], frame, allocation.op, allocation.size


def live_difference(subject: PeakTrace, baseline: PeakTrace) -> list[dict[str, Any]]:
    """What is live at ``subject``'s peak beyond ``baseline``'s peak, grouped by (phase kind, frame, op, size):
    the count each side holds, and the bytes ``subject`` holds more (the step index is left out of the key, so
    the same tensor made in different steps matches)."""
    counts: dict[tuple[str, str, str, int], list[int]] = {}
    for side, trace in enumerate((subject, baseline)):
        for allocation in trace.live_at_peak:
            counts.setdefault(_key(allocation), [0, 0])[side] += 1
    rows = [
        {
            "phase": k[0],
            "frame": k[1],
            "op": k[2],
            "size": k[3],
            "subject": n[0],
            "baseline": n[1],
            "extra": (n[0] - n[1]) * k[3],
        }
        for k, n in counts.items()
        if n[0] != n[1]
    ]
    return sorted(rows, key=lambda row: -abs(row["extra"]))


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` gives it (from /proc/cpuinfo), else the architecture."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=CPU_SHAPE.layers)
    parser.add_argument("--d-model", type=int, default=CPU_SHAPE.d_model)
    parser.add_argument("--heads", type=int, default=CPU_SHAPE.heads)
    parser.add_argument("--seq", type=int, default=CPU_SHAPE.seq)
    parser.add_argument("--vocab", type=int, default=CPU_SHAPE.vocab)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="rows of each variant's difference from pure bf16")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    shape = GPTShape(args.layers, args.d_model, args.heads, args.seq, args.vocab)
    traces = {name: measure(name, shape, args.batch, args.steps) for name in ALLOWANCES}
    baseline, params = traces[PURE_BF16]
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "torch": torch.__version__},
        "shape": asdict(shape),
        "batch": args.batch,
        "steps": args.steps,
        "step path": "CPU (amp's chunked step; a GPU takes the Triton kernels)",
        "params": params,
        "variants": {},
    }
    print(f"{cpu_name()}, torch {torch.__version__}")
    print(f"{params} parameters, shape {asdict(shape)}, batch {args.batch}, build + {args.steps} steps")
    print(f"{'variant':28} {'peak bytes':>12} {'allowed':>12} {'over':>10}  peak at")
    for name, allowance in ALLOWANCES.items():
        trace, _ = traces[name]
        allowed = baseline.peak + int(allowance * params)
        at = trace.at
        where = "-" if at is None else f"{at.phase} / {at.op} / {at.frame}"
        print(f"{name:28} {trace.peak:12d} {allowed:12d} {trace.peak - allowed:10d}  {where}")
        difference = live_difference(trace, baseline) if name != PURE_BF16 else []
        report["variants"][name] = {
            "peak": trace.peak,
            "allowed": allowed,
            "over": trace.peak - allowed,
            "peak_at": None if at is None else asdict(at),
            "live_beyond_pure_bf16": difference,
        }
        for row in difference[: args.top]:
            print(
                f"    {row['extra']:+12d} B  {row['subject']}x vs {row['baseline']}x {row['size']} B"
                f"  {row['phase']} / {row['op']} / {row['frame']}"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    print(json.dumps({name: v["over"] for name, v in report["variants"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
