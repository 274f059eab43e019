"""Apex's examples/simple/distributed/distributed_data_parallel.py, CPU-sized (gloo instead of NCCL).

Single process:  ampinit run distributed_data_parallel.py
Two processes:   torchrun --nproc_per_node=2 -m ampinit run distributed_data_parallel.py
"""

# Kept in Apex's own style on purpose (this is the legacy code ampinit must run unchanged).
# ruff: noqa: I001

import argparse
import os

import torch

from apex import amp
from apex.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
# torchrun passes the local rank in the environment; torch.distributed.launch passed --local_rank.
parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
parser.add_argument("--iterations", default=500, type=int)
args = parser.parse_args()

args.distributed = False
if "WORLD_SIZE" in os.environ:
    args.distributed = int(os.environ["WORLD_SIZE"]) > 1

# More processes than GPUs share them round-robin; NCCL refuses two ranks on one GPU, so they talk through gloo.
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
device = torch.device("cuda", args.local_rank % gpus) if gpus else torch.device("cpu")
if args.distributed:
    if gpus:
        torch.cuda.set_device(device)
    world_size = int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(backend="nccl" if gpus >= world_size else "gloo", init_method="env://")

torch.backends.cudnn.benchmark = True

torch.manual_seed(0)
N, D_in, D_out = 64, 1024, 16

# Each process receives its own batch of fake data, drawn on the CPU so that it is the same on any device.
x = torch.randn(N, D_in).to(device)
y = torch.randn(N, D_out).to(device)

model = torch.nn.Linear(D_in, D_out).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

if args.distributed:
    # delay_allreduce is an Apex-only tuning knob: accepted, explained once, no effect on the result.
    model = DistributedDataParallel(model, delay_allreduce=True)

loss_fn = torch.nn.MSELoss()

for t in range(args.iterations):
    optimizer.zero_grad()
    y_pred = model(x)
    loss = loss_fn(y_pred, y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    if t == 0:
        first_loss = loss.item()

if args.local_rank == 0:
    print("first loss = ", first_loss)
    print("final loss = ", loss)

if args.distributed:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
