"""O5: a bfloat16 model with fp32 master weights, so small updates are not rounded away.

Run:  python examples/o5_bf16.py [--steps 300]

bf16 has fp32's exponent range (no loss scaling needed) but only 8 bits of mantissa: next to a weight of 0.5, any
update below ~0.001 rounds to nothing. O5 runs forward and backward in bf16 and applies the optimizer's updates to
fp32 master copies, which are rounded into the bf16 model after each step. The script trains the same regression
three ways, from the same start: fp32 (O0), O5, and a plain bf16 model without masters.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp


def make_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = x @ torch.randn(32, 1) * 0.5 + 0.1 * torch.sin(3 * x[:, :1])
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    return model, x, y


def train(mode: str, steps: int, lr: float) -> float:
    model, x, y = make_problem()
    if mode == "pure bf16":
        model, x, y = model.bfloat16(), x.bfloat16(), y.bfloat16()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if mode != "pure bf16":
        model, optimizer = amp.initialize(model, optimizer, opt_level=mode, verbosity=0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if mode == "pure bf16":
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
    final = nn.functional.mse_loss(model(x).float(), y.float()).item()
    if mode == "O5":
        weights, masters = next(model.parameters()).dtype, next(amp.master_params(optimizer)).dtype
        print(f"O5 weights: {weights}, master weights: {masters}")
    if mode != "pure bf16":
        amp.deinitialize()
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    for mode in ("O0", "O5", "pure bf16"):
        print(f"{mode:9s} final loss {train(mode, args.steps, args.lr):.5f}")


if __name__ == "__main__":
    main()
