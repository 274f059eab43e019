"""Quality of the precision dial (issue 26): held-out loss of a character-level decoder after N AdamW steps per
setting, against O5 with fp32 masters.

The corpus ships with Python: the bytes of the standard library's top-level ``.py`` files
(``sysconfig.get_paths()["stdlib"]``, sorted by name); every 10th file is held out. Tokens are bytes (vocabulary
256). Every setting starts from the same fp32 weights and sees the same batches in the same order (one seeded
generator per setting); the held-out loss is the mean over a fixed set of held-out windows, computed once after
the last step. Settings that the installed ampinit refuses (an option it does not have yet) become rows with the
error, and the run goes on.

With ``--seeds N`` every seed draws its own initial weights and batch order (seed 0 is the single-seed run), every
setting trains from that seed's weights, and a setting's figure is the mean over seeds of its loss ratio to the same
seed's fp32-masters loss. Its spread is the standard error of that mean: the bounds are on a setting's expected
quality, and a standard error shrinks as seeds are added while a min-max range only widens. The verdict is "met" when
the one-sided 95% Student-t upper bound of the mean is within the target, "not met" when the lower bound is above
it, and "not resolved" otherwise. The JSON is rewritten after every seed, so a run stopped early keeps its seeds.

    PYTHONPATH=. nice -n 10 python benchmarks/precision_quality.py               # 2,000 steps per setting
    PYTHONPATH=. python benchmarks/precision_quality.py --seeds 5 --only "O5 fp32 masters,O5 remainder + 8bit"
    PYTHONPATH=. python benchmarks/precision_quality.py --quick                  # smoke run, seconds

Seeds may be run apart (``--first-seed 5 --seeds 5`` for seeds 5-9, on another machine or day) and put together
without training (``--combine a.json b.json --json all.json``): the ratios are per seed, so runs of the same
settings and configuration combine whatever machine ran them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ampinit
from ampinit import amp
from benchmarks.gpu_train_step import GPT, GPTShape, lm_loss

DEFAULT_JSON = Path("benchmarks/results/precision_quality.json")
REFERENCE = "O5 fp32 masters"
HELD_OUT_EVERY = 10  # file i (sorted) is held out when i % 10 == 9
BATCH_ORDER_SEED = 1234  # seed s draws its batches from a generator seeded with BATCH_ORDER_SEED + s
CONFIDENCE = 0.95  # one-sided, for the multi-seed verdicts


# -- data --------------------------------------------------------------------------------------------------------
def corpus(max_files: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, held-out bytes) of the standard library's top-level ``.py`` files, split by file."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]
    train, held_out = bytearray(), bytearray()
    for i, path in enumerate(files):
        (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(path.read_bytes())
    return torch.frombuffer(train, dtype=torch.uint8).long(), torch.frombuffer(held_out, dtype=torch.uint8).long()


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(context + 1)
    chunk = data[offsets]
    return chunk[:, :-1], chunk[:, 1:]


# -- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    batch: int = 8


def char_decoder(shape: Shape) -> nn.Module:
    """A pre-LayerNorm GPT over bytes: the GPU benchmark's GPT (tanh GELU blocks, learned positions) with an untied
    256-way head."""
    return GPT(
        GPTShape(layers=shape.layers, d_model=shape.d_model, heads=shape.heads, seq=shape.context, vocab=256),
        tied=False,
    )


# -- the settings ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    name: str
    amp_options: dict[str, Any] | None  # None: native torch
    autocast: bool = False
    target: float | None = None  # the largest allowed loss ratio to the reference row


SETTINGS = [
    Setting("native fp32 AdamW", None),
    Setting(REFERENCE, {}),
    Setting("O5 remainder", {"master_weights": "remainder"}),
    Setting("O5 remainder + 8bit", {"master_weights": "remainder", "optimizer_state": "8bit"}, target=1.003),
    Setting("O5 remainder8", {"master_weights": "remainder8"}, target=1.01),
    Setting("O5 remainder8 + 8bit", {"master_weights": "remainder8", "optimizer_state": "8bit"}, target=1.01),
    Setting("O5 stochastic (no masters)", {"master_weights": "stochastic"}, target=1.01),
    Setting("O5 stochastic + bf16", {"master_weights": "stochastic", "optimizer_state": "bf16"}, target=1.01),
    Setting("O5 stochastic + 8bit", {"master_weights": "stochastic", "optimizer_state": "8bit"}, target=1.01),
    Setting("O5 pure bf16 (no masters or SR)", {"master_weights": False}),
    Setting("native autocast bf16", None, autocast=True),
]


@dataclass(frozen=True)
class Config:
    shape: Shape
    steps: int
    lr: float
    warmup: int
    eval_windows: int
    max_files: int | None


def lr_factor(config: Config) -> Callable[[int], float]:
    """Linear warm-up, then a cosine decay to a tenth: late updates are small, where bf16 rounding bites."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def train(
    setting: Setting, initial: nn.Module, data: tuple[torch.Tensor, torch.Tensor], config: Config, seed: int = 0
) -> float:
    """Train a copy of ``initial`` for ``config.steps`` steps on seed ``seed``'s batch order; return its mean
    held-out loss."""
    train_data, held_out = data
    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    session = None
    if setting.amp_options is not None:
        model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **setting.amp_options)
        session = ampinit.session_of(opt)
    try:
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(config))
        context, batch = config.shape.context, config.shape.batch
        gen = torch.Generator().manual_seed(BATCH_ORDER_SEED + seed)
        for _ in range(config.steps):
            starts = torch.randint(0, len(train_data) - context - 1, (batch,), generator=gen)
            x, y = windows(train_data, starts, context)
            opt.zero_grad(set_to_none=True)
            if session is not None:
                loss = lm_loss(model(x), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting.autocast):
                    loss = lm_loss(model(x), y)
                loss.backward()
            opt.step()
            schedule.step()
        return held_out_loss(model, held_out, config, setting.autocast)
    finally:
        if session is not None:
            session.close()


