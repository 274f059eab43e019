"""How fast this machine's host runs the work a training step's host does: one line for the GPU check's machine.txt.

The fourteenth session's two GPU checks ran on two H200 machines whose hosts differed by 1.3-2.1x (docs/gpu.md),
and O2/O5's lead over native autocast, whose step the host only just keeps ahead of, came and went with it. That
was inferred afterwards from test durations; this measures it at the start of every check, so that two checks'
figures can be read against their hosts:

- ``python``: a fixed pure-Python loop (ms; the interpreter's speed, what amp's hooks and step planning run at);
- ``cpu op``: one ``torch.add`` of 1-element CPU tensors (us per call; torch's dispatcher);
- ``cuda launch``: one ``torch.add`` of 1-element CUDA tensors, timed on the host with a synchronize only at the
  end (us per call; what queueing a small kernel costs the host), when CUDA is there.

Each is the median of ``--repeats`` samples. Absolute host times: never in a test, only in this report.

    python scripts/host_speed.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

PYTHON_LOOP = 200_000
CALLS = 2_000


def _python_loop() -> int:
    total = 0
    for i in range(PYTHON_LOOP):
        total += i * i
    return total


def _median_seconds(work: Callable[[], object], repeats: int, after: Callable[[], object] = lambda: None) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        after()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _adds(a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(CALLS):
        torch.add(a, b)


def measure(repeats: int) -> dict[str, float | None]:
    """The three figures (``cuda_launch_us`` None without CUDA), after one untimed round of each."""
    cpu = torch.ones(1), torch.ones(1)
    _python_loop()
    _adds(*cpu)
    figures: dict[str, float | None] = {
        "python_ms": _median_seconds(_python_loop, repeats) * 1e3,
        "cpu_op_us": _median_seconds(lambda: _adds(*cpu), repeats) / CALLS * 1e6,
        "cuda_launch_us": None,
    }
    if torch.cuda.is_available():
        cuda = torch.ones(1, device="cuda"), torch.ones(1, device="cuda")
        _adds(*cuda)
        torch.cuda.synchronize()
        figures["cuda_launch_us"] = _median_seconds(lambda: _adds(*cuda), repeats, torch.cuda.synchronize) / CALLS * 1e6
    return figures


def line(figures: dict[str, float | None]) -> str:
    launch = figures["cuda_launch_us"]
    return (
        f"host speed: python {figures['python_ms']:.1f} ms, cpu op {figures['cpu_op_us']:.2f} us, "
        f"cuda launch {'n/a' if launch is None else f'{launch:.2f} us'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="samples per figure; the median is reported")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(line(measure(args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
