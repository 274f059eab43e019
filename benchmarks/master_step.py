"""The O2/O5 master-weight step against a plain fused AdamW step, and the ops the amp machinery dispatches.

Two measurements, in one process:

1. Time of the amp step with master weights (half grads -> fp32 master grads x 1/scale with the inf check,
   fused AdamW on the masters, masters copied back into the half model) against ``torch.optim.AdamW(fused=True)``
   stepping the same number of fp32 parameters. Interleaved rounds, medians. Target: <= 1.25x.
2. aten ops dispatched by ``scale_loss``'s exit plus ``optimizer.step()`` for 10 and for 1000 parameter tensors
   (``TorchDispatchMode`` counter), default and sync-free modes. Target: the same count for both sizes.
3. With ``--pieces``: each pass of the CPU master step on its own (widen, unscale, optimizer, copy-back, and
   torch's fused AdamW unscaling and skipping itself via ``grad_scale``/``found_inf``), on per-parameter tensors
   and on one flat tensor of the same size, as ratios to the plain fused AdamW step.

Run:  python benchmarks/master_step.py [--quick] [--pieces] [--params 32000000] [--tensors 200] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampinit import _torch_kernels, amp


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def split(total: int, pieces: int) -> list[int]:
    return [total // pieces + (1 if i < total % pieces else 0) for i in range(pieces)]


class MasterStep:
    """An initialized half 'model' whose gradients are written directly, so only the step is timed."""

    def __init__(self, sizes: list[int], level: str, sync_free: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model = nn.ParameterList([nn.Parameter(torch.randn(n, generator=gen) * 0.01) for n in sizes])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        amp.initialize(self.model, self.opt, opt_level=level, verbosity=0, sync_free=sync_free)
        self.session = amp.current_session()
        half = next(iter(self.model.parameters())).dtype
        self.grads = [torch.randn(n, generator=gen).to(half) for n in sizes]
        self.anchor = torch.zeros((), requires_grad=True)

    def __call__(self) -> None:
        assert self.session is not None
        with self.session.scale_loss(self.anchor * 1.0, self.opt) as scaled:
            scaled.backward()
            for p, g in zip(self.model.parameters(), self.grads):
                p.grad = g
        self.opt.step()

    def close(self) -> None:
        assert self.session is not None
        self.session.close()


class PlainStep:
    def __init__(self, sizes: list[int]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.randn(n, generator=gen).requires_grad_() for n in sizes]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)

    def __call__(self) -> None:
        self.opt.step()


def time_steps(params: int, tensors: int, rounds: int) -> dict[str, float]:
    sizes = split(params, tensors)
    variants: dict[str, Any] = {
        "plain fused AdamW (fp32)": PlainStep(sizes),
        "O2 master step": MasterStep(sizes, "O2", sync_free=False),
        "O2 master step, sync_free": MasterStep(sizes, "O2", sync_free=True),
        "O5 master step": MasterStep(sizes, "O5", sync_free=False),
    }
    names = list(variants)
    for fn in variants.values():  # warm-up: optimizer state, master-grad buffers, page faults
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - start)
    for fn in variants.values():
        if isinstance(fn, MasterStep):
            fn.close()
    return {name: statistics.median(values) for name, values in samples.items()}


def time_pieces(params: int, tensors: int, rounds: int, half: torch.dtype) -> dict[str, float]:
    """Medians of each pass of the CPU master step, per-tensor lists and one flat tensor, interleaved."""
    sizes = split(params, tensors)
    gen = torch.Generator().manual_seed(0)

    def tensors_of(dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.randn(n, generator=gen).to(dtype) for n in sizes]

    masters, grads, exp_avgs = tensors_of(torch.float32), tensors_of(torch.float32), tensors_of(torch.float32)
    exp_avg_sqs = [t.abs() for t in tensors_of(torch.float32)]
    half_grads, weights = tensors_of(half), tensors_of(half)
    flat = {
        name: torch.cat(lists)
        for name, lists in (("m", masters), ("g", grads), ("a", exp_avgs), ("s", exp_avg_sqs), ("hg", half_grads))
    }
    flat_weights = torch.cat(weights)
    steps, flat_steps = [torch.tensor(5.0) for _ in sizes], [torch.tensor(5.0)]
    flag, inv_scale = torch.zeros(1), torch.tensor(1 / 1024.0)

    def adamw(
        ps: list[torch.Tensor], gs: list[torch.Tensor], a: list[torch.Tensor], s: list[torch.Tensor], **kw: Any
    ) -> None:
        torch._fused_adamw_(
            ps, gs, a, s, [], kw.pop("st", steps), lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
            amsgrad=False, maximize=False, **kw,
        )  # fmt: skip

    variants: dict[str, Any] = {
        "plain fused AdamW (fp32)": lambda: adamw(masters, grads, exp_avgs, exp_avg_sqs),
        "widen half grads -> fp32": lambda: torch._foreach_copy_(grads, half_grads),
        "unscale + check, fp32": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale),
        "unscale + check, half": lambda: torch._amp_foreach_non_finite_check_and_unscale_(half_grads, flag, inv_scale),
        "check only, half (check_finite_)": lambda: _torch_kernels.check_finite_(half_grads, flag, torch.ones(1)),
        "copy masters -> half weights": lambda: torch._foreach_copy_(weights, masters),
        "AdamW with grad_scale/found_inf": lambda: adamw(
            masters, grads, exp_avgs, exp_avg_sqs, grad_scale=torch.tensor(1.0), found_inf=torch.zeros(())
        ),
        "flat: widen": lambda: flat["g"].copy_(flat["hg"]),
        "flat: fused AdamW": lambda: adamw([flat["m"]], [flat["g"]], [flat["a"]], [flat["s"]], st=flat_steps),
        "flat: copy back": lambda: flat_weights.copy_(flat["m"]),
    }
    names = list(variants)
    for fn in variants.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def count_ops(tensors: int, level: str, sync_free: bool) -> int:
    step = MasterStep([16] * tensors, level, sync_free)
    step()
    step()
    assert step.session is not None
    block = step.session.scale_loss(step.anchor * 1.0, step.opt)
    block.__enter__().backward()
    for p, g in zip(step.model.parameters(), step.grads):
        p.grad = g
    with OpCounter() as counter:
        block.__exit__(None, None, None)
        step.opt.step()
    step.close()
    return sum(counter.ops.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few rounds (seconds)")
    parser.add_argument("--params", type=int, default=32_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pieces", action="store_true", help="also time each pass of the CPU master step")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/master_step.json"))
    args = parser.parse_args()
    if args.quick:
        args.params, args.rounds = 2_000_000, 5

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    times = time_steps(args.params, args.tensors, args.rounds)
    base = times["plain fused AdamW (fp32)"]
    print(f"\nstep over {args.params:,} params in {args.tensors} tensors (median of {args.rounds} interleaved rounds)")
    print(f"{'variant':30s} {'ms':>9s} {'vs plain':>9s}")
    for name, seconds in times.items():
        print(f"{name:30s} {seconds * 1e3:9.2f} {seconds / base:9.3f}")
    worst = max(times[k] / base for k in times if k.startswith("O"))
    print(f"target: master step <= 1.25x plain -> worst {worst:.3f}x: {'met' if worst <= 1.25 else 'NOT met'}")

    pieces: dict[str, dict[str, float]] = {}
    if args.pieces:
        for half in (torch.float16, torch.bfloat16):
            piece_times = pieces[str(half)] = time_pieces(args.params, args.tensors, args.rounds, half)
            piece_base = piece_times["plain fused AdamW (fp32)"]
            print(f"\npasses of the master step, {half} half weights (median of {args.rounds} interleaved rounds)")
            for name, seconds in piece_times.items():
                print(f"{name:34s} {seconds * 1e3:9.2f} {seconds / piece_base:9.3f}")

    counts = {
        f"{level}{' sync_free' if sync_free else ''}": {n: count_ops(n, level, sync_free) for n in (10, 1000)}
        for level in ("O1", "O2", "O5")
        for sync_free in (False, True)
    }
    print("\naten ops dispatched by scale_loss exit + optimizer.step()")
    print(f"{'mode':16s} {'10 tensors':>11s} {'1000 tensors':>13s}")
    for mode, by_size in counts.items():
        print(f"{mode:16s} {by_size[10]:11d} {by_size[1000]:13d}")
    constant = all(by_size[10] == by_size[1000] for by_size in counts.values())
    print(f"target: count independent of the tensor count -> {'met' if constant else 'NOT met'}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "params": args.params,
        "tensors": args.tensors,
        "rounds": args.rounds,
        "median_seconds": times,
        "ratio_vs_plain": {k: v / base for k, v in times.items()},
        "op_counts": counts,
        "pieces_median_seconds": pieces,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
