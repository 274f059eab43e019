"""Host time of one Triton launch of the master step, through Triton and through amp's launch path, on any machine.

The master step alone is host-bound on the H100 checks (docs/gpu.md), and each of its Triton launches went through
``JITFunction.run``: binding every argument to the signature, specialising each, building a cache key. Since the
sixteenth session amp launches through ``ampinit._masters.triton_launch``, which keys the arguments itself and
calls the compiled kernel Triton returned. This benchmark runs both paths to the CUDA launcher with Triton's whole
machinery, on a machine without a GPU: a stand-in driver (benchmarks/_fake_driver.py) compiles for an H100 and
records the launcher's calls instead of making them, so a sample is exactly the host work a launch costs before
the driver (the driver's own ``cuLaunchKernel`` is the same for both paths).

Rows, each over the master step's real arguments for ``--tensors`` tensors (the tables are cached, as in a
training loop): the Adam launch (fp32 masters, bf16 weights and grads, an overflow flag) and the finite check's
launch, through ``kernel[grid](...)`` and through ``triton_launch.launch``; and the public functions that make
them (``adam_`` and ``check_finite_``: storage keys, tables, launch), which show what the launch is of the whole.
Interleaved round by round, medians of per-call microseconds; a table and a JSON file, with the CPU named.

    PYTHONPATH=. python benchmarks/triton_launch_host.py [--tensors 150] [--rounds 15] [--calls 2000] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._fake_driver import fake_driver
from benchmarks.cpu_peak_memory import cpu_name


class _Capture:
    """Stands in for a kernel for one call, to take the arguments amp's launch code gives it."""

    def __init__(self) -> None:
        self.programs = 0
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def __getitem__(self, grid: tuple[int]) -> Callable[..., None]:
        def take(*args: Any, **kwargs: Any) -> None:
            self.programs, self.args, self.kwargs = grid[0], args, kwargs

        return take


def _captured(kernels: Any, name: str, call: Callable[[], None]) -> _Capture:
    kernel, capture = getattr(kernels, name), _Capture()
    setattr(kernels, name, capture)
    try:
        call()
    finally:
        setattr(kernels, name, kernel)
    return capture


def workloads(tensors: int, numel: int) -> dict[str, Callable[[], None]]:
    """The timed calls (inside :func:`benchmarks._fake_driver.fake_driver`, whose rebuilt modules they use)."""
    import ampinit._masters.triton_kernels as kernels
    from ampinit._masters import triton_launch
    from ampinit._masters.reference import AdamSettings, Masters

    gen = torch.Generator().manual_seed(0)
    masters_list = [torch.randn(numel, generator=gen) for _ in range(tensors)]
    weights = [m.to(torch.bfloat16) for m in masters_list]
    grads = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(tensors)]
    exp_avgs, exp_avg_sqs = [torch.zeros(numel) for _ in range(tensors)], [torch.zeros(numel) for _ in range(tensors)]
    scalars = torch.rand(tensors, 2, generator=gen)
    flag = torch.zeros(1)
    settings = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    masters = Masters.fp32(masters_list, weights)

    def adam() -> None:
        kernels.adam_(grads, masters, exp_avgs, exp_avg_sqs, scalars, settings, found_inf=flag)

    def check() -> None:
        kernels.check_finite_(grads, flag)

    rows: dict[str, Callable[[], None]] = {"adam_ (amp's whole launch)": adam, "check_finite_": check}
    for label, name, call in (("Adam", "_adam_kernel", adam), ("check", "_check_kernel", check)):
        kernel, taken = getattr(kernels, name), _captured(kernels, name, call)
        names = kernel.arg_names[len(taken.args) :]
        constants = {n: taken.kwargs[n] for n in names}
        options = {k: v for k, v in taken.kwargs.items() if k not in constants}
        grid, args, kwargs = (taken.programs,), taken.args, taken.kwargs
        rows[f"{label}: kernel[grid]"] = lambda k=kernel, g=grid, a=args, kw=kwargs: k[g](*a, **kw)
        rows[f"{label}: triton_launch"] = lambda k=kernel, p=taken.programs, a=args, c=constants, o=options: (
            triton_launch.launch(k, p, a, c, o)
        )
    return rows


def per_call(work: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        work()
    return (time.perf_counter() - start) / calls * 1e6


def measure(tensors: int, numel: int, rounds: int, calls: int) -> dict[str, float]:
    with fake_driver() as driver:
        rows = workloads(tensors, numel)
        for work in rows.values():
            work()  # compiles (Triton's disk cache after the first run), builds the tables
        samples: dict[str, list[float]] = {name: [] for name in rows}
        names = list(rows)
        for index in range(rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(per_call(rows[name], calls))
                driver.calls.clear()
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=150)
    parser.add_argument("--numel", type=int, default=64, help="elements per tensor (host work does not depend on it)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    import triton

    torch.set_num_threads(1)
    figures = measure(args.tensors, args.numel, args.rounds, args.calls)
    machine = {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
               "triton": triton.__version__}  # fmt: skip
    sys.stdout.write(f"{machine}; {args.tensors} tensors, {args.rounds} rounds x {args.calls} calls\n")
    sys.stdout.write(f"{'launch':<30} {'us/call':>8} {'x Triton':>9}\n")
    for name, us in figures.items():
        label, _, path = name.partition(": ")
        base = figures.get(f"{label}: kernel[grid]") if path else None
        ratio = f"{us / base:9.2f}" if base else " " * 9
        sys.stdout.write(f"{name:<30} {us:8.2f} {ratio}\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine, "tensors": args.tensors, "us_per_call": figures}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
