"""Scenarios run on each rank of a 2-process gloo job by tests/test_distributed.py.

Each scenario writes what the test checks to ``{outdir}/{scenario}.{rank}.pt``; ``reference(level)`` runs the
same training in one process on the global batch. The ``seeded`` scenarios seed the ranks differently, and
``seeded_reference(case)`` trains rank 0's weights, as DDP broadcasts them, in one process.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampinit
from ampinit import amp
from ampinit.compat.apex.parallel import DistributedDataParallel as ApexDDP
from ampinit.compat.apex.parallel import Reducer

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
GLOBAL_BATCH = 32
STEPS = 4


class Net(nn.Module):
    """No BatchNorm: per-rank batch statistics would make DDP differ from one process on the global batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.ln(self.fc1(x))))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


INIT_SCALE = 2.0**12  # fp16's dynamic scale: low enough that this problem never overflows


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def build(level: str, **overrides: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = sgd(model)
    if level in ("O1", "O2") and "loss_scale" not in overrides:
        overrides["loss_scale"] = ampinit.DynamicLossScale(init_scale=INIT_SCALE)
    amp.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    return model, opt


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, corrupt: bool = False
) -> float:
    opt.zero_grad()
    loss = (model(x).float() - y).pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if corrupt:  # a rank-local fault after the all-reduce: only this rank sees it
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("inf")
                    break
    opt.step()
    return loss.item()


def shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def ddp_levels(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    for level in LEVELS:
        model, opt = build(level)
        ddp = DDP(model)
        losses = [train_step(ddp, opt, x, y) for _ in range(STEPS)]
        torch.save({"params": params(model), "amp": amp.state_dict(), "losses": losses}, out / f"ddp_{level}.{rank}.pt")
        amp.deinitialize()


def overflow_on_one_rank(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    for level in ("O2", "O5"):
        model, opt = build(level)
        ddp = DDP(model)
        train_step(ddp, opt, x, y)
        before = params(model)
        scale_before = amp.stats().loss_scales[0]
        train_step(ddp, opt, x, y, corrupt=rank == 1)
        torch.save(
            {
                "skipped": amp.step_was_skipped(opt),
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, params(model))),
                "finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
                "scale_before": scale_before,
                "amp": amp.state_dict(),
                "params": params(model),
            },
            out / f"overflow_{level}.{rank}.pt",
        )
        amp.deinitialize()


def resume(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    model, opt = build("O2")
    ddp = DDP(model)
    for _ in range(3):
        train_step(ddp, opt, x, y)
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, out / "ckpt.pt"
        )
    dist.barrier()
    for _ in range(3):
        train_step(ddp, opt, x, y)
    uninterrupted = {"params": params(model), "amp": amp.state_dict()}
    amp.deinitialize()

    model, opt = build("O2")
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    ddp = DDP(model)
    for _ in range(3):
        train_step(ddp, opt, x, y)
    resumed = {"params": params(model), "amp": amp.state_dict()}
    amp.deinitialize()
    torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / f"resume.{rank}.pt")


def two_halves_first_in_no_sync(
    ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, delay_unscale: bool
) -> None:
    """One accumulation of two halves of the rank's batch: the first inside ``no_sync()`` (``delay_unscale`` as
    given), the second outside it, whose backward all-reduces."""
    halves = list(zip(x.chunk(2), y.chunk(2)))
    with ddp.no_sync():
        loss = (ddp(halves[0][0]).float() - halves[0][1]).pow(2).mean() / 2
        with amp.scale_loss(loss, opt, delay_unscale=delay_unscale) as scaled:
            scaled.backward()
    loss = (ddp(halves[1][0]).float() - halves[1][1]).pow(2).mean() / 2
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()


