"""Time one full training step in every precision mode: native torch (fp32, autocast, pure bf16), ampinit O0-O5.

A step is ``zero_grad`` + forward + loss + backward + optimizer step, always with fused AdamW. Both workloads
of ``benchmarks/models.py`` run in one process, one after the other; within a workload every variant trains its
own copy of the model (same seed, same initial weights) and the variants are timed in interleaved rounds: each
round runs every variant for one block of steps, in an order rotated by one each round, so machine noise and
slow drifts spread over all variants alike. Reported times are medians over rounds of each block's ms/step.

    PYTHONPATH=. python benchmarks/amp_step.py              # full run
    PYTHONPATH=. python benchmarks/amp_step.py --quick      # smoke run, small sizes, < 60 s

See ``benchmarks/README.md`` for how to read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ampinit
from ampinit import amp
from ampinit._opt_levels import FUNCTION_CAST_LEVELS as THREAD_AUTOCAST_LEVELS  # casts in the whole thread
from ampinit._types import OPT_LEVELS
from benchmarks.models import Workload, make_checkerboard, make_mlp

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "amp_step.json"
FP32, AUTOCAST_BF16, AUTOCAST_FP16, PURE_BF16 = (
    "native fp32",
    "native autocast bf16",
    "native autocast fp16 + GradScaler",
    "pure bf16",
)
O5_REMAINDER = "ampinit O5 remainder"
LR = 1e-3


# -- variants ------------------------------------------------------------------------------------------------
class Variant:
    """One way of training: ``enter()`` before a timed block, ``step()`` inside it, ``leave()`` after it.

    ``enter`` and ``leave`` are not timed. Subclasses own their model, inputs and optimizer.
    """

    name: str
    #: Whether autocast is on in the thread between ``enter()`` and ``leave()`` (outside them it never is).
    sets_thread_autocast = False

    def enter(self) -> None:
        """Prepare for a block of steps (untimed)."""

    def step(self) -> torch.Tensor:
        """One full training step; returns the loss."""
        raise NotImplementedError

    def leave(self) -> None:
        """Clean up after a block of steps (untimed)."""

    def details(self) -> dict[str, Any]:
        """Extra facts for the report (e.g. amp counters)."""
        return {}


def _fused_adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, fused=True)


class NativeVariant(Variant):
    """Plain PyTorch: fp32, or ``torch.autocast`` around forward + loss (fp16 adds a ``GradScaler``)."""

    def __init__(self, name: str, workload: Workload, autocast_dtype: torch.dtype | None) -> None:
        self.name = name
        self.model, self.inputs, self.target, self.loss_fn = workload
        self.optimizer = _fused_adamw(self.model.parameters())
        self.autocast_dtype = autocast_dtype
        # fp16 needs loss scaling; bf16 has fp32's exponent range and, like fp32, trains without it.
        self.scaler = torch.amp.GradScaler("cpu") if autocast_dtype == torch.float16 else None

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if self.autocast_dtype is None:
            loss = self.loss_fn(self.model(self.inputs), self.target)
        else:
            with torch.autocast("cpu", dtype=self.autocast_dtype):
                loss = self.loss_fn(self.model(self.inputs), self.target)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss

    def details(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"loss_scale": self.scaler.get_scale()}


class PureBf16Variant(Variant):
    """``model.bfloat16()``, bf16 inputs, fused AdamW on the bf16 parameters: bf16 training's cost floor."""

    name = PURE_BF16

    def __init__(self, workload: Workload) -> None:
        model, inputs, self.target, self.loss_fn = workload
        self.model = model.bfloat16()
        self.inputs = inputs.bfloat16()
        self.optimizer = _fused_adamw(self.model.parameters())

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # The loss in fp32, as O5 computes it (its model outputs are cast back to fp32).
        loss = self.loss_fn(self.model(self.inputs).float(), self.target)
        loss.backward()
        self.optimizer.step()
        return loss


