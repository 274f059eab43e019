"""O2: a half-precision model with fp32 master weights and dynamic loss scaling.

Run:  python examples/o2_master_weights.py [--opt-level O2] [--steps 200]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()  # a simple, learnable labelling
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        # Clip the fp32 master gradients, which scale_loss has already unscaled.
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            stats = amp.stats()
            scale, skipped = stats.loss_scales[0], stats.skipped_steps
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scale:.0f}  skipped {skipped}")

    accuracy = ((model(x) > 0).float() == y).float().mean().item()
    print(f"weights: {next(model.parameters()).dtype}, masters: {next(amp.master_params(optimizer)).dtype}")
    print(f"train accuracy {accuracy:.3f}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
