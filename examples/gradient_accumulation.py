"""Gradient accumulation: several backward passes per optimizer step, with `delay_unscale` on all but the last.

Run:  python examples/gradient_accumulation.py [--opt-level O2] [--accumulate 4] [--steps 40]

Each optimizer step sees `--accumulate` micro-batches. Every loss is divided by the number of micro-batches, so
the summed gradient is the mean over the whole batch. `delay_unscale=True` leaves the gradients scaled in the
model while they accumulate; the last micro-batch of a step is unscaled (and checked for inf/NaN) once, for
the sum. With `--accumulate 1 --micro-batch 64` the same data arrive as one batch per step: the results agree.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O4", "O5"])
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = torch.randn(args.steps * args.accumulate * args.micro_batch, 8)
    target = data.sum(dim=1, keepdim=True).tanh()
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    batches = zip(data.split(args.micro_batch), target.split(args.micro_batch))
    for _ in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y) / args.accumulate
            last = micro == args.accumulate - 1
            with amp.scale_loss(loss, optimizer, delay_unscale=not last) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()

    with torch.no_grad():
        final = nn.functional.mse_loss(model(data).float(), target).item()
    stats = amp.stats()
    print(f"optimizer steps {stats.steps}, skipped {stats.skipped_steps}, loss scale {stats.loss_scales[0]:g}")
    print(f"final loss {final:.6f}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
