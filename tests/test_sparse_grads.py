"""Sparse gradients (``nn.Embedding(sparse=True)``, what ``torch.optim.SparseAdam`` takes): the levels without
master weights check and unscale their values; the master-weight levels refuse them at ``initialize``. Before,
every level accepted them and failed inside torch at the first ``scale_loss`` exit (the unscale kernel has no
sparse implementation; O2's master grads cannot copy a sparse grad). Found by the twentieth session's audit of
the optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp

TOKENS = torch.tensor([[1, 2, 3], [3, 4, 7]])


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def _optimizers(model: Bag, name: str) -> list[torch.optim.Optimizer]:
    if name == "sparse_adam":
        return [torch.optim.SparseAdam([model.emb.weight], lr=0.05), torch.optim.SGD(model.head.parameters(), lr=0.05)]
    return [torch.optim.SGD(model.parameters(), lr=0.05)]


def _train(level: str | None, name: str, inf_at: int | None = None, blocks: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Bag()
    opts = _optimizers(model, name)
    if level is not None:
        model, opts = amp.initialize(model, opts, opt_level=level, verbosity=0)
    try:
        for step in range(4):
            for opt in opts:
                opt.zero_grad()
            for _ in range(blocks):
                loss = model(TOKENS).float().pow(2).mean() / blocks
                if level is None:
                    loss.backward()
                    continue
                with amp.scale_loss(loss, opts) as scaled:
                    scaled.backward()
                    if step == inf_at:
                        model.emb.weight.grad._values()[0, 0] = float("inf")
            if level is not None and step == inf_at:
                assert all(ampinit.session_of(opts[0]).next_step_skipped(opt) for opt in opts)  # type: ignore[union-attr]
            for opt in opts:
                opt.step()
        return [p.detach().float().clone() for p in model.parameters()]
    finally:
        if level is not None:
            amp.deinitialize()


@pytest.mark.parametrize("name", ["sparse_adam", "sgd"])
@pytest.mark.parametrize(("level", "tolerance"), [("O0", 0.0), ("O1", 2e-3), ("O4", 2e-2)])
@pytest.mark.parametrize("blocks", [1, 2])
def test_sparse_grads_train_like_fp32(level: str, tolerance: float, name: str, blocks: int) -> None:
    reference = _train(None, name)
    for got, want in zip(_train(level, name, blocks=blocks), reference):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_an_inf_in_a_sparse_grad_skips_the_step(level: str) -> None:
    # The step with the inf is skipped: the three others are the fp32 run's first three steps.
    torch.manual_seed(0)
    three = _train(level, "sparse_adam", inf_at=3)
    torch.manual_seed(0)
    model = Bag()
    opts = _optimizers(model, "sparse_adam")
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        model(TOKENS).float().pow(2).mean().backward()
        for opt in opts:
            opt.step()
    tolerance = 2e-3 if level == "O1" else 2e-2
    for got, want in zip(three, model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=tolerance, atol=tolerance)
        assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "options", [dict(opt_level="O2"), dict(opt_level="O5"), dict(opt_level="O5", master_weights="remainder")]
)
def test_master_weights_refuse_a_sparse_embedding_and_change_nothing(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"emb is Embedding\(sparse=True\)"):
        amp.initialize(model, opt, verbosity=0, **options)
    assert ampinit.current_session() is None
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0]["params"] == list(model.parameters())
