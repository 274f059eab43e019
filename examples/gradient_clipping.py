"""Gradient clipping: `amp.clip_grad_norm_(optimizer, max_norm)`, on the gradients the optimizer will apply.

Run:  python examples/gradient_clipping.py [--opt-level O2] [--max-norm 1.0] [--steps 100] [--apex-pattern]

When `scale_loss` exits, the gradients have been unscaled: that is the moment to clip, before `optimizer.step()`.
`amp.clip_grad_norm_` clips what the step will apply (the fp32 master grads at O2/O5, the model's own grads at
the other levels), so the same line works at every level and the norm it sees is the true one, not one multiplied
by the loss scale. `--apex-pattern` clips as Apex code does, `torch.nn.utils.clip_grad_norm_(amp.master_params(
optimizer), max_norm)`: the same numbers, but at O2/O5 on a GPU it makes the fp32 master grads that
`amp.clip_grad_norm_` leaves unwritten (docs/opt-levels.md, "Clipping").
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--apex-pattern", action="store_true", help="clip amp.master_params(optimizer) with torch")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = 5.0 * x[:, :2].sum(dim=1, keepdim=True)  # large targets: large early gradients, so clipping matters
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    clipped, first_norm = 0, None
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if args.apex_pattern:
            norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=args.max_norm)
        else:
            norm = amp.clip_grad_norm_(optimizer, max_norm=args.max_norm)
        optimizer.step()
        # An overflowing step (norm inf, at fp16 levels while the loss scale settles) is skipped: nothing to clip.
        if not amp.step_was_skipped():
            clipped += int(norm > args.max_norm)
            if first_norm is None:
                first_norm = norm.item()
                print(f"gradient norm at the first applied step ({step}): {first_norm:.4f}")

    stats = amp.stats()
    print(f"skipped {stats.skipped_steps} steps, loss scale {stats.loss_scales[0]:g}")
    print(f"clipped {clipped} of {stats.steps - stats.skipped_steps} applied steps")
    print(f"final loss {loss.item():.4f}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