@torch.no_grad()
def held_out_loss(model: nn.Module, held_out: torch.Tensor, config: Config, autocast: bool) -> float:
    context = config.shape.context
    gen = torch.Generator().manual_seed(99)
    starts = torch.randint(0, len(held_out) - context - 1, (config.eval_windows,), generator=gen)
    total = 0.0
    for some in starts.split(64):
        x, y = windows(held_out, some, context)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total += lm_loss(model(x), y).item() * len(some)
    return total / config.eval_windows


# -- report ------------------------------------------------------------------------------------------------------
def run(settings: Sequence[Setting], config: Config, seed: int = 0) -> dict[str, dict[str, Any]]:
    """One seed: every setting trains from the same initial weights (``torch.manual_seed(seed)``, which the
    stochastic settings also take as their rounding seed) on the same batches."""
    data = corpus(config.max_files)
    torch.manual_seed(seed)
    initial = char_decoder(config.shape)
    rows: dict[str, dict[str, Any]] = {}
    for setting in settings:
        started = time.perf_counter()
        try:
            loss = train(setting, initial, data, config, seed)
        except (TypeError, ValueError) as error:  # an option this ampinit does not have (yet)
            rows[setting.name] = {"error": f"{type(error).__name__}: {error}", "target": setting.target}
        else:
            rows[setting.name] = {"loss": loss, "seconds": time.perf_counter() - started, "target": setting.target}
        print(f"  {setting.name}: {rows[setting.name]}", flush=True)
    reference = rows.get(REFERENCE, {}).get("loss")
    for row in rows.values():
        if "loss" in row and reference is not None:
            row["ratio"] = row["loss"] / reference
            if row["target"] is not None:
                row["met"] = row["ratio"] <= row["target"]
    return rows


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p in (0.5, 1)) of Student's t with ``df`` degrees of freedom. With t = sqrt(df) tan(a),
    P(0 < T < t) is proportional to the integral of cos(a)^(df - 1) from 0 to a, a smooth integrand that Simpson's
    rule integrates closely; the angle is found by bisection."""
    if not 0.5 < p < 1:
        raise ValueError(f"p must be in (0.5, 1), got {p!r}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")

    def integral(angle: float, intervals: int = 2000) -> float:
        h = angle / intervals
        ends = 1.0 + math.cos(angle) ** (df - 1)
        odd = sum(math.cos((2 * i - 1) * h) ** (df - 1) for i in range(1, intervals // 2 + 1))
        even = sum(math.cos(2 * i * h) ** (df - 1) for i in range(1, intervals // 2))
        return h / 3 * (ends + 4 * odd + 2 * even)

    wanted = (2 * p - 1) * integral(math.pi / 2)
    low, high = 0.0, math.pi / 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if integral(middle) < wanted else (low, middle)
    return math.sqrt(df) * math.tan((low + high) / 2)


def aggregate(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per setting, over the seeds run so far: the mean of its per-seed ratios to that seed's reference loss, their
    standard error and range, a one-sided ``CONFIDENCE`` interval of the mean, and the verdict against the target.
    A setting that failed on any seed keeps that seed's error."""
    rows: dict[str, dict[str, Any]] = {}
    for name, first in per_seed[0].items():
        seeds = [rows_of_seed[name] for rows_of_seed in per_seed]
        failed = next((row for row in seeds if "error" in row), None)
        if failed is not None:
            rows[name] = {"error": failed["error"], "target": first["target"], "seeds": len(seeds)}
            continue
        losses = [row["loss"] for row in seeds]
        row: dict[str, Any] = {
            "seeds": len(seeds),
            "losses": losses,
            "loss": sum(losses) / len(losses),
            "seconds": sum(row["seconds"] for row in seeds),
            "target": first["target"],
        }
        if all("ratio" in row for row in seeds):
            ratios = [row["ratio"] for row in seeds]
            mean = sum(ratios) / len(ratios)
            row.update(ratios=ratios, ratio=mean, min=min(ratios), max=max(ratios))
            if len(ratios) > 1:
                variance = sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)
                row["stderr"] = math.sqrt(variance / len(ratios))
                half = t_quantile(CONFIDENCE, len(ratios) - 1) * row["stderr"]
                row["interval"] = [mean - half, mean + half]
            if row["target"] is not None:
                row["verdict"] = judge(row.get("interval"), row["target"])
        rows[name] = row
    return rows


