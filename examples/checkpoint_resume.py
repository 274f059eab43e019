"""Checkpoint and resume: save model, optimizer and amp state; a resumed run continues exactly as if never stopped.

Run:  python examples/checkpoint_resume.py [--opt-level O2] [--steps 30]

The checkpoint holds three state dicts: `model.state_dict()` (fp32 values, also at O2/O5, where they are the
master weights), `optimizer.state_dict()` and `amp.state_dict()` (each loss scaler's scale and clean-step count,
in Apex's format). To resume: build the model and optimizer, call `amp.initialize` with the same opt level,
then load the three. The script trains 2 x `--steps` steps straight through, then trains `--steps`, saves,
starts over from fresh objects, loads, trains `--steps` more, and prints a fingerprint (SHA-256 of the bytes) of
each final model: equal fingerprints mean the two models are equal bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import io

import torch
from torch import nn

from ampinit import amp


def build(opt_level: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, last: int) -> None:
    for step in range(first, last):
        batch = torch.Generator().manual_seed(step)  # the data depend on the step only, as with a seeded loader
        x = torch.randn(64, 16, generator=batch)
        y = torch.randint(0, 4, (64,), generator=batch)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's bytes, in ``state_dict`` order."""
    digest = hashlib.sha256()
    for value in state.values():
        digest.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Not O3: a pure fp16 AdamW diverges (its eps=1e-8 is 0 in fp16, see docs/faq.md), and NaN != NaN.
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    n = args.steps

    model, optimizer = build(args.opt_level)
    train(model, optimizer, 0, 2 * n)
    print(f"uninterrupted: weights {fingerprint(model.state_dict())}, loss scales {amp.stats().loss_scales}")
    amp.deinitialize()

    model, optimizer = build(args.opt_level)
    train(model, optimizer, 0, n)
    checkpoint = io.BytesIO()  # a file path works the same way
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, checkpoint)
    amp.deinitialize()

    checkpoint.seek(0)
    saved = torch.load(checkpoint, weights_only=True)
    model, optimizer = build(args.opt_level)  # fresh objects, initialized at the same opt level, then loaded
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    print(f"checkpoint:    weights {fingerprint(model.state_dict())}, amp state {saved['amp']}")
    train(model, optimizer, n, 2 * n)
    print(f"resumed:       weights {fingerprint(model.state_dict())}, loss scales {amp.stats().loss_scales}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