def accumulate_with_no_sync(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    model, opt = build("O2", loss_scale=256.0)
    ddp = DDP(model)
    opt.zero_grad()
    two_halves_first_in_no_sync(ddp, opt, x, y, delay_unscale=True)
    grads = [p.grad.clone() for p in amp.master_params(opt)]
    opt.step()
    torch.save({"grads": grads, "params": params(model)}, out / f"no_sync.{rank}.pt")
    amp.deinitialize()


FSDP_LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}
FSDP_STEPS = 8


@contextlib.contextmanager
def kernel_path(on: bool) -> Iterator[None]:
    """With ``on``, the optimizer step takes its CUDA path on CPU tensors: amp's Triton kernels, interpreted."""
    if not on:
        yield
        return
    from ampinit._masters import kernel_step
    from tests import _triton

    with _triton.interpreted_kernels():
        kernel_step.TRITON_ON_CPU = True
        try:
            yield
        finally:
            kernel_step.TRITON_ON_CPU = False


def fsdp2(rank: int, world: int, out: Path) -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 has FSDP2 only under its composable API path
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    from torch.distributed.device_mesh import init_device_mesh

    # The job runs on gloo, on the CPU: without a mesh of its own, fully_shard takes the default device's, which
    # on a GPU machine is CUDA (it would move the shards there and the CPU batch would not meet them).
    mesh = init_device_mesh("cpu", (world,))
    x, y = shard(rank, world)
    # O4 a second time on the step's CUDA path (amp's Triton kernels, interpreted): its skip is decided on the
    # device and SGD cannot take the flag, so the kernels would stand in, but not for DTensor shards, whose
    # data_ptr() is 0 (tests/test_distributed.py::test_fsdp2_shards_are_left_to_the_optimizer_on_the_kernel_path).
    for name, level in (*((level, level) for level in FSDP_LEVELS), ("O4_kernel_path", "O4")):
        torch.manual_seed(0)
        model = Net()
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = sgd(model)
        overrides = {"loss_scale": ampinit.DynamicLossScale(init_scale=INIT_SCALE)} if level == "O1" else {}
        with kernel_path(name != level):
            amp.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
            losses = [train_step(model, opt, x, y) for _ in range(FSDP_STEPS)]
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        torch.save({"losses": losses, "params": full, "amp": amp.state_dict()}, out / f"fsdp_{name}.{rank}.pt")
        amp.deinitialize()
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=mesh)
    try:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    torch.save({"refused": refused}, out / f"fsdp_O2.{rank}.pt")


# -- ranks seeded differently: only DDP's broadcast of rank 0's weights (and masters that follow it) makes them agree
#: (opt level, master_weights override or None): every level, and the remainder masters.
SEEDED_CASES: dict[str, tuple[str, str | None]] = {
    **{level: (level, None) for level in LEVELS},
    "remainder": ("O5", "remainder"),
}
SEEDED_RESUME_CASES = ("O2", "O5", "remainder")
WRAPPERS = {"torch": DDP, "apex": ApexDDP}
SEEDED_STEPS = 3
SEEDS = (1, 2)  # rank 0's, rank 1's


def build_seeded(case: str, seed: int, initial: list[torch.Tensor] | None = None) -> tuple[nn.Module, Any]:
    """``Net`` seeded with ``seed`` (or holding ``initial``), with SGD, initialized for ``case``."""
    torch.manual_seed(seed)
    model = Net()
    if initial is not None:
        with torch.no_grad():
            for param, value in zip(model.parameters(), initial):
                param.copy_(value)
    opt = sgd(model)
    level, master_weights = SEEDED_CASES[case]
    overrides: dict[str, Any] = {} if master_weights is None else {"master_weights": master_weights}
    if level in ("O1", "O2"):
        overrides["loss_scale"] = ampinit.DynamicLossScale(init_scale=INIT_SCALE)
    amp.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    return model, opt


def seeded_snapshot(model: nn.Module) -> dict[str, Any]:
    """Weights, masters (as ``state_dict`` reports them: joined, for remainder masters) and the loss scale."""
    return {"params": params(model), "masters": list(model.state_dict().values()), "amp": amp.state_dict()}


