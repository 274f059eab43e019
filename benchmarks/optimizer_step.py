"""Step time of ampinit's FusedAdam/FusedSGD against torch's fused optimizers, and FusedAdam's bandwidth.

One process, contenders interleaved round by round, medians reported. Usage:

    python benchmarks/optimizer_step.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ampinit.optimizers import FusedAdam, FusedSGD

DEFAULT_JSON = Path(__file__).parent / "results" / "optimizer_step.json"
# FusedAdam reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 fp32 accesses.
ADAM_BYTES_PER_PARAM = 7 * 4


def split(total: int, pieces: int) -> list[int]:
    base = total // pieces
    return [base + (1 if i < total % pieces else 0) for i in range(pieces)]


def make_params(sizes: list[int]) -> list[torch.Tensor]:
    params = []
    for n in sizes:
        p = torch.randn(n).requires_grad_()
        p.grad = torch.randn(n) * 1e-3
        params.append(p)
    return params


def interleaved_medians(contenders: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender, interleaved round by round so drift hits all alike."""
    # The first calls pay for page faults and thread-pool start-up; keep them out of the medians.
    for _ in range(3):
        for fn in contenders.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        # Rotate the order each round so that neither contender always runs right after the other.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = contenders[name]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def compare_steps(kind: str, total: int, pieces: int, rounds: int) -> dict[str, float | int | str]:
    params = make_params(split(total, pieces))
    if kind == "adam":
        ours: torch.optim.Optimizer = FusedAdam(params, lr=1e-3)
        theirs: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
    else:
        ours = FusedSGD(params, lr=1e-3, momentum=0.9)
        theirs = torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True)
    medians = interleaved_medians({"ampinit": ours.step, "torch": theirs.step}, rounds)
    del ours, theirs, params
    gc.collect()
    return {
        "optimizer": kind,
        "params": total,
        "tensors": pieces,
        "ampinit_s": medians["ampinit"],
        "torch_s": medians["torch"],
        "ratio": medians["ampinit"] / medians["torch"],
    }


def adam_bandwidth(total: int, rounds: int) -> dict[str, float | int]:
    params = make_params([total])
    adam = FusedAdam(params, lr=1e-3)
    src, dst = torch.randn(total), torch.empty(total)

    def copy() -> None:
        dst.copy_(src)

    medians = interleaved_medians({"adam": adam.step, "copy": copy}, rounds)
    adam_gbs = ADAM_BYTES_PER_PARAM * total / medians["adam"] / 1e9
    copy_gbs = 2 * 4 * total / medians["copy"] / 1e9
    return {
        "params": total,
        "adam_s": medians["adam"],
        "adam_GBps": adam_gbs,
        "copy_s": medians["copy"],
        "copy_GBps": copy_gbs,
        "fraction_of_copy": adam_gbs / copy_gbs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per contender")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()
    total = 2**20 if args.quick else 64 * 2**20
    rounds = args.rounds or (5 if args.quick else 9)

    steps = [compare_steps(kind, total, pieces, rounds) for kind in ("adam", "sgd") for pieces in (1, 200)]
    bandwidth = adam_bandwidth(total, rounds)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {total} params, {rounds} rounds")
    print(f"{'optimizer':<10}{'tensors':>8}{'ampinit ms':>12}{'torch ms':>10}{'ratio':>8}")
    for row in steps:
        print(
            f"{row['optimizer']:<10}{row['tensors']:>8}{1e3 * float(row['ampinit_s']):>12.1f}"
            f"{1e3 * float(row['torch_s']):>10.1f}{float(row['ratio']):>8.3f}"
        )
    print(
        f"FusedAdam traffic {bandwidth['adam_GBps']:.2f} GB/s vs copy_ {bandwidth['copy_GBps']:.2f} GB/s "
        f"= {100 * bandwidth['fraction_of_copy']:.0f}%"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rounds": rounds,
        "steps": steps,
        "adam_bandwidth": bandwidth,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
