"""Train-step time and peak memory of every opt level against native PyTorch precision, on a GPU (or, with
``--tiny``, on any device as a smoke run).

Workloads: (a) the MLP of ``benchmarks/models.py`` (what ``benchmarks/amp_step.py`` times on CPU) and (b) a
GPT-2-small-shaped decoder (12 layers, d_model 768, 12 heads, sequence 1024, vocabulary 50257, batch
``--batch``). Variants: native fp32, native autocast bf16, native autocast fp16 + GradScaler, pure bf16
(``model.bfloat16()``) and ampinit O0-O5; every one steps fused AdamW. A step is zero_grad + forward + loss +
backward + optimizer step. Each variant builds its own model (same seed), runs ``--warmup`` steps, then
``--steps`` timed steps between device synchronisations; peak memory is ``torch.cuda.max_memory_allocated``
over the variant's whole run (None off CUDA). One variant lives at a time, so peaks do not mix.

    python -m benchmarks.gpu_train_step --out results/            # on a GPU
    python -m benchmarks.gpu_train_step --tiny --device cpu --out /tmp/x   # smoke run, seconds

Targets (judged on CUDA only, transformer): O2 and O5 step time <= native autocast of the same dtype / 1.15 and
peak memory <= it; O1 and O4 step time <= 1.03x native autocast of their dtype. See docs/gpu.md.

A variant that raises becomes a row with its error (the target that needs it is not met) and the run goes on;
the JSON and Markdown are rewritten after every variant, so a run cut short keeps what it measured. The exit
status is 1 when any variant failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import ampinit
from ampinit import _registry, amp
from ampinit._types import OPT_LEVELS
from benchmarks.models import make_mlp

FP32, AUTOCAST_BF16, AUTOCAST_FP16, PURE_BF16 = (
    "native fp32",
    "native autocast bf16",
    "native autocast fp16 + GradScaler",
    "pure bf16",
)
PLAIN_ADAMW = "plain fused AdamW (fp32)"
VARIANTS = (FP32, AUTOCAST_BF16, AUTOCAST_FP16, PURE_BF16, *OPT_LEVELS)
# (level, native baseline it is judged against, max time ratio, whether peak memory must not exceed it)
TARGETS = (
    ("O2", AUTOCAST_FP16, 1 / 1.15, True),
    ("O5", AUTOCAST_BF16, 1 / 1.15, True),
    ("O1", AUTOCAST_FP16, 1.03, False),
    ("O4", AUTOCAST_BF16, 1.03, False),
)


# -- the transformer -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTShape:
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    seq: int = 1024
    vocab: int = 50257


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.ln1 = nn.LayerNorm(shape.d_model)
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)
        self.ln2 = nn.LayerNorm(shape.d_model)
        self.fc = nn.Linear(shape.d_model, 4 * shape.d_model)
        self.out = nn.Linear(4 * shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2's layout (pre-LayerNorm blocks, learned positions, tied embedding and head)."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.d_model)
        self.pos = nn.Embedding(shape.seq, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


# -- workloads ---------------------------------------------------------------------------------------------------
Workload = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def make_workload(name: str, device: torch.device, tiny: bool, batch: int) -> Workload:
    torch.manual_seed(0)
    if name == "mlp":
        model, x, y, loss_fn = make_mlp(batch_size=32, features=64, depth=2) if tiny else make_mlp()
        return model.to(device), x.to(device), y.to(device), loss_fn
    shape = GPTShape(layers=2, d_model=64, heads=4, seq=32, vocab=256) if tiny else GPTShape()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(shape.vocab, (batch, shape.seq + 1), generator=gen).to(device)
    return GPT(shape).to(device), tokens[:, :-1], tokens[:, 1:], lm_loss


# -- one variant ---------------------------------------------------------------------------------------------
def make_step(variant: str, workload: Workload, device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one training step, teardown) for ``variant`` on its own copy of the workload."""
    model, x, y, loss_fn = workload
    if variant == PURE_BF16:
        model = model.bfloat16()
        x = x.bfloat16() if x.is_floating_point() else x
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if variant in OPT_LEVELS:
        amp.initialize(model, opt, opt_level=variant, verbosity=0)

        def amp_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()

        return amp_step, ampinit.deinitialize

    autocast_dtype = {AUTOCAST_BF16: torch.bfloat16, AUTOCAST_FP16: torch.float16}.get(variant)
    scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 else None

    def native_step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return native_step, lambda: None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(
    variant: str, workload_name: str, device: torch.device, args: argparse.Namespace
) -> dict[str, float | None]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    workload = make_workload(workload_name, device, args.tiny, args.batch)
    step, teardown = make_step(variant, workload, device)
    try:
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.repeats):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            synchronize(device)
            times.append((time.perf_counter() - start) / args.steps)
    finally:
        teardown()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del workload, step
    return {"ms_per_step": statistics.median(times) * 1e3, "peak_mib": peak}


