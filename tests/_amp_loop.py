"""One amp training iteration, and the setups with master weights, for tests that train a few steps and compare."""

from __future__ import annotations

import torch
from torch import nn

from ampinit import amp

FP32_MASTER_SETUPS: list[tuple[str, bool | str]] = [("O2", True), ("O5", True)]
MASTER_SETUPS: list[tuple[str, bool | str]] = [*FP32_MASTER_SETUPS, ("O5", "remainder")]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def amp_iteration(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
