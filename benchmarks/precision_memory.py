"""Persistent optimizer-side memory of the precision dial (issue 26): bytes per parameter, measured per setting.

A decoder of >= 10M parameters (``precision_quality.char_decoder``, wider) takes a few AdamW steps in every setting;
then every tensor reachable from the model's parameters, their grads, the optimizer (its state and param groups)
and the amp session (its records: masters, remainders, master-grad buffers, compressed state, whatever a setting
keeps) is counted once per storage (by device and data pointer), in bytes of its whole storage. Model buffers
and activations are not optimizer-side and are not counted. Two figures per setting: right after ``step()``
(grads still held, as between steps of a loop that zeroes grads at the top) and after
``zero_grad(set_to_none=True)``. On CUDA, ``torch.cuda.max_memory_allocated`` around one more step is added
(forward, backward and step: activations included). Settings the installed ampinit refuses become error rows.

    PYTHONPATH=. python benchmarks/precision_memory.py
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ampinit
from ampinit import amp
from benchmarks.precision_quality import Shape, char_decoder, lm_loss, machine, threads

DEFAULT_JSON = Path("benchmarks/results/precision_memory.json")
NATIVE = "native autocast + AdamW"


@dataclass(frozen=True)
class Setting:
    name: str
    amp_options: dict[str, Any] | None  # None: native autocast bf16, fp32 weights
    target: float | None = None  # bytes per parameter, with grads


SETTINGS = [
    Setting(NATIVE, None),
    Setting("O5 fp32 masters", {}),
    Setting("O5 remainder", {"master_weights": "remainder"}),
    Setting("O5 remainder + 8bit", {"master_weights": "remainder", "optimizer_state": "8bit"}, target=10.0),
    Setting("O5 remainder8", {"master_weights": "remainder8"}),
    Setting("O5 remainder8 + 8bit", {"master_weights": "remainder8", "optimizer_state": "8bit"}, target=7.0),
    Setting("O5 stochastic", {"master_weights": "stochastic"}),
    Setting("O5 stochastic + bf16", {"master_weights": "stochastic", "optimizer_state": "bf16"}),
    Setting("O5 stochastic + 8bit", {"master_weights": "stochastic", "optimizer_state": "8bit"}),
    Setting("O5 pure bf16 (no masters or SR)", {"master_weights": False}),
]


# -- accounting --------------------------------------------------------------------------------------------------
def _reachable(roots: Sequence[object]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``roots`` through containers, object attributes, bound methods and closures,
    without entering modules (the model's parameters are roots themselves; its buffers are not counted)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, nn.Module):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, slot) for slot in obj.__slots__ if hasattr(obj, slot))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, session: object) -> int:
    """Bytes of the storages reachable from the parameters (and grads), the optimizer and the amp session."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in _reachable([list(model.parameters()), optimizer, session]):
        if tensor.is_sparse or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


# -- one setting -------------------------------------------------------------------------------------------------
def measure(setting: Setting, initial: nn.Module, shape: Shape, steps: int, device: torch.device) -> dict[str, Any]:
    model = copy.deepcopy(initial).to(device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    session = None
    if setting.amp_options is not None:
        model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **setting.amp_options)
        session = ampinit.session_of(opt)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (shape.batch, shape.context), generator=gen).to(device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            if session is not None:
                with amp.scale_loss(lm_loss(model(x), x), opt) as scaled:
                    scaled.backward()
            else:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = lm_loss(model(x), x)
                loss.backward()
            opt.step()

        for _ in range(steps):
            step()
        row: dict[str, Any] = {"params": params}
        row["bytes_per_param"] = persistent_bytes(model, opt, session) / params
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["cuda_peak_bytes_per_param"] = torch.cuda.max_memory_allocated() / params
        opt.zero_grad(set_to_none=True)
        row["bytes_per_param_without_grads"] = persistent_bytes(model, opt, session) / params
        return row
    finally:
        if session is not None:
            session.close()


def run(settings: Sequence[Setting], shape: Shape, steps: int, device: torch.device) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    initial = char_decoder(shape)
    rows: dict[str, dict[str, Any]] = {}
    for setting in settings:
        try:
            row = measure(setting, initial, shape, steps, device)
        except (TypeError, ValueError) as error:  # an option this ampinit does not have (yet)
            row = {"error": f"{type(error).__name__}: {error}"}
        row["target"] = setting.target
        if "bytes_per_param" in row and setting.target is not None:
            row["met"] = row["bytes_per_param"] <= setting.target
        rows[setting.name] = row
        print(f"  {setting.name}: {row}", flush=True)
    return rows


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    cuda = any("cuda_peak_bytes_per_param" in row for row in rows.values())
    header = "| setting | B/param (with grads) | B/param (grads freed) | target |"
    header += " CUDA peak B/param |" if cuda else ""
    lines = [header, "|---|---|---|---|" + ("---|" if cuda else "")]
    for name, row in rows.items():
        target = "" if row["target"] is None else f"<= {row['target']:g}"
        if "error" in row:
            target += ": not measured" if target else ""
            lines.append(f"| {name} | error: {row['error']} | | {target} |" + (" |" if cuda else ""))
            continue
        if "met" in row:
            target += ": MET" if row["met"] else ": NOT MET"
        line = f"| {name} | {row['bytes_per_param']:.2f} | {row['bytes_per_param_without_grads']:.2f} | {target} |"
        if cuda:
            line += f" {row.get('cuda_peak_bytes_per_param', float('nan')):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a small model (not >= 10M parameters)")
    parser.add_argument("--steps", type=int, default=2, help="steps before measuring (default 2; state is lazy)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    with threads(1):
        shape = (
            Shape(layers=1, d_model=64, heads=2, context=8, batch=2)
            if args.quick
            else Shape(layers=4, d_model=512, heads=8, context=32, batch=2)
        )
        device = torch.device(args.device)
        env = {**machine(), "device": str(device)}
        print(f"{env['cpu']}, torch {env['torch']}, ampinit {env['ampinit']}, device {device}; {shape}")
        started = time.perf_counter()
        rows = run(SETTINGS, shape, args.steps, device)
        table = markdown(rows)
        print(table)
        report = {
            "benchmark": "precision_memory",
            "machine": env,
            "shape": vars(shape),
            "rows": rows,
            "markdown": table,
            "wall_seconds": time.perf_counter() - started,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
        return report


if __name__ == "__main__":
    main()