class AmpinitVariant(Variant):
    """``amp.initialize(..., opt_level=level)`` and the Apex training loop.

    O1/O4 sessions switch autocast on for the whole thread while they are open, which would leak into every
    other variant. Those sessions are therefore opened in ``enter`` and closed in ``leave`` (both untimed),
    and the loss-scaler state is carried from one session to the next so the dynamic scale keeps settling; the
    optimizer, its state and the model stay the same objects throughout. Every other level keeps one session
    open for the whole run, so its weights are cast once.
    """

    def __init__(
        self,
        level: str,
        workload: Workload,
        cast_policy: str = "apex",
        skip_nonfinite: bool = True,
        master_weights: str | None = None,
    ) -> None:
        self.name = ampinit_name(level, cast_policy, skip_nonfinite, master_weights)
        self.master_weights = master_weights
        self.level = level
        self.cast_policy = cast_policy
        self.skip_nonfinite = skip_nonfinite
        self.sets_thread_autocast = level in THREAD_AUTOCAST_LEVELS
        self.model, self.inputs, self.target, self.loss_fn = workload
        self.optimizer = _fused_adamw(self.model.parameters())
        self.session: ampinit.AmpSession | None = None
        self._amp_state: dict[str, Any] | None = None
        self._steps = 0
        self._skipped = 0
        if not self.sets_thread_autocast:
            self._open()

    def _open(self) -> None:
        self.model, self.optimizer = amp.initialize(
            self.model,
            self.optimizer,
            opt_level=self.level,
            verbosity=0,
            cast_policy=self.cast_policy,
            skip_nonfinite=self.skip_nonfinite,
            master_weights=self.master_weights,
        )
        self.session = ampinit.session_of(self.optimizer)
        assert self.session is not None, f"{self.name}: initialize() registered no session"
        if self._amp_state is not None:
            self.session.load_state_dict(self._amp_state)

    def _close(self) -> None:
        assert self.session is not None
        stats = self.session.stats()
        self._steps += stats.steps
        self._skipped += stats.skipped_steps
        self._amp_state = self.session.state_dict()
        self.session.close()
        self.session = None

    def enter(self) -> None:
        if self.sets_thread_autocast:
            self._open()

    def leave(self) -> None:
        if self.sets_thread_autocast:
            self._close()

    def shutdown(self) -> None:
        if self.session is not None:
            self._close()

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(self.inputs), self.target)
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        self.optimizer.step()
        return loss

    def details(self) -> dict[str, Any]:
        steps, skipped = self._steps, self._skipped
        scale = (self._amp_state or {}).get("loss_scaler0", {}).get("loss_scale")
        if self.session is not None:
            stats = self.session.stats()
            steps, skipped, scale = steps + stats.steps, skipped + stats.skipped_steps, stats.loss_scales[0]
        return {"amp_steps": steps, "skipped_steps": skipped, "loss_scale": scale}


def ampinit_name(
    level: str, cast_policy: str = "apex", skip_nonfinite: bool = True, master_weights: str | None = None
) -> str:
    """The name :class:`AmpinitVariant` gives itself for these settings."""
    name = f"ampinit {level}" + (" native lists" if cast_policy == "native" else "")
    name += "" if skip_nonfinite else " unchecked"
    return name + (f" {master_weights}" if master_weights else "")


