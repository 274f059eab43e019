"""Time the amp step alone (unscale + optimizer step + weight write-back) of O5 with fp32 masters and with
16-bit remainder masters, against a plain fused AdamW step on fp32 weights.

Every variant holds the same parameter shapes (the ``amp_step.py`` MLP unless ``--params`` is given). There is
no model: inside ``scale_loss`` each bf16 parameter is handed a fixed bf16 gradient, as a backward would leave
it, so a sample times ``scale_loss``'s exit (the inf/NaN check, and with fp32 masters the widening into master
grads) plus ``optimizer.step()`` (with fp32 masters the copy back into the bf16 weights; with remainders the
join, the update and the split). Variants run in interleaved rounds with a rotating order; the report
gives medians of each variant's per-round median and the median of per-round ratios.

    PYTHONPATH=. python benchmarks/remainder_step.py --rounds 15 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

import ampinit
from ampinit import amp

LR = 1e-3


def shapes(total: int | None) -> list[tuple[int, ...]]:
    if total is None:  # the amp_step.py MLP: 4 x Linear(1024, 1024) + LayerNorm, and a 16-way head
        return [(1024, 1024), (1024,), (1024,), (1024,)] * 4 + [(16, 1024), (16,)]
    side = int((total // 16) ** 0.5)
    return [(side, side)] * 16


def make_variant(name: str, dims: list[tuple[int, ...]]) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(d, generator=gen) * 0.02) for d in dims]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=True)
    if name == "plain fused AdamW (fp32)":
        grads = [torch.randn(d, generator=gen) * 1e-3 for d in dims]

        def step() -> None:
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()

        return step
    holder = nn.ParameterList(params)
    master_weights = "remainder" if name.endswith("remainder") else True
    holder, optimizer = amp.initialize(holder, optimizer, opt_level="O5", master_weights=master_weights, verbosity=0)
    half_grads = [(torch.randn(d, generator=gen) * 1e-3).bfloat16() for d in dims]

    def amp_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(torch.zeros(()), optimizer):
            # What a backward would leave: bf16 grads on the bf16 parameters (the scale is 1 at O5, so the
            # scaler's in-place unscale leaves these tensors as they are).
            for p, g in zip(holder.parameters(), half_grads):
                p.grad = g
        optimizer.step()

    return amp_step


VARIANTS = ("plain fused AdamW (fp32)", "O5 fp32 masters", "O5 remainder")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--params", type=int, default=None, help="total parameters (default: the amp_step MLP)")
    args = parser.parse_args(argv)
    dims = shapes(args.params)
    steps = {name: make_variant(name, dims) for name in VARIANTS}
    try:
        for step in steps.values():
            for _ in range(3):
                step()
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.rounds):
            order = [*VARIANTS[r % len(VARIANTS) :], *VARIANTS[: r % len(VARIANTS)]]
            for name in order:
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    steps[name]()
                    times.append(time.perf_counter() - start)
                samples[name].append(statistics.median(times) * 1e3)
    finally:
        while ampinit.current_session() is not None:
            ampinit.deinitialize()
    n = sum(torch.Size(d).numel() for d in dims)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {n:,} parameters, {args.rounds} rounds")
    plain = samples[VARIANTS[0]]
    for name in VARIANTS:
        ratios = [s / p for s, p in zip(samples[name], plain)]
        print(
            f"  {name:<26} median {statistics.median(samples[name]):8.2f} ms   "
            f"x plain (median of per-round ratios) {statistics.median(ratios):.3f}"
        )
    rem, o5 = samples["O5 remainder"], samples["O5 fp32 masters"]
    ratio = statistics.median([a / b for a, b in zip(rem, o5)])
    print(f"  O5 remainder / O5 fp32 masters (median of per-round ratios): {ratio:.3f}")


if __name__ == "__main__":
    main()
