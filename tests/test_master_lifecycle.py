"""A parameter's master from the first step that trains it to the close of the session: a parameter frozen at
``initialize`` gets its master once it trains (Apex creates masters lazily), ``add_param_group`` refuses one the
optimizer already holds as torch does, and ``deinitialize()`` hands back what the masters hold (their exact values,
once for a tied weight, and the unscaled grads when it closes between backward and step)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests._amp_loop import FP32_MASTER_SETUPS, MASTER_SETUPS, amp_iteration, mse
from tests.conftest import make_problem


# -- parameters frozen at initialize and trained later -----------------------------------------------------------
def _pre_rounded_problem(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The test problem with fc1.weight already a ``dtype`` value, so a master made from the cast weight is exact."""
    model, x, y = make_problem(seed=4)
    with torch.no_grad():
        model.fc1.weight.copy_(model.fc1.weight.to(dtype).float())
    return model, x, y


@pytest.mark.parametrize("unfreeze_after", [0, 2])
@pytest.mark.parametrize(("level", "master_weights"), MASTER_SETUPS)
def test_a_parameter_frozen_at_initialize_gets_a_master_once_it_trains(
    level: str, master_weights: bool | str, unfreeze_after: int
) -> None:
    """A half parameter that is frozen when ``initialize`` runs and unfrozen later must train on an fp32 master
    like every other trainable half parameter of O2/O5 (``amp.master_params`` are fp32 masters).

    Apex creates masters lazily, at the first ``zero_grad``/``scale_loss``, for every param that requires grad
    *then* (shared/reference/apex-amp.md §4.2), so unfreezing between ``initialize`` and the first iteration gives
    the param a master in Apex. The old code decided at ``initialize``: the unfrozen weight was stepped directly
    in bf16/fp16, and small updates were rounded away. Reference: the same run with the parameter trainable from
    the start and frozen for the first ``unfreeze_after`` steps; fc1.weight is pre-rounded to the half dtype so
    that both runs' masters start from the same value.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    dtype = torch.float16 if level == "O2" else torch.bfloat16
    finals = []
    for frozen_at_initialize in (True, False):
        model, x, y = _pre_rounded_problem(dtype)
        opt = torch.optim.SGD(model.parameters(), 1e-3, momentum=0.9)
        model.fc1.weight.requires_grad_(not frozen_at_initialize)
        amp.initialize(model, opt, opt_level=level, master_weights=master_weights, verbosity=0)
        model.fc1.weight.requires_grad_(False)
        for step in range(6):
            if step == unfreeze_after:
                model.fc1.weight.requires_grad_(True)
            amp_iteration(model, opt, x, y)
        finals.append([t.detach().float() for t in (*model.parameters(), *opt.state_dict()["state"][0].values())])
        amp.deinitialize()
    for a, b in zip(*finals):
        assert torch.equal(a, b)


# -- add_param_group --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "master_weights"), FP32_MASTER_SETUPS)
def test_add_param_group_refuses_a_parameter_the_optimizer_already_has(level: str, master_weights: bool | str) -> None:
    """torch's ``add_param_group`` raises ``ValueError("some parameters appear in more than one parameter group")``.
    With fp32 masters the groups hold the masters, so torch's check did not see the model parameter again: the
    half weight was added as a second, master-less entry (stepped in half precision beside its master, and left in
    two groups after ``deinitialize()``). It must be refused as torch refuses it, with the optimizer unchanged.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, _, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, master_weights=master_weights, verbosity=0)
    groups_before = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [model.fc1.weight], "lr": 0.5})
    assert [list(g["params"]) for g in opt.param_groups] == groups_before
    amp.deinitialize()
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


# -- teardown -------------------------------------------------------------------------------------------------------
def test_closing_between_backward_and_step_hands_the_unscaled_grads_to_the_model() -> None:
    """``deinitialize()`` hands the masters back to the model (docs/api.md: weights get the masters' exact
    values). Closing after ``scale_loss`` and before ``step()`` must likewise leave the model the gradients the
    step would have used: the unscaled master grads, as O1 (grads unscaled in place) does. The old code dropped
    the master grads and left the model its fp16 grads, still multiplied by the loss scale (65536): a plain fp32
    ``step()`` after closing moved the weights 65536 times too far. Reference: fp32 backward on a copy.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem(seed=6)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    amp.deinitialize()
    mse(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=name)


class TiedNet(nn.Module):
    """An embedding whose weight is also the output layer's (tied embeddings, as in GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def test_deinitialize_restores_tied_weights_to_their_masters() -> None:
    """A weight shared by two modules is one parameter with one master; ``deinitialize()`` must give it the
    master's exact value, once, and keep it tied. With remainder masters (fp32 masters were fine) the old code
    restored it once per module: the second time it joined the already-restored fp32 weight with its remainder,
    and ``deinitialize()`` raised ``ValueError: join needs a bfloat16 weight``.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    torch.manual_seed(0)
    model = TiedNet()
    tokens, y = torch.randint(0, 10, (32,)), torch.randn(32, 10)
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    amp.initialize(model, opt, opt_level="O5", master_weights="remainder", verbosity=0)
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(mse(model(tokens), y), opt) as scaled:
            scaled.backward()
        opt.step()
    live = ampinit.current_session()
    assert live is not None
    master = live.master_for(model.emb.weight)
    assert master is not None
    expected = master.detach().clone()
    amp.deinitialize()
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.dtype == torch.float32
    assert torch.equal(model.emb.weight, expected)
