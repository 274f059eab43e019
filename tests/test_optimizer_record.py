"""``ampinit._optimizer_record``: the stage of each optimizer between two steps, and the misuse it refuses (a refused
step leaves the skip it was to take pending)."""

from __future__ import annotations

import re

import pytest
import torch

import ampinit
from ampinit import amp
from ampinit._optimizer_record import OptimizerRecord, Stage
from tests._amp_loop import MASTER_SETUPS, mse, weights
from tests.conftest import make_problem


def _setup(level: str = "O2") -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, OptimizerRecord]:
    model, x, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    session = ampinit.session_of(opt)
    assert session is not None
    record = session._record_of(opt)
    assert record is not None and record.optimizer is opt
    return model, opt, x, record


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, **kwargs: bool) -> None:
    with amp.scale_loss(model(x).float().pow(2).mean(), opt, **kwargs) as scaled:
        scaled.backward()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
def test_a_block_then_a_step_goes_ready_unscaled_ready(level: str) -> None:
    model, opt, x, record = _setup(level)
    assert record.stage is Stage.READY
    _backward(model, opt, x)
    assert record.stage is Stage.UNSCALED
    _backward(model, opt, x)  # accumulating a second backward stays unscaled
    assert record.stage is Stage.UNSCALED
    opt.step()
    assert record.stage is Stage.READY and not amp.step_was_skipped(opt)
    amp.deinitialize()


def test_delay_unscale_keeps_the_grads_scaled_until_a_plain_block() -> None:
    model, opt, x, record = _setup()
    _backward(model, opt, x, delay_unscale=True)
    assert record.stage is Stage.SCALED
    with pytest.raises(RuntimeError, match=re.escape("optimizer.step() was called while gradients are still scaled")):
        opt.step()
    _backward(model, opt, x)
    assert record.stage is Stage.UNSCALED
    opt.step()
    assert record.stage is Stage.READY
    amp.deinitialize()


def test_a_raising_block_drops_the_grads_it_would_have_added() -> None:
    model, opt, x, record = _setup()
    _backward(model, opt, x, delay_unscale=True)
    with pytest.raises(ZeroDivisionError), amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
        raise ZeroDivisionError
    assert record.stage is Stage.READY
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for group in opt.param_groups for p in group["params"])
    amp.deinitialize()


def test_a_backward_outside_scale_loss_is_refused_with_master_weights() -> None:
    model, opt, x, record = _setup("O2")
    model(x).float().sum().backward()
    with pytest.raises(RuntimeError, match="never reached the fp32 master weights"):
        opt.step()
    assert record.stage is Stage.READY
    amp.deinitialize()


# -- a refused step must not consume the pending skip ----------------------------------------------------------
@pytest.mark.parametrize(("level", "master_weights"), MASTER_SETUPS)
def test_a_refused_closure_step_keeps_the_overflow_skip(level: str, master_weights: bool | str) -> None:
    """After an overflow, ``opt.step(closure)`` is refused (closures are not supported with master weights). The
    skip that the overflow decided must still apply to the next ``opt.step()``.

    Apex: the overflow patches ``step`` with ``skip_step``, which raises on a closure *before* restoring the
    original step (shared/reference/apex-amp.md §1.2), so the following ``step()`` is still the skip. The old code
    consumed the skip before raising, and the retried step applied the inf/NaN gradients to the weights.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, master_weights=master_weights, verbosity=0)
    before = weights(model)
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    opt.step()
    assert amp.step_was_skipped(opt)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    amp.deinitialize()
