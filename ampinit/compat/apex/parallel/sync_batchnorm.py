"""``apex.parallel.SyncBatchNorm``: ``torch.nn.SyncBatchNorm`` with Apex's extra arguments.

``channel_last=True`` takes channels-last input (``N, ..., C``); ``fuse_relu=True`` applies a ReLU after the
normalisation, and ``forward(input, z)`` adds ``z`` before it (Apex's fused residual form).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(nn.SyncBatchNorm):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        x = input.movedim(-1, 1) if self.channel_last else input
        out = super().forward(x)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return torch.relu(out) if self.fuse_relu else out
