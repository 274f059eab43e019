"""O1/O4 train-step time: ampinit's cast policies against native ``torch.autocast`` (+ GradScaler for fp16).

Contenders, each on its own copy of the model with a fused AdamW, one full step = zero_grad, forward, loss,
backward (through ``scale_loss`` for ampinit), step:

* ``native``: ``torch.autocast`` around forward and loss, GradScaler for fp16;
* ``ampinit-native``: ``initialize(..., cast_policy="native")``: PyTorch's lists only (target: within 1.03x);
* ``ampinit-apex``: ``initialize(..., cast_policy="apex")``: plus Apex's lists (the cost of Apex semantics);
* ``function-mode``: a Python ``TorchFunctionMode`` that casts per call (Apex's approach, without patching),
  to show what a Python-level engine would cost.

An O1/O4 session switches autocast on for the whole thread, so each timed block opens and closes its own
session (excluded from the timing). Blocks are interleaved round by round; medians reported. Usage:

    python benchmarks/cast_policy.py [--quick] [--rounds N] [--only small-op|mlp] [--cpu-time] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import ampinit as amp

try:
    from benchmarks.models import make_mlp
except ImportError:  # run as a script from benchmarks/
    from models import make_mlp  # type: ignore[no-redef]

DEFAULT_JSON = Path(__file__).parent / "results" / "cast_policy.json"
LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}


def small_op_model(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """12 x (Linear(64) + LayerNorm + GELU), batch 32: many small ops, where per-op overhead shows."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(32, 64), torch.randint(0, 64, (32,))


def mlp_model(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model, inputs, target, _ = make_mlp(seed)
    return model, inputs, target


class PerCallCasts(TorchFunctionMode):
    """Apex's O1 as a Python mode: linear in half, layer_norm/gelu/losses in fp32, cast at every call."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.half_funcs = {F.linear, torch.matmul, torch.mm, torch.addmm}
        self.float_funcs = {F.layer_norm, F.gelu, F.cross_entropy, F.softmax, F.log_softmax, torch.sum}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = self.dtype if func in self.half_funcs else torch.float32 if func in self.float_funcs else None
        if target is not None:
            args = tuple(a.to(target) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        return func(*args, **kwargs)


class Contender:
    """One way to train: ``open()`` and ``close()`` around a timed block of ``step()`` calls."""

    def __init__(self, kind: str, level: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.kind, self.level, self.dtype = kind, level, LEVELS[level]
        self.model, self.x, self.y = copy.deepcopy(model), x, y
        self.opt = torch.optim.AdamW(self.model.parameters(), 1e-3, fused=True)
        self.scaler = torch.amp.GradScaler("cpu", enabled=self.dtype == torch.float16)

    def open(self) -> None:
        if self.kind.startswith("ampinit"):
            policy = self.kind.split("-")[1]
            amp.initialize(self.model, self.opt, opt_level=self.level, verbosity=0, cast_policy=policy)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.kind.startswith("ampinit"):
            amp.deinitialize()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.kind.startswith("ampinit"):
            loss = F.cross_entropy(self.model(self.x), self.y)
            with amp.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
            self.opt.step()
            return
        if self.kind == "native":
            with torch.autocast("cpu", dtype=self.dtype):
                loss = F.cross_entropy(self.model(self.x), self.y)
        else:
            with PerCallCasts(self.dtype):
                loss = F.cross_entropy(self.model(self.x), self.y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()


def interleaved(
    contenders: list[Contender], rounds: int, steps: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median seconds per step of each contender; blocks rotate order each round so drift hits all alike."""
    for c in contenders:  # warm-up: page faults, thread pool, first registrations
        c.open()
        c.step()
        c.close()
    times: dict[str, list[float]] = {c.kind: [] for c in contenders}
    for r in range(rounds):
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            c.open()
            start = clock()
            for _ in range(steps):
                c.step()
            times[c.kind].append((clock() - start) / steps)
            c.close()
    return {kind: statistics.median(ts) for kind, ts in times.items()}


def run(quick: bool, rounds: int | None, only: str | None = None, cpu_time: bool = False) -> list[dict[str, Any]]:
    # (build, rounds, steps per block): fp16 matmuls are slow on CPUs without fp16 matrix units, so the MLP
    # gets fewer, shorter blocks.
    workloads: dict[str, tuple[Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]], int, int]] = {
        "small-op (12 x Linear(64)+LN+GELU, batch 32)": (small_op_model, 3 if quick else 31, 2 if quick else 20),
        "mlp (4 x Linear(1024)+LN+GELU, batch 256)": (mlp_model, 2 if quick else 5, 1),
    }
    rows = []
    clock = time.thread_time if cpu_time else time.perf_counter
    for name, (build, default_rounds, steps) in workloads.items():
        if only is not None and not name.startswith(only):
            continue
        model, x, y = build()
        for level in LEVELS:
            kinds = ["native", "ampinit-native", "ampinit-apex", "function-mode"]
            contenders = [Contender(k, level, model, x, y) for k in kinds]
            medians = interleaved(contenders, rounds or default_rounds, steps, clock)
            base = medians["native"]
            rows.append(
                {
                    "workload": name,
                    "level": level,
                    "rounds": rounds or default_rounds,
                    "steps_per_block": steps,
                    "ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
                    "ratio_vs_native": {k: round(v / base, 3) for k, v in medians.items()},
                    "load_average_1min": round(os.getloadavg()[0], 1),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--only", choices=["small-op", "mlp"], default=None, help="one workload only")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one torch thread, timed by the thread's CPU time: on a machine loaded by other processes, what the "
        "step costs rather than how long it waited for a core",
    )
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    rows = run(args.quick, args.rounds, args.only, args.cpu_time)
    header = (
        f"{'workload':46} {'level':5} {'native ms':>10} {'amp-native':>11} {'amp-apex':>9} {'fn-mode':>8} {'load':>5}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row["ratio_vs_native"]
        lines.append(
            f"{row['workload']:46} {row['level']:5} {row['ms']['native']:10.2f} {ratio['ampinit-native']:10.3f}x"
            f" {ratio['ampinit-apex']:8.3f}x {ratio['function-mode']:7.3f}x {row['load_average_1min']:5.1f}"
        )
    print("\n".join(lines))
    result = {
        "benchmark": "cast_policy",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