def judge(interval: Sequence[float] | None, target: float) -> str:
    """Met only when the whole one-sided interval is within the target, not met only when it is all above it."""
    if interval is None:
        return "not resolved"
    low, high = interval
    if high <= target:
        return "met"
    if low > target:
        return "not met"
    return "not resolved"


def verdict(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return ""
    if "met" not in row:
        return f"<= {row['target']:.3f}: not measured"
    return f"<= {row['target']:.3f}: {'MET' if row['met'] else 'NOT MET'}"


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"| setting | held-out loss | x {REFERENCE} | target | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | error: {row['error']} | | {verdict(row)} | |")
            continue
        ratio = f"{row['ratio']:.4f}" if "ratio" in row else ""
        lines.append(f"| {name} | {row['loss']:.4f} | {ratio} | {verdict(row)} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def seeds_markdown(rows: dict[str, dict[str, Any]]) -> str:
    seeds = max(row["seeds"] for row in rows.values())
    lines = [
        f"| setting | seeds | x {REFERENCE}, mean | standard error | min - max | one-sided {CONFIDENCE:.0%} bounds "
        "| target | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        target = "" if row["target"] is None else f"<= {row['target']:.3f}"
        if "error" in row:
            lines.append(f"| {name} | {row['seeds']} | error: {row['error']} | | | | {target} | not measured |")
            continue
        if "ratio" not in row:
            lines.append(f"| {name} | {row['seeds']} | (no reference row) | | | | {target} | |")
            continue
        stderr = f"{row['stderr']:.4f}" if "stderr" in row else ""
        interval = f"{row['interval'][0]:.4f} - {row['interval'][1]:.4f}" if "interval" in row else ""
        judged = row.get("verdict", "")
        if judged == "not resolved":
            judged = f"not resolved at {seeds} seed{'s' if seeds > 1 else ''}"
        lines.append(
            f"| {name} | {row['seeds']} | {row['ratio']:.4f} | {stderr} | {row['min']:.4f} - {row['max']:.4f} "
            f"| {interval} | {target} | {judged} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {
        "cpu": model or platform.processor(),
        "torch": torch.__version__,
        "ampinit": ampinit.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for the block; the caller's comes back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 20 files, a few steps")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps per setting (default 2000; quick 4)")
    parser.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: on a shared machine 2 threads ran 15x slower)"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="seeds 0..N-1, each its own initial weights and batch order (default 1)"
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first seed of the run (default 0): runs of other seeds, on other machines or days, are combined "
        "with --combine",
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="train nothing: aggregate the seeds of these multi-seed JSON files (same settings and configuration, "
        "no seed twice) into --json",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 2000
    for name in ("steps", "threads", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.first_seed < 0:
        parser.error(f"--first-seed must be >= 0, got {args.first_seed}")
    return args


def combine(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One multi-seed report from several (their seeds together); ``SystemExit`` naming what differs when they are
    not runs of the same settings and configuration, or when a seed appears twice."""
    if not reports:
        raise SystemExit("--combine needs at least one file")
    first = reports[0]
    seeds: list[int] = []
    per_seed: list[dict[str, dict[str, Any]]] = []
    for index, report in enumerate(reports):
        if "per_seed" not in report:
            raise SystemExit(
                f"--combine file {index + 1} is not a multi-seed report (run it with --seeds or --first-seed)"
            )
        if report["config"] != first["config"]:
            raise SystemExit(
                f"--combine file {index + 1} has another configuration: {report['config']} != {first['config']}"
            )
        if report["per_seed"][0].keys() != first["per_seed"][0].keys():
            raise SystemExit(f"--combine file {index + 1} ran other settings: {sorted(report['per_seed'][0])}")
        numbers = report.get("seed_numbers", list(range(len(report["per_seed"]))))
        repeated = sorted(set(numbers) & set(seeds))
        if repeated:
            raise SystemExit(f"--combine: seeds {repeated} appear in more than one file")
        seeds += numbers
        per_seed += report["per_seed"]
    rows = aggregate(per_seed)
    table = seeds_markdown(rows)
    return {
        "benchmark": "precision_quality",
        "machines": [report["machine"] for report in reports],
        "config": first["config"],
        "seeds": len(seeds),
        "seeds_done": len(seeds),
        "seed_numbers": seeds,
        "rows": rows,
        "per_seed": per_seed,
        "markdown": table,
        "wall_seconds": sum(report["wall_seconds"] for report in reports),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.combine is not None:
        report = combine([json.loads(path.read_text()) for path in args.combine])
        print(report["markdown"])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{report['seeds']} seeds from {len(args.combine)} files; results written to {args.json}")
        return report
    with threads(args.threads):
        if args.quick:
            config = Config(Shape(layers=1, d_model=32, heads=2, context=16, batch=4), args.steps, 3e-3, 2, 8, 20)
        else:
            config = Config(Shape(), args.steps, 3e-3, 100, 512, None)
        only = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = only - {s.name for s in SETTINGS}
        if unknown:
            raise SystemExit(f"--only names unknown settings {sorted(unknown)}; known: {[s.name for s in SETTINGS]}")
        settings = [s for s in SETTINGS if not only or s.name in only]
        several = args.seeds > 1 or args.first_seed > 0
        if several and REFERENCE not in {s.name for s in settings}:
            raise SystemExit(f"a multi-seed run reports ratios to {REFERENCE!r}: add it to --only")
        env = machine()
        print(f"{env['cpu']}, torch {env['torch']}, ampinit {env['ampinit']}, {env['threads']} threads; {config}")
        started = time.perf_counter()
        header = {
            "benchmark": "precision_quality",
            "machine": env,
            "config": {**vars(config), "shape": vars(config.shape)},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if not several:
            rows = run(settings, config)
            table = markdown(rows)
            print(table)
            report = {**header, "rows": rows, "markdown": table, "wall_seconds": time.perf_counter() - started}
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        else:
            per_seed: list[dict[str, dict[str, Any]]] = []
            numbers = list(range(args.first_seed, args.first_seed + args.seeds))
            for seed in numbers:
                print(f"seed {seed}:", flush=True)
                per_seed.append(run(settings, config, seed))
                rows = aggregate(per_seed)
                table = seeds_markdown(rows)
                print(table, flush=True)
                report = {
                    **header,
                    "seeds": args.seeds,
                    "seeds_done": len(per_seed),
                    "seed_numbers": numbers[: len(per_seed)],
                    "rows": rows,
                    "per_seed": per_seed,
                    "markdown": table,
                    "wall_seconds": time.perf_counter() - started,
                }
                args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wall time {report['wall_seconds']:.0f} s; results written to {args.json}")
        return report


if __name__ == "__main__":
    main()
