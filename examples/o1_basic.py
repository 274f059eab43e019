"""O1: the model stays fp32; matmuls run in fp16 and precision-sensitive functions in fp32, with dynamic loss scaling.

Run:  python examples/o1_basic.py [--opt-level O1] [--steps 150]

O1 is Apex's "mixed precision by cast policy": amp.initialize leaves the weights alone and turns on a cast policy
for torch functions (PyTorch's autocast dispatch with Apex's lists). The printout shows what ran in which dtype.
fp16 has no hardware support on most CPUs, so this runs slower than fp32 there; O4 is the same with bf16.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O4"])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, 0] * x[:, 1] > 0).long()  # the XOR of two signs: needs the hidden layer
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    for step in range(args.steps):
        optimizer.zero_grad()
        logits = model(x)  # Linear runs in the policy's dtype
        loss = nn.functional.cross_entropy(logits, y)  # cross-entropy is on the fp32 list
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step == 0:
            print(f"weights: {model[0].weight.dtype}, logits: {logits.dtype}, loss: {loss.dtype}")

    stats = amp.stats()
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"final loss {loss.item():.4f}")
    print(f"loss scale {stats.loss_scales[0]:g}, skipped steps {stats.skipped_steps} of {stats.steps}")
    print(f"train accuracy {accuracy:.3f}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