# -- master step ---------------------------------------------------------------------------------------------
def _master_variant(name: str, sizes: list[int], device: torch.device) -> tuple[Callable[[], None], bool]:
    """(one optimizer step, whether it opened an amp session) for the plain baseline or an opt level."""
    gen = torch.Generator().manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(n, generator=gen).to(device) * 0.01) for n in sizes])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if name == PLAIN_ADAMW:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        return opt.step, False
    amp.initialize(model, opt, opt_level=name, verbosity=0)
    grads = [torch.randn_like(p) for p in model.parameters()]
    anchor = torch.zeros((), device=device, requires_grad=True)

    def step() -> None:
        # The grads are written directly, so only the amp machinery and the optimizer are timed.
        with amp.scale_loss(anchor * 1.0, opt) as scaled:
            scaled.backward()
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        opt.step()

    return step, True


def master_step(
    device: torch.device,
    params: int,
    tensors: int,
    steps: int,
    results: dict[str, float | str] | None = None,
    save: Callable[[], None] = lambda: None,
) -> dict[str, float | str]:
    """The O2/O5 optimizer step alone (unscale into fp32 masters, fused AdamW, copy back) against fused AdamW
    on as many fp32 parameters, in ms per step, into ``results``; a variant that raises gets its error instead.
    ``save`` runs after each variant."""
    sizes = [params // tensors + (1 if i < params % tensors else 0) for i in range(tensors)]
    results = {} if results is None else results
    for name in (PLAIN_ADAMW, "O2", "O5"):
        try:
            results[name] = _time_master_variant(name, sizes, device, steps)
        except Exception as error:
            results[name] = _failed(error)["error"]
            _close_sessions()
        save()
    return results


def _time_master_variant(name: str, sizes: list[int], device: torch.device, steps: int) -> float:
    step, opened = _master_variant(name, sizes, device)
    try:
        for _ in range(3):
            step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        if opened:
            ampinit.deinitialize()


# -- report ----------------------------------------------------------------------------------------------------
def judge(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per target; a target whose level or baseline did not run, or failed, is not met and says
    why (``error``)."""
    verdicts = []
    for level, baseline, max_ratio, memory in TARGETS:
        missing = [name for name in (level, baseline) if rows.get(name, {}).get("ms_per_step") is None]
        if missing:
            why = "; ".join(
                f"{name}: {rows[name].get('error') or 'no time'}" if name in rows else f"{name}: not run"
                for name in missing
            )
            verdicts.append(
                {
                    "level": level,
                    "baseline": baseline,
                    "time_ratio": math.nan,
                    "max_time_ratio": max_ratio,
                    "time_met": False,
                    "peak_memory_met": False if memory else None,
                    "error": why,
                }
            )
            continue
        ratio = _ratio(rows[level]["ms_per_step"], rows[baseline]["ms_per_step"])
        mem_ok = None
        if memory and rows[level]["peak_mib"] is not None and rows[baseline]["peak_mib"] is not None:
            mem_ok = rows[level]["peak_mib"] <= rows[baseline]["peak_mib"]
        verdicts.append(
            {
                "level": level,
                "baseline": baseline,
                "time_ratio": ratio,
                "max_time_ratio": max_ratio,
                "time_met": ratio <= max_ratio,
                "peak_memory_met": mem_ok,
            }
        )
    return verdicts


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else math.nan


def _failed(error: BaseException) -> dict[str, Any]:
    """The row of a variant that raised: no figures, the error's type and message, and the last frames."""
    frames = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-3:])
    return {"ms_per_step": None, "peak_mib": None, "error": f"{type(error).__name__}: {error}", "traceback": frames}


