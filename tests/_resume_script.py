"""Run by test_resume_in_fresh_process: train, checkpoint, continue; or resume from a checkpoint and continue."""

from __future__ import annotations

import sys

import torch

from ampinit import amp
from tests.conftest import make_problem


def main(level: str, mode: str, path: str) -> None:
    model, x, y = make_problem(seed=5)
    opt = torch.optim.AdamW(model.parameters(), 1e-2, eps=1e-4)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    if mode == "resume":
        checkpoint = torch.load(path + ".ckpt", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
    steps = {"first": 3, "resume": 4}[mode]
    for i in range(steps + (4 if mode == "first" else 0)):
        if mode == "first" and i == steps:
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()},
                path + ".ckpt",
            )
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    torch.save({"model": model.state_dict(), "amp": amp.state_dict()}, path + "." + mode)
    amp.deinitialize()


if __name__ == "__main__":
    main(*sys.argv[1:4])
