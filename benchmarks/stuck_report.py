"""Step-time cost of the stuck-weight report (``initialize(stuck_weights_every=N)``, issue 26 point 4).

Three copies of the same decoder (``precision_quality.char_decoder``) train at O5 in one process, one session each:
one without the report, one measuring every ``--every`` steps, one measuring every step. They run in interleaved
blocks of ``--every`` steps (so that every block of the reporting copy holds exactly one measuring step), in an
order rotated each round; the figure is the median over rounds of (variant block time / plain block time), in the
thread's CPU time
(torch runs on one thread here, so the CPU time of the calling thread is the step's, and a busy machine's other
processes do not enter it; wall-clock figures are recorded beside it). Target: < 1.02 at an interval of 100,
judged on the estimate from the every-step copy (``summarize``), whose cost stands above the noise.

    PYTHONPATH=. python benchmarks/stuck_report.py --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import ampinit
from ampinit import amp
from benchmarks.precision_quality import Shape, char_decoder, lm_loss, machine, threads

DEFAULT_JSON = Path("benchmarks/results/stuck_report.json")
TARGET = 1.02


def make_trainer(
    initial: torch.nn.Module, shape: Shape, every: int | None
) -> tuple[Callable[[int], tuple[float, float]], Any]:
    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, stuck_weights_every=every)
    session = ampinit.session_of(opt)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (shape.batch, shape.context), generator=gen) for _ in range(8)]

    def block(steps: int) -> tuple[float, float]:
        """(CPU seconds of this thread, wall seconds) for ``steps`` training steps."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        for i in range(steps):
            x = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with amp.scale_loss(lm_loss(model(x), x), opt) as scaled:
                scaled.backward()
            opt.step()
        return time.thread_time() - cpu_started, time.perf_counter() - started

    return block, session


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, interval 4, 2 rounds")
    parser.add_argument("--every", type=int, default=None, help="the report's interval (default 100; quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; quick 2)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    every = args.every if args.every is not None else 4 if args.quick else 100
    rounds = args.rounds if args.rounds is not None else 2 if args.quick else 7
    if every < 1 or rounds < 1:
        parser.error(f"--every and --rounds must be >= 1, got {every} and {rounds}")
    with threads(1):
        shape = Shape(layers=1, d_model=32, heads=2, context=16, batch=4) if args.quick else Shape()
        torch.manual_seed(0)
        initial = char_decoder(shape)
        trainers = {name: make_trainer(initial, shape, n) for name, n in variants(every).items()}
        env = machine()
        print(f"{env['cpu']}, torch {env['torch']}, 1 thread; {shape}; interval {every}, {rounds} rounds")
        try:
            cpu, wall = measure({name: block for name, (block, _) in trainers.items()}, every, rounds)
            measured = trainers["reporting"][1].stats().stuck_weights is not None
        finally:
            for _, session in trainers.values():
                session.close()
    result = summarize(cpu, wall, every)
    result.update(benchmark="stuck_report", machine=env, shape=vars(shape), every=every, rounds=rounds)
    result["measurements_seen"] = measured
    for name in ("reporting", "every step"):
        print(f"{name}: CPU time x{result['ratio'][name]:.4f} of the plain step (median of per-round ratios)")
    verdict = "MET" if result["met"] else "NOT MET"
    print(
        f"cost at interval {every}: measured x{result['ratio']['reporting']:.4f}; from the every-step cost, "
        f"x{result['estimate']:.4f} (target < {TARGET}, judged on the estimate): {verdict}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def variants(every: int) -> dict[str, int | None]:
    """Name -> the report's interval: none, ``every``, and every step."""
    return {"plain": None, "reporting": every, "every step": 1}


def measure(
    blocks: dict[str, Callable[[int], tuple[float, float]]], every: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant, CPU and wall ms per step of each round's block of ``every`` steps (after one warm-up block)."""
    for block in blocks.values():
        block(every)
    cpu: dict[str, list[float]] = {name: [] for name in blocks}
    wall: dict[str, list[float]] = {name: [] for name in blocks}
    names = list(blocks)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cpu_s, wall_s = blocks[name](every)
            cpu[name].append(cpu_s / every * 1e3)
            wall[name].append(wall_s / every * 1e3)
    return cpu, wall


def summarize(cpu: dict[str, list[float]], wall: dict[str, list[float]], every: int) -> dict[str, Any]:
    """Ratios to the plain step (medians of per-round ratios of CPU time). The cost at the interval is also
    estimated from the every-step variant: a measurement at every step costs ``every`` times as much over the
    plain step as one every ``every`` steps, far above the noise of a shared machine."""
    ratio = {
        name: statistics.median(r / p for r, p in zip(cpu[name], cpu["plain"])) for name in ("reporting", "every step")
    }
    estimate = 1 + (ratio["every step"] - 1) / every
    return {
        "cpu_ms_per_step": cpu,
        "wall_ms_per_step": wall,
        "ratio": ratio,
        "estimate": estimate,
        "target": TARGET,
        "met": estimate < TARGET,
    }


if __name__ == "__main__":
    main()