def _close_sessions() -> None:
    """A variant that failed half-way may leave its amp session open: the next one starts without it."""
    while _registry.current() is not None:
        ampinit.deinitialize()


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Train step on {report['device_name']} (torch {report['torch']})", ""]
    for workload, rows in report["workloads"].items():
        fp32 = rows[FP32]["ms_per_step"] if FP32 in rows else None
        lines += [f"## {workload}", "", "| variant | ms/step | vs fp32 | peak MiB |", "| --- | ---: | ---: | ---: |"]
        for name, row in rows.items():
            if row["ms_per_step"] is None:
                lines.append(f"| {name} | failed: {row['error']} | | |")
                continue
            peak = "n/a" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
            lines.append(f"| {name} | {row['ms_per_step']:.2f} | {_ratio(row['ms_per_step'], fp32):.3f} | {peak} |")
        lines.append("")
    if not report["targets"]:
        lines += ["## Targets (transformer)", "", "not judged: targets apply to a full run on CUDA", ""]
    else:
        lines += ["## Targets (transformer)", "", "| level | vs | time ratio | target | time | memory |"]
        lines.append("| --- | --- | ---: | ---: | --- | --- |")
    for v in report["targets"]:
        lines.append(
            f"| {v['level']} | {v['baseline']} | {v['time_ratio']:.3f} | <= {v['max_time_ratio']:.3f} | "
            f"{'met' if v['time_met'] else 'NOT met'} | "
            f"{'n/a' if v['peak_memory_met'] is None else ('met' if v['peak_memory_met'] else 'NOT met')} |"
            + (f" {v['error']}" if "error" in v else "")
        )
    lines += ["", "## Master step (ms)", "", "| variant | ms | vs plain |", "| --- | ---: | ---: |"]
    plain = report["master_step"].get(PLAIN_ADAMW)
    for name, ms in report["master_step"].items():
        if isinstance(ms, str):
            lines.append(f"| {name} | failed: {ms} | |")
        else:
            lines.append(f"| {name} | {ms:.3f} | {_ratio(ms, plain if isinstance(plain, float) else None):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and few steps: a smoke run on any device")
    parser.add_argument("--batch", type=int, default=8, help="transformer batch (8 x 1024 tokens fits an 80 GB GPU)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_train_step.json and .md")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.warmup, args.steps, args.repeats = 2, 1, 2, 1
    device = torch.device(args.device)
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")

    workloads: dict[str, dict[str, dict[str, Any]]] = {}
    master: dict[str, float | str] = {}
    report = {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tiny": args.tiny,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "workloads": workloads,
        "targets": [],
        "master_step": master,
        "complete": False,
    }
    # Judged on a full CUDA run only (a CPU, tiny or partial run reports no verdicts); a cut run keeps the
    # verdicts of what it measured, the rest not met.
    judged = device.type == "cuda" and not args.tiny and set(VARIANTS) <= set(variants)

    def save() -> None:
        if judged and "transformer" in workloads:
            report["targets"] = judge(workloads["transformer"])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_train_step.json").write_text(json.dumps(report, indent=2))
        (args.out / "gpu_train_step.md").write_text(markdown(report))

    for workload in ("mlp", "transformer"):
        workloads[workload] = {}
        for variant in variants:
            try:
                workloads[workload][variant] = run_variant(variant, workload, device, args)
            except Exception as error:
                workloads[workload][variant] = _failed(error)
                _close_sessions()
            save()
    master_step(
        device, 200_000 if args.tiny else 124_000_000, 20 if args.tiny else 150, 3 if args.tiny else 20, master, save
    )
    report["complete"] = True
    save()
    print(markdown(report))
    failed = [row for rows in workloads.values() for row in rows.values() if row["ms_per_step"] is None]
    return 1 if failed or any(isinstance(ms, str) for ms in master.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