def variant_factories(make: Callable[[], Workload]) -> dict[str, Callable[[], Variant]]:
    """Name -> builder of every variant, each on a fresh workload from ``make`` (all start from the same weights)."""
    factories: dict[str, Callable[[], Variant]] = {
        FP32: lambda: NativeVariant(FP32, make(), None),
        AUTOCAST_BF16: lambda: NativeVariant(AUTOCAST_BF16, make(), torch.bfloat16),
        AUTOCAST_FP16: lambda: NativeVariant(AUTOCAST_FP16, make(), torch.float16),
        PURE_BF16: lambda: PureBf16Variant(make()),
    }
    settings: list[dict[str, Any]] = [{"level": level} for level in OPT_LEVELS]
    # O5 with 16-bit remainder masters: bf16 weight + int16 low half instead of an fp32 master.
    settings.append({"level": "O5", "master_weights": "remainder"})
    # O4 with PyTorch's own op lists is like-for-like with native autocast; the default (Apex's lists) also
    # runs layer_norm, gelu, softmax... in fp32, which costs casts and buys fp32 numerics.
    settings.append({"level": "O4", "cast_policy": "native"})
    # The price of the inf/NaN check at the levels Apex never checked: skip_nonfinite=False is Apex's behaviour.
    settings += [{"level": level, "skip_nonfinite": False} for level in ("O0", "O3", "O4")]
    for kwargs in settings:
        level = kwargs.pop("level")
        factories[ampinit_name(level, **kwargs)] = functools.partial(_ampinit_variant, make, level, kwargs)
    return factories


def _ampinit_variant(make: Callable[[], Workload], level: str, kwargs: dict[str, Any]) -> Variant:
    return AmpinitVariant(level, make(), **kwargs)


def build_variants(make: Callable[[], Workload], only: Sequence[str] = ()) -> list[Variant]:
    """Every variant (or those named in ``only``), each on a fresh workload from ``make``."""
    factories = variant_factories(make)
    unknown = [name for name in only if name not in factories]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; known: {list(factories)}")
    return [factory() for name, factory in factories.items() if not only or name in only]


# -- peak memory ---------------------------------------------------------------------------------------------
def _proc_status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _train(variant: Variant, steps: int) -> None:
    variant.enter()
    try:
        for _ in range(steps):
            variant.step()
    finally:
        variant.leave()
    if isinstance(variant, AmpinitVariant):
        variant.shutdown()


def peak_rss_growth(make: Callable[[], Workload], warm_make: Callable[[], Workload], name: str, steps: int) -> float:
    """MiB by which this process's peak RSS grows while ``name`` is built and trains ``steps`` steps.

    Run in a fresh process per measurement (``--peak-rss-of``). The variant first trains two steps on the small
    ``warm_make`` workload, so that the code pages and kernel caches torch loads on first use are resident
    before the baseline; then the peak RSS mark is reset (Linux ``/proc/self/clear_refs``), the real workload
    and variant are built and trained, and the mark is read. Everything a variant holds counts: weights,
    masters or remainders, optimizer state, grads, activations, temporaries of the step.
    """
    _train(variant_factories(warm_make)[name](), 2)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _proc_status_kib("VmRSS")
    _train(variant_factories(make)[name](), steps)
    return (_proc_status_kib("VmHWM") - baseline) / 1024