Scenario = Callable[[int, int, Path], None]


def one_thread(scenario: Scenario) -> Scenario:
    """Run ``scenario`` with one torch thread per rank: two ranks of two threads each on a 2-core machine spin
    against each other (25 times slower on a busy one)."""

    def run(rank: int, world: int, out: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            scenario(rank, world, out)
        finally:
            torch.set_num_threads(threads)

    return run


@one_thread
def train_from_different_seeds(rank: int, world: int, out: Path) -> None:
    x, y = shard(rank, world)
    for case in SEEDED_CASES:
        for wrapper_name, wrapper in WRAPPERS.items():
            model, opt = build_seeded(case, SEEDS[rank])
            ddp = wrapper(model)
            for _ in range(SEEDED_STEPS):
                train_step(ddp, opt, x, y)
            torch.save(seeded_snapshot(model), out / f"seeds_{case}_{wrapper_name}.{rank}.pt")
            amp.deinitialize()


@one_thread
def resume_on_different_seeds(rank: int, world: int, out: Path) -> None:
    """Every rank loads rank 0's checkpoint into a model of its own seed before the wrap."""
    x, y = shard(rank, world)
    for case in SEEDED_RESUME_CASES:
        model, opt = build_seeded(case, SEEDS[rank])
        ddp = DDP(model)
        for _ in range(SEEDED_STEPS):
            train_step(ddp, opt, x, y)
        path = out / f"seeded_checkpoint_{case}.pt"
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, path)
        dist.barrier()
        for _ in range(SEEDED_STEPS):
            train_step(ddp, opt, x, y)
        uninterrupted = seeded_snapshot(model)
        amp.deinitialize()

        model, opt = build_seeded(case, 10 + SEEDS[rank])
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        ddp = DDP(model)
        for _ in range(SEEDED_STEPS):
            train_step(ddp, opt, x, y)
        resumed = seeded_snapshot(model)
        amp.deinitialize()
        torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / f"seeded_resume_{case}.{rank}.pt")


def broadcast_weights(case: str) -> list[torch.Tensor]:
    """Rank 0's weights as DDP broadcasts them: the model ``initialize`` left, in the dtype it holds them."""
    model, _ = build_seeded(case, SEEDS[0])
    weights = params(model)
    amp.deinitialize()
    return weights


def seeded_reference(case: str) -> dict[str, Any]:
    """train_from_different_seeds in one process: rank 0's broadcast weights trained on the global batch."""
    model, opt = build_seeded(case, 0, initial=[w.float() for w in broadcast_weights(case)])
    x, y = data()
    for _ in range(SEEDED_STEPS):
        train_step(model, opt, x, y)
    result = seeded_snapshot(model)
    amp.deinitialize()
    return result


#: The precision dial's stochastic settings under DDP: (master_weights, optimizer_state, optimizer).
DIAL_CASES: dict[str, tuple[str | bool, str, Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "stochastic_8bit_adamw": ("stochastic", "8bit", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)),
    "remainder8_bf16_sgd": ("remainder8", "bf16", sgd),
    "fp32_bf16_adamw": (True, "bf16", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)),
}


@one_thread
def dial_from_different_seeds(rank: int, world: int, out: Path) -> None:
    """Ranks whose torch seeds differ (so their models and their sessions' default SR seeds differ) under DDP."""
    x, y = shard(rank, world)
    for case, (master_weights, state, make) in DIAL_CASES.items():
        torch.manual_seed(SEEDS[rank])
        model = Net()
        opt = make(model)
        amp.initialize(model, opt, opt_level="O5", master_weights=master_weights, optimizer_state=state, verbosity=0)
        ddp = DDP(model)
        for _ in range(SEEDED_STEPS):
            train_step(ddp, opt, x, y)
        snapshot = {**seeded_snapshot(model), "optimizer": opt.state_dict()}
        torch.save(snapshot, out / f"dial_{case}.{rank}.pt")
        amp.deinitialize()


