"""One amp training iteration, and the setups with master weights, for tests that train a few steps and compare."""

from __future__ import annotations

import torch
from torch import nn

import ampinit
from ampinit import amp
from tests.conftest import SmallNet, make_problem

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


def plant_inf_in_fc1(model: SmallNet) -> None:
    """An overflow where a backward could have made one: inf in one element of ``fc1``'s weight grad."""
    grad = model.fc1.weight.grad
    assert grad is not None
    # fill_ takes the number as a kernel argument: `grad[0, 0] = inf` would copy a host scalar to the device (a
    # blocking copy on CUDA, which the host-sync tests would count against amp).
    grad[0, 0].fill_(float("inf"))


def scale_loss_block(
    model: SmallNet, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, inf: bool, defer: bool
) -> None:
    """One ``scale_loss`` block (``delay_overflow_check=defer``), planting an overflow in it when ``inf``."""
    with amp.scale_loss(mse(model(x), y), opt, delay_overflow_check=defer) as scaled:
        scaled.backward()
        if inf:
            plant_inf_in_fc1(model)


def overflowing_iteration(
    model: SmallNet, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, overflow: bool
) -> None:
    """One iteration, with an overflow planted in its backward when ``overflow``."""
    opt.zero_grad()
    scale_loss_block(model, opt, x, y, inf=overflow, defer=False)
    opt.step()


def overflowing_run(steps: int, fused: bool = False, **options: object) -> tuple[SmallNet, torch.optim.Optimizer]:
    """O2 (SGD, or fused AdamW) with an inf in every backward, verbosity 1 and a dynamic scale from 2**30: each
    step is skipped, the scale halves and an overflow line may be written. The session is left open."""
    model, x, y = make_problem()
    params = model.parameters()
    opt = torch.optim.AdamW(params, 1e-2, fused=True) if fused else torch.optim.SGD(params, 0.1)
    amp.initialize(
        model,
        opt,
        opt_level="O2",
        loss_scale=ampinit.DynamicLossScale(init_scale=2.0**30, max_scale=2.0**40),
        verbosity=1,
        **options,  # type: ignore[arg-type]
    )
    for _ in range(steps):
        opt.zero_grad()
        with amp.scale_loss(mse(model(x), y), opt) as scaled:
            scaled.backward()
            model.fc1.bias.grad[0] = float("inf")  # type: ignore[index]
        opt.step()
    return model, opt