def measure_peak_memory(names: Sequence[str], quick: bool, repeats: int, steps: int) -> dict[str, list[float]]:
    """Peak RSS growth (MiB) of each MLP variant, ``repeats`` fresh processes each, in interleaved order.

    The children run with glibc's mmap threshold fixed at 64 KiB: every tensor of that size or more is then its
    own mapping, returned to the system when freed, so RSS follows the live tensors. With glibc's default
    (a threshold that rises to the size of the largest block freed so far) freed temporaries stay in the heap
    and the peak says more about the allocator's history than about the variant.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            command = [sys.executable, "-m", "benchmarks.amp_step", "--peak-rss-of", name, "--steps", str(steps)]
            output = subprocess.run(
                [*command, *(["--quick"] if quick else [])], check=True, capture_output=True, text=True, env=env
            ).stdout
            results[name].append(float(json.loads(output.splitlines()[-1])["peak_mib"]))
    return results


# -- timing --------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """The per-round samples of one variant, and the fastest step seen so far (warm-up included)."""

    best_ms: float
    samples_ms: list[float] = field(default_factory=list)
    block_steps: list[int] = field(default_factory=list)
    last_loss: float = float("nan")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def next_block(self, steps: int, max_block_s: float) -> int:
        """``steps``, or fewer (at least one) when ``steps`` of the fastest step so far exceed ``max_block_s``.

        Sized on the fastest step, not the last, so that a step slowed down by another process does not shrink
        later blocks; a variant that really is slow (fp16 on a CPU without fp16 arithmetic) gets short blocks
        and cannot dominate the run time.
        """
        return max(1, min(steps, int(max_block_s * 1e3 / max(self.best_ms, 1e-3))))


def _check_autocast_off(variant: Variant, when: str) -> None:
    if torch.is_autocast_enabled("cpu"):
        raise RuntimeError(f"autocast is on in this thread {when} {variant.name!r}: an O1/O4 session leaked")


def run_block(variant: Variant, steps: int) -> tuple[float, float]:
    """Run ``steps`` steps of ``variant``; return (ms per step, last loss). Only the steps are timed."""
    _check_autocast_off(variant, "before")
    variant.enter()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            loss = variant.step()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
        variant.leave()
    _check_autocast_off(variant, "after")
    return elapsed * 1e3 / steps, float(loss.detach())


def warm_up(variant: Variant, steps: int, budget_s: float) -> float:
    """Run ``steps`` untimed steps, or fewer once ``budget_s`` is spent; return the ms of the fastest one.

    At least two steps run: the first pays one-time costs (lazy state, allocator growth). The fastest step,
    not the last, sizes the blocks, so that one step slowed down by another process does not shrink them.
    """
    _check_autocast_off(variant, "before")
    variant.enter()
    try:
        spent, fastest = 0.0, float("inf")
        for done in range(1, steps + 1):
            start = time.perf_counter()
            variant.step()
            elapsed = time.perf_counter() - start
            spent += elapsed
            if done >= 2:
                fastest = min(fastest, elapsed)
                if spent > budget_s:
                    break
    finally:
        variant.leave()
    _check_autocast_off(variant, "after")
    return fastest * 1e3


def measure(variants: Sequence[Variant], rounds: int, steps: int, warmup: int, max_block_s: float) -> dict[str, Timing]:
    """Warm every variant up, then time them in ``rounds`` interleaved rounds with a rotating order.

    Every variant gives one sample (ms per step of one block) a round; see :meth:`Timing.next_block` for the
    block sizes.
    """
    timings = {variant.name: Timing(best_ms=warm_up(variant, warmup, max_block_s)) for variant in variants}
    for r in range(rounds):
        shift = r % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            timing = timings[variant.name]
            block = timing.next_block(steps, max_block_s)
            ms, timing.last_loss = run_block(variant, block)
            timing.samples_ms.append(ms)
            timing.block_steps.append(block)
            timing.best_ms = min(timing.best_ms, ms)
    return timings


# -- report --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A goal on a ratio of step times, judged on medians; the ratio of minima is shown beside it."""

    description: str
    value: float
    value_of_minima: float
    threshold: float
    at_least: bool  # True: value >= threshold; False: value <= threshold

    @property
    def met(self) -> bool:
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold

    def line(self) -> str:
        op = ">=" if self.at_least else "<="
        verdict = "MET" if self.met else "NOT MET"
        return (
            f"  {self.description}: {self.value:.3f} (target {op} {self.threshold:.2f})  {verdict}"
            f"  [from minima: {self.value_of_minima:.3f}]"
        )


