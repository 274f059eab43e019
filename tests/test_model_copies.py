"""Copies of a model under amp: ``copy.deepcopy`` (how EMA helpers build theirs) and ``torch.save`` of the whole
module, at every kind of casting and master weights. A copy runs like the original and stays put while it trains;
a loaded model is a plain module."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from ampinit import amp
from tests._amp_loop import MASTER_SETUPS, amp_iteration, weights
from tests.conftest import make_problem


@pytest.mark.parametrize(("level", "master_weights"), [("O1", None), ("O4", None), *MASTER_SETUPS])
def test_a_model_can_be_deep_copied_after_initialize(level: str, master_weights: bool | str | None) -> None:
    """``copy.deepcopy(model)`` after ``initialize`` is how EMA helpers (timm's ``ModelEmaV2``, created after
    ``amp.initialize`` in timm's train.py) build their copy; Apex's O1 leaves the model alone, so it works there.
    It raised ``TypeError: cannot pickle '_thread._local' object`` at O1/O4: the model's hooks were bound
    methods of its ``ModelCast``, and copying that copied the session (at O2/O5 too, without an error). The copy
    must run like the original, give its own weights in its state dict, and stay put while the original trains.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    options = {} if master_weights is None else {"master_weights": master_weights}
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    try:
        ema = copy.deepcopy(model)
        assert all(p is not q for p, q in zip(ema.parameters(), model.parameters()))
        # The copy shares the session's hooks instead of copying them and the session behind them.
        hooks, copied = list(model._forward_pre_hooks.values()), list(ema._forward_pre_hooks.values())
        assert hooks and [id(h) for h in copied] == [id(h) for h in hooks]
        out, ema_out = model(x), ema(x)
        assert ema_out.dtype == out.dtype
        assert torch.equal(ema_out, out)
        frozen = {k: v.clone() for k, v in ema.state_dict().items()}
        for _ in range(2):
            amp_iteration(model, opt, x, y)
        assert all(torch.equal(v, frozen[k]) for k, v in ema.state_dict().items())
        assert not torch.equal(model(x), ema(x))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(("level", "master_weights"), [("O1", None), ("O4", None), *MASTER_SETUPS])
def test_a_model_can_be_pickled_whole_after_initialize(level: str, master_weights: bool | str | None) -> None:
    """``torch.save(model)`` of a whole model, mid-training, worked under Apex's O1 (it left the model alone); here
    it raised (the hooks were local functions and bound methods holding the session). The loaded model must be a
    plain module: its weights are the saved model's, bit for bit and in their dtypes, its forward is that of the
    same module without amp (no hook of the session runs), and the original keeps training.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    options = {} if master_weights is None else {"master_weights": master_weights}
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    try:
        amp_iteration(model, opt, x, y)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
            assert p.dtype == q.dtype and torch.equal(p, q), name
        # Without amp: the same module, built by hand from the loaded weights, with no hooks at all.
        plain = make_problem()[0]
        plain.load_state_dict({k: v.clone() for k, v in loaded.state_dict().items()}, assign=True)
        data = x.to(next(loaded.parameters()).dtype)
        assert torch.equal(loaded(data), plain(data))
        before = weights(model)
        amp_iteration(model, opt, x, y)
        assert any(not torch.equal(a, b) for a, b in zip(before, weights(model)))
    finally:
        amp.deinitialize()
