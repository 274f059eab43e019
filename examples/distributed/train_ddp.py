"""Data-parallel training with amp and torch DistributedDataParallel (CPU with gloo, or CUDA with nccl).

Run on CPU with two processes:
    torchrun --nproc_per_node=2 examples/distributed/train_ddp.py --opt-level O5
On GPUs, the same script picks nccl and one GPU per process; with fewer GPUs than processes (e.g. two processes
on a 1-GPU machine) the processes share the GPUs and use gloo.

The order matters, as in Apex: amp.initialize() first, then wrap the returned model in DDP.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ampinit import amp


def report(line: str) -> None:
    """Print ``line`` with one write: the ranks share one stdout, and a line written in pieces (text, then the
    newline, as ``print`` does when output is unbuffered) can have another rank's line land in its middle."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pick_device() -> tuple[torch.device, str]:
    """This rank's device and the process-group backend.

    One GPU per rank (the usual torchrun layout) uses nccl. With fewer GPUs than ranks on the node, ranks share
    GPUs round-robin (LOCAL_RANK % device_count) and use gloo, since nccl refuses two ranks on one GPU.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    count = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device, "nccl" if ranks_on_node <= count else "gloo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # plain `python`: torch would say "RANK expected"
        parser.exit(
            2,
            "train_ddp.py runs one process per rank: launch it with torchrun, for example\n"
            "  torchrun --nproc_per_node=2 examples/distributed/train_ddp.py --opt-level O5\n",
        )

    device, backend = pick_device()
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    # Each rank its own initial weights, as Apex's ImageNet example seeded them (rank 0 gets seed 0): they need not
    # agree, because DDP broadcasts rank 0's weights and amp's fp32 masters (O2/O5) follow them at the first backward.
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    model = DDP(model)

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own data
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen).to(device)
        y = x[:, :4].sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()  # every rank skips the same steps: the overflow flag is all-reduced
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            report(f"step {step:4d}  loss {loss.item():.6f}  amp {dict(amp.state_dict())}")

    # The ranks started from different weights, yet train rank 0's: each rank prints a checksum of its own
    # parameters, and they agree.
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    report(f"rank {rank} of {world}: parameter checksum {checksum!r}")
    amp.deinitialize()
    # Release the DDP model first: one still alive when the interpreter shuts down holds its gloo process group,
    # whose teardown then aborts the process now and then (docs/distributed.md, "Shutting down").
    del model, optimizer
    gc.collect()
    # Leave together: a rank that tears its process group down while another is still talking to it can abort.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