def mlp_targets(rows: dict[str, dict[str, Any]]) -> list[Target]:
    """The MLP goals of ampinit's bf16 levels, each a ratio of step times of two variants."""

    def target(description: str, numerator: str, denominator: str, threshold: float, at_least: bool) -> Target:
        ratio = {stat: rows[numerator][stat] / rows[denominator][stat] for stat in ("median_ms", "min_ms")}
        return Target(description, ratio["median_ms"], ratio["min_ms"], threshold, at_least)

    present = [t for t in _MLP_TARGET_NAMES if t in rows]
    if len(present) < len(_MLP_TARGET_NAMES):
        return []  # a run restricted with --only: no targets
    return [
        target("O5 speedup over native autocast bf16 (autocast ms / O5 ms)", AUTOCAST_BF16, "ampinit O5", 1.05, True),
        target("O5 cost over pure bf16 (O5 ms / pure bf16 ms)", "ampinit O5", PURE_BF16, 1.10, False),
        target(
            "O5 remainder speedup over native autocast bf16 (autocast ms / O5 remainder ms)",
            AUTOCAST_BF16,
            O5_REMAINDER,
            1.05,
            True,
        ),
        target(
            "O4 native lists cost over native autocast bf16 (O4 ms / autocast ms)",
            "ampinit O4 native lists",
            AUTOCAST_BF16,
            1.03,
            False,
        ),
        # Apex's lists run layer_norm, gelu, softmax... in fp32: their bytes, not only the casts (docs/cast-policy.md).
        target(
            "O4 (Apex's lists) cost over native autocast bf16 (O4 ms / autocast ms)",
            "ampinit O4",
            AUTOCAST_BF16,
            1.05,
            False,
        ),
    ]


_MLP_TARGET_NAMES = (AUTOCAST_BF16, "ampinit O5", PURE_BF16, "ampinit O4 native lists", O5_REMAINDER)


def summarize(variants: Sequence[Variant], timings: dict[str, Timing]) -> dict[str, dict[str, Any]]:
    median = {name: t.median_ms for name, t in timings.items()}
    rows: dict[str, dict[str, Any]] = {}
    for variant in variants:
        t = timings[variant.name]
        row: dict[str, Any] = {
            "median_ms": t.median_ms,
            "min_ms": min(t.samples_ms),
            "max_ms": max(t.samples_ms),
            "samples_ms": t.samples_ms,
            "block_steps": t.block_steps,
            "speedup_vs_fp32": median[FP32] / t.median_ms if FP32 in median else float("nan"),
            "speedup_vs_autocast_bf16": median[AUTOCAST_BF16] / t.median_ms
            if AUTOCAST_BF16 in median
            else float("nan"),
            "last_loss": t.last_loss,
            **variant.details(),
        }
        if variant.name in ("ampinit O5", O5_REMAINDER) and PURE_BF16 in median:
            row["speedup_vs_pure_bf16"] = median[PURE_BF16] / t.median_ms
        rows[variant.name] = row
    return rows


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'variant':<34} {'median ms':>10} {'min ms':>8} {'steps':>5} {'x fp32':>7} {'x ac bf16':>9} "
        f"{'x pure bf16':>11} {'skipped':>7} {'last loss':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        pure = f"{row['speedup_vs_pure_bf16']:.3f}" if "speedup_vs_pure_bf16" in row else ""
        skipped = f"{row['skipped_steps']}" if "skipped_steps" in row else ""
        lines.append(
            f"{name:<34} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {max(row['block_steps']):>5} "
            f"{row['speedup_vs_fp32']:>7.3f} {row['speedup_vs_autocast_bf16']:>9.3f} {pure:>11} {skipped:>7} "
            f"{row['last_loss']:>10.4g}"
        )
    return "\n".join(lines)


