"""Where the fp32 master grads live between steps (``ampinit._masters.grads.GRAD_BUFFERS_KEPT_ON``).

On CPU one buffer per master is kept and reused; on other devices (CUDA) the storage is allocated at
``scale_loss``'s exit and released after the step, as Apex does, so that it does not sit idle through the next
forward and backward. The CPU tests below stand in for CUDA by emptying the set; training must give the same
bits either way, through accumulation over two backwards and a skipped step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._masters import grads as master_grads


def train(steps: int = 4, backwards: int = 2) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    """O2 with a dynamic scale, ``backwards`` backwards per step, an inf on step 1: the final weights, and for
    each step the master grads given to ``step()`` that are still alive after the last step (session open)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale="dynamic")
    session = amp.current_session()
    assert session is not None
    seen: list[list[weakref.ref[torch.Tensor]]] = []
    try:
        for step in range(steps):
            for _ in range(backwards):
                loss = model(torch.randn(8, 6, generator=gen).half()).float().pow(2).mean()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                    if step == 1:
                        model[0].weight.grad[0, 0] = float("inf")
            grads = [p.grad for p in amp.master_params(opt)]
            assert all(g is not None for g in grads)
            seen.append([weakref.ref(g) for g in grads if g is not None])
            del grads
            opt.step()
            opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        gc.collect()
        alive = [[ref() for ref in refs] for refs in seen]
    finally:
        session.close()
    return weights, alive


def test_cpu_keeps_one_grad_buffer_per_master() -> None:
    _, alive = train()
    assert all(g is not None for grads in alive for g in grads), "the CPU buffers were released"
    assert all(a is b for a, b in zip(alive[0], alive[-1])), "a step allocated new master-grad storage on CPU"


def test_elsewhere_master_grad_storage_is_released_after_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, _ = train()
    monkeypatch.setattr(master_grads, "GRAD_BUFFERS_KEPT_ON", frozenset())
    released, alive = train()
    assert all(g is None for grads in alive for g in grads), "master-grad storage outlived its step"
    for a, b in zip(kept, released):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