#: The levels whose grads the optimizer reads from ``.grad`` itself (no masters): an accumulation without
#: ``delay_unscale`` keeps them there in a multi-rank job, so DDP's reduction carries the blocks run in no_sync().
NO_SYNC_LEVELS = ["O0", "O1", "O3", "O4"]


def accumulate_with_no_sync_without_delay_unscale(rank: int, world: int, out: Path) -> None:
    """The native-AMP habit: the first micro-batch inside ``no_sync()``, no ``delay_unscale``. amp moved the first
    block's grads out of ``.grad`` for the second backward, whose all-reduce then carried the second's alone: each
    rank stepped with its own first half (found by the twentieth session's distributed audit)."""
    x, y = shard(rank, world)
    for level in [*NO_SYNC_LEVELS, "O2"]:
        model, opt = build(level)
        ddp = DDP(model)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            two_halves_first_in_no_sync(ddp, opt, x, y, delay_unscale=False)
        grads = [p.grad.clone() for p in amp.master_params(opt)]
        opt.step()
        warned = any("delay_unscale=True" in str(w.message) for w in caught)
        torch.save({"grads": grads, "params": params(model), "warned": warned}, out / f"no_sync_{level}.{rank}.pt")
        amp.deinitialize()


@one_thread
def reducer_from_different_seeds(rank: int, world: int, out: Path) -> None:
    """``apex.parallel.Reducer(model)`` after ``initialize``: it broadcasts rank 0's weights, which the masters
    must follow (as Apex's, built at the first backward, did)."""
    x, y = shard(rank, world)
    for case in ("O2", "O5", "remainder"):
        model, opt = build_seeded(case, SEEDS[rank])
        reducer = Reducer(model)
        for _ in range(SEEDED_STEPS):
            opt.zero_grad()
            loss = (model(x).float() - y).pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                reducer.reduce()
            opt.step()
        torch.save(seeded_snapshot(model), out / f"reducer_{case}.{rank}.pt")
        amp.deinitialize()


SCENARIOS = {
    "ddp_levels": ddp_levels,
    "overflow_on_one_rank": overflow_on_one_rank,
    "resume": resume,
    "accumulate_with_no_sync": accumulate_with_no_sync,
    "accumulate_with_no_sync_without_delay_unscale": accumulate_with_no_sync_without_delay_unscale,
    "fsdp2": fsdp2,
    "train_from_different_seeds": train_from_different_seeds,
    "resume_on_different_seeds": resume_on_different_seeds,
    "dial_from_different_seeds": dial_from_different_seeds,
    "reducer_from_different_seeds": reducer_from_different_seeds,
}


def worker(rank: int, world: int, port: int, outdir: str, names: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in names:
            SCENARIOS[name](rank, world, Path(outdir))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(level: str) -> dict[str, Any]:
    """The same training as ddp_levels, in one process on the global batch."""
    x, y = data()
    model, opt = build(level)
    losses = [train_step(model, opt, x, y) for _ in range(STEPS)]
    result = {"params": params(model), "amp": amp.state_dict(), "losses": losses}
    amp.deinitialize()
    return result


def autocast_reference(level: str) -> dict[str, Any]:
    """The fsdp2 scenario's training in one process on the global batch, in plain torch: ``torch.autocast`` to the
    level's dtype, and for fp16 a ``torch.amp.GradScaler`` with the same starting scale."""
    x, y = data()
    torch.manual_seed(0)
    model = Net()
    opt = sgd(model)
    dtype = FSDP_LEVELS[level]
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=dtype == torch.float16)
    losses = []
    for _ in range(FSDP_STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            prediction = model(x)
        loss = (prediction.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return {"params": params(model), "losses": losses, "scale": scaler.get_scale() if scaler.is_enabled() else 1.0}


if __name__ == "__main__":
    import torch.multiprocessing as mp

    port, outdir, *names = sys.argv[1:]
    mp.spawn(worker, args=(2, int(port), outdir, names), nprocs=2, join=True)