def cpu_flags() -> dict[str, bool]:
    """The CPU features that decide bf16/fp16 speed (Linux only; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {name: name in flags for name in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")}


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "ampinit": ampinit.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "platform": platform.platform(),
    }


# -- main ----------------------------------------------------------------------------------------------------
def workloads(quick: bool) -> dict[str, Callable[[], Workload]]:
    """Name -> builder (seed 0). ``quick`` shrinks both so that a smoke run stays short."""
    if quick:
        return {
            "mlp": functools.partial(make_mlp, 0, batch_size=128, features=512),
            "checkerboard": functools.partial(make_checkerboard, 0, batch_size=4, grid=16, width=64),
        }
    return {"mlp": functools.partial(make_mlp, 0), "checkerboard": functools.partial(make_checkerboard, 0)}


def describe(workload: Workload) -> str:
    model, inputs, target, _ = workload
    params = sum(p.numel() for p in model.parameters())
    return (
        f"{type(model).__name__}, {params:,} parameters, input {tuple(inputs.shape)}, "
        f"target {tuple(target.shape)}, {type(workload.loss_fn).__name__}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, small sizes (< 60 s)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 10; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 10; quick 3)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed warm-up steps per variant, at least 2 (default 3; quick 2)"
    )
    parser.add_argument(
        "--max-block-seconds",
        type=float,
        default=1.0,
        help="a variant whose warm-up step time times --steps exceeds this runs fewer steps per block (>= 1)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated variant names to run (default: all), e.g. 'native autocast bf16,ampinit O5'",
    )
    parser.add_argument(
        "--memory",
        type=int,
        default=0,
        metavar="REPEATS",
        help="also measure each MLP variant's peak RSS growth, in REPEATS fresh processes per variant (Linux)",
    )
    parser.add_argument("--peak-rss-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where to write results (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    defaults = (3, 3, 2) if args.quick else (10, 10, 3)
    for name, default, minimum in zip(("rounds", "steps", "warmup"), defaults, (1, 1, 2)):
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < minimum:
            parser.error(f"--{name} must be >= {minimum}, got {getattr(args, name)}")
    if args.max_block_seconds <= 0:
        parser.error(f"--max-block-seconds must be > 0, got {args.max_block_seconds}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peak_rss_of is not None:  # the child process of measure_peak_memory
        peak = peak_rss_growth(
            workloads(args.quick)["mlp"], workloads(True)["mlp"], args.peak_rss_of, args.warmup + args.steps
        )
        print(json.dumps({"variant": args.peak_rss_of, "peak_mib": peak}))
        return
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    env = environment()
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in env["cpu_flags"].items()) or "unknown"
    print(
        f"torch {env['torch']}, ampinit {env['ampinit']}, {env['threads']} threads, "
        f"CPU capability {env['cpu_capability']} ({flags})"
    )
    print(
        f"rounds={args.rounds} steps/block={args.steps} warmup={args.warmup} "
        f"max-block-seconds={args.max_block_seconds} quick={args.quick}; fused AdamW everywhere"
    )
    report: dict[str, Any] = {
        "benchmark": "amp_step",
        "environment": env,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "workloads": {},
    }
    started = time.perf_counter()
    for key, make in workloads(args.quick).items():
        description = describe(make())
        variants = build_variants(make, only)
        try:
            timings = measure(variants, args.rounds, args.steps, args.warmup, args.max_block_seconds)
        finally:
            for variant in variants:
                if isinstance(variant, AmpinitVariant):
                    variant.shutdown()
        rows = summarize(variants, timings)
        print(f"\n== {key}: {description} ==")
        print(format_table(rows))
        entry: dict[str, Any] = {"description": description, "variants": rows}
        if key == "mlp":
            targets = mlp_targets(rows)
            if targets:
                print("targets (judged on medians):")
                print("\n".join(t.line() for t in targets))
                entry["targets"] = [{**vars(t), "met": t.met} for t in targets]
            if args.memory:
                names = [v.name for v in variants if v.name != AUTOCAST_FP16]
                memory = measure_peak_memory(names, args.quick, args.memory, args.warmup + args.steps)
                entry["peak_rss_growth_mib"] = memory
                print("peak RSS growth, MiB (median of fresh processes; workload + variant + training steps):")
                for name, samples in memory.items():
                    print(f"  {name:<34} {statistics.median(samples):8.1f}   {sorted(round(m, 1) for m in samples)}")
        report["workloads"][key] = entry
    report["wall_seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwall time {report['wall_seconds']:.0f} s; results written to {args.json}")


if __name__ == "__main__":
    main()
