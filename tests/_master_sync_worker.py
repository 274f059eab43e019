"""Scenarios run on each rank of a 2-process gloo job by tests/test_master_sync.py: ranks seeded differently, so
that only DDP's broadcast of rank 0's weights (and masters that follow it) can make them agree.

Each scenario writes what the test checks to ``{outdir}/{scenario}.{rank}.pt``; ``reference(case)`` runs the same
training in one process, from rank 0's initial weights as DDP broadcasts them, on the global batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ampinit
from ampinit import amp
from ampinit.compat.apex.parallel import DistributedDataParallel as ApexDistributedDataParallel
from tests._dist_worker import INIT_SCALE, Net, data, params, sgd, shard, train_step

#: (opt level, master_weights override or None): every level, and the remainder masters.
CASES: dict[str, tuple[str, str | None]] = {
    **{level: (level, None) for level in ("O0", "O1", "O2", "O3", "O4", "O5")},
    "remainder": ("O5", "remainder"),
}
RESUME_CASES = ("O2", "O5", "remainder")
WRAPPERS = {"torch": DistributedDataParallel, "apex": ApexDistributedDataParallel}
STEPS = 3
SEEDS = (1, 2)  # each rank's own: nothing but DDP's broadcast makes the ranks' models agree


def initialize(case: str, seed: int, initial: list[torch.Tensor] | None = None) -> tuple[nn.Module, Any]:
    """``Net`` seeded with ``seed`` (or holding ``initial``), with SGD, initialized for ``case``."""
    torch.manual_seed(seed)
    model = Net()
    if initial is not None:
        with torch.no_grad():
            for param, value in zip(model.parameters(), initial):
                param.copy_(value)
    opt = sgd(model)
    level, master_weights = CASES[case]
    overrides: dict[str, Any] = {} if master_weights is None else {"master_weights": master_weights}
    if level in ("O1", "O2"):
        overrides["loss_scale"] = ampinit.DynamicLossScale(init_scale=INIT_SCALE)
    amp.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    return model, opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Weights, masters (joined, for remainder masters: what ``state_dict`` reports) and loss scale."""
    return {"params": params(model), "masters": list(model.state_dict().values()), "amp": amp.state_dict()}


def train_from_different_seeds(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    for case in CASES:
        for wrapper_name, wrapper in WRAPPERS.items():
            model, opt = initialize(case, SEEDS[rank])
            ddp = wrapper(model)
            for _ in range(STEPS):
                train_step(ddp, opt, x, y)
            torch.save(snapshot(model, opt), out / f"seeds_{case}_{wrapper_name}.{rank}.pt")
            amp.deinitialize()


def resume_on_different_seeds(rank: int, world: int, out: Path) -> None:
    """Every rank loads rank 0's checkpoint into a model of its own seed, then wraps it: bitwise the run that
    went on."""
    x, y = shard(rank, world)
    for case in RESUME_CASES:
        model, opt = initialize(case, SEEDS[rank])
        ddp = DistributedDataParallel(model)
        for _ in range(STEPS):
            train_step(ddp, opt, x, y)
        path = out / f"checkpoint_{case}.pt"
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, path)
        dist.barrier()
        for _ in range(STEPS):
            train_step(ddp, opt, x, y)
        uninterrupted = snapshot(model, opt)
        amp.deinitialize()

        model, opt = initialize(case, 10 + SEEDS[rank])
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        ddp = DistributedDataParallel(model)
        for _ in range(STEPS):
            train_step(ddp, opt, x, y)
        resumed = snapshot(model, opt)
        amp.deinitialize()
        torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / f"resume_{case}.{rank}.pt")


SCENARIOS = (train_from_different_seeds, resume_on_different_seeds)


def broadcast_weights(case: str) -> list[torch.Tensor]:
    """Rank 0's weights as DDP broadcasts them: the model ``initialize`` left, in the dtype it holds them."""
    model, _ = initialize(case, SEEDS[0])
    weights = params(model)
    amp.deinitialize()
    return weights


def reference(case: str) -> dict[str, Any]:
    """One process trains rank 0's broadcast weights on the global batch, at ``case``'s level."""
    model, opt = initialize(case, 0, initial=[w.float() for w in broadcast_weights(case)])
    x, y = data()
    for _ in range(STEPS):
        train_step(model, opt, x, y)
    result = snapshot(model, opt)
    amp.deinitialize()
    return result


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for scenario in SCENARIOS:
            scenario(rank, world, Path(outdir))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2, join=True)
