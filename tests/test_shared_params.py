"""A half parameter trained by two optimizers of a session (or listed twice in one) with master weights.

Each listing got its own fp32 master, stepped by its own optimizer only, and the model weight took whichever
master was copied back last: one update per iteration where plain torch applies two, silently. It is refused
at ``initialize`` (and by ``add_param_group``), before anything changes; fp32 parameters, which have no master,
may still be shared, as in torch.

Found by: the audit of multi-model / multi-optimizer usage.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ampinit import amp


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], x: torch.Tensor, amp_on: bool) -> None:
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        loss = model(x).float().mean()
        if amp_on:
            with amp.scale_loss(loss, opts) as scaled:
                scaled.backward()
        else:
            loss.backward()
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_half_parameter_in_two_optimizers_is_refused(level: str) -> None:
    model = nn.Linear(4, 4)
    before = copy.deepcopy(model.state_dict())
    o1 = torch.optim.SGD(model.parameters(), lr=0.1)
    o2 = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(RuntimeError, match="'weight' appears in optimizers 0 and 1"):
        amp.initialize(model, [o1, o2], opt_level=level, verbosity=0)
    assert model.weight.dtype == torch.float32  # nothing changed
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert o1.param_groups[0]["params"][0] is model.weight


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_half_parameter_twice_in_one_optimizer_is_refused(level: str) -> None:
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "duplicate parameters; in future, this will cause an error"
        opt = torch.optim.SGD([model.weight, model.bias, model.weight], lr=0.1)
    with pytest.raises(RuntimeError, match="'weight' appears twice in optimizer 0"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)


def test_shared_parameters_without_masters_train_as_torch() -> None:
    """O1 (no masters) takes the shared weight, and trains it as plain torch does: two updates per iteration."""
    torch.manual_seed(0)
    base, x = nn.Linear(4, 4), torch.randn(3, 4)
    finals = []
    for amp_on in (False, True):
        model = copy.deepcopy(base)
        opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([model.weight], lr=0.1)]
        if amp_on:
            amp.initialize(model, opts, opt_level="O1", verbosity=0)
        _train(model, opts, x, amp_on)
        if amp_on:
            amp.deinitialize()
        finals.append(model.weight.detach().clone())
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-2, atol=1e-3)


def test_a_shared_fp32_parameter_is_accepted_with_masters() -> None:
    """A parameter that keeps fp32 at O2 (here one outside the models) has no master: sharing it is torch's rule."""
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.zeros(4))
    o1 = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    o2 = torch.optim.SGD([extra], lr=0.1)
    amp.initialize(model, [o1, o2], opt_level="O2", verbosity=0)
    amp.deinitialize()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_add_param_group_refuses_a_parameter_of_another_optimizer(level: str) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    o1 = torch.optim.SGD(a.parameters(), lr=0.1)
    o2 = torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [o1, o2], opt_level=level, verbosity=0)
    try:
        with pytest.raises(RuntimeError, match="already trained by another optimizer"):
            o2.add_param_group({"params": [a.weight]})
        assert len(o2.param_groups) == 1  # left as it was
        o2.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=a.weight.dtype))]})  # a new one is fine
        assert len(o2.param_groups) == 2
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_disjoint_optimizers_over_one_model_still_train(level: str) -> None:
    """Two optimizers over disjoint parts of one model: accepted, and each part trains."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(3, 4)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    opts = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.Adam([model.bias], lr=0.01)]
    amp.initialize(model, opts, opt_level=level, verbosity=0)
    _train(model, opts, x, True)
    amp.deinitialize()
    assert not torch.equal(model.weight, w0) and not torch.equal(model.bias, b0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_shared_parameter_is_unscaled_once_per_block(level: str) -> None:
    """A parameter without a master trained by two optimizers passed to one block: its grad was unscaled once per
    optimizer (divided by the scale twice). At O1 the shared weight, at O2 a shared fp32 parameter."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(3, 4)
    extra = nn.Parameter(torch.ones(4))
    shared = model.weight if level == "O1" else extra
    grads = []
    for both in (False, True):
        model.zero_grad()
        extra.grad = None
        opts = [torch.optim.SGD([*model.parameters(), extra], lr=0.1), torch.optim.SGD([shared], lr=0.1)]
        amp.initialize(model, opts, opt_level=level, verbosity=0)
        loss = (model(x).float() * extra).mean()
        with amp.scale_loss(loss, opts if both else opts[0]) as scaled:
            scaled.backward()
        grads.append(shared.grad.detach().clone())
        amp.deinitialize()
    assert torch.equal(grads[1], grads[0])


def _shared_accumulation(ranks: int, monkeypatch: pytest.MonkeyPatch, raise_in_second: bool) -> list[torch.Tensor]:
    """O1, a weight trained by two optimizers, two blocks given both (the second raising before its backward when
    asked); ``ranks``: the job's world size as the grads see it (in a multi-rank job the first block's grads stay in
    ``.grad`` at the second's scale)."""
    import types

    from ampinit._masters import grads

    monkeypatch.setattr(grads, "_distributed", types.SimpleNamespace(world_size=lambda: ranks))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opts = [torch.optim.SGD([model.weight, model.bias], lr=0.1), torch.optim.SGD([model.weight], lr=0.1)]
    amp.initialize(model, opts, opt_level="O1", verbosity=0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    try:
        for opt in opts:
            opt.zero_grad()
        with amp.scale_loss(model(x[:4]).float().mean(), opts) as scaled:
            scaled.backward()
        if raise_in_second:
            with pytest.raises(KeyError):
                with amp.scale_loss(model(x[4:]).float().mean(), opts):
                    raise KeyError("before the backward")
        else:
            with amp.scale_loss(model(x[4:]).float().mean(), opts) as scaled:
                scaled.backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("raise_in_second", [False, True])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_shared_parameter_is_made_room_for_and_given_back_once(
    ranks: int, raise_in_second: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain torch: the grads of the two blocks summed (or the first alone, when the second raised).
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model(x[:4]).float().mean().backward()
    if not raise_in_second:
        model(x[4:]).float().mean().backward()
    got = _shared_accumulation(ranks, monkeypatch, raise_in_second)
    for ours, theirs in zip(got, model.parameters()):
        torch.testing.assert_close(ours, theirs.grad, rtol=2e-3, atol=2e-3)
