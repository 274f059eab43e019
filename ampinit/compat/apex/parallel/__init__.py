"""``apex.parallel``: Apex's data-parallel tools mapped onto torch.distributed (see docs/migration.md).

``apex.parallel.LARC`` is a submodule, as in Apex: ``from apex.parallel.LARC import LARC``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ampinit.compat.apex.parallel import LARC
from ampinit.compat.apex.parallel.distributed import DistributedDataParallel, Reducer
from ampinit.compat.apex.parallel.sync_batchnorm import SyncBatchNorm

ReduceOp = dist.ReduceOp

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a :class:`SyncBatchNorm` with the same state."""
    converted = module
    if isinstance(module, _BatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        with torch.no_grad():
            if module.affine:
                # Apex assigns clones of the data: the affine parameters keep their dtype (a half model stays half).
                converted.weight.data = module.weight.detach().clone()
                converted.bias.data = module.bias.detach().clone()
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        converted.to(next(iter(module.state_dict().values()), torch.empty(0)).device)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size: int) -> Any:
    """Split the world into groups of ``group_size`` consecutive ranks; return this rank's group."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size != 0:
        raise ValueError(f"group_size={group_size!r} must divide the world size {world_size}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
