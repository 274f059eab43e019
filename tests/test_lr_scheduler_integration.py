"""amp's step under torch's LR schedulers: a scheduler wraps ``opt.step`` (``patch_track_step_called`` in
torch/optim/lr_scheduler.py), created before or after ``initialize``, outliving the session, and at every kind of
master weights. Each run is compared with the same run in the order that needs no wrapping, or with plain fp32
torch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ampinit import amp
from tests._amp_loop import MASTER_SETUPS, amp_iteration, mse, weights
from tests.conftest import make_problem


@pytest.mark.parametrize(("level", "master_weights"), [("O0", None), ("O1", None), *MASTER_SETUPS])
def test_an_lr_scheduler_created_after_initialize_works(level: str, master_weights: bool | str | None) -> None:
    """The usual order, ``model, opt = amp.initialize(...)`` and then ``scheduler = StepLR(opt, ...)``, must work.

    torch's LRScheduler wraps ``opt.step`` through ``opt.step.__func__`` (torch/optim/lr_scheduler.py,
    ``patch_track_step_called``). Apex bound its patched step with ``types.MethodType``, so that worked; amp's
    step was a plain function and the scheduler's constructor raised ``AttributeError: 'function' object has no
    attribute '__func__'`` at every opt level. The run must equal the same run with the scheduler created before
    ``initialize`` (which the old code handled).

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    finals = []
    for scheduler_first in (True, False):
        model, x, y = make_problem(seed=1)
        opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler_first else None
        amp.initialize(model, opt, opt_level=level, master_weights=master_weights, verbosity=0)
        if scheduler is None:
            scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for _ in range(3):
            amp_iteration(model, opt, x, y)
            scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
        amp.deinitialize()
        finals.append(weights(model))
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_a_scheduler_wrapper_that_outlives_the_session_steps_plainly() -> None:
    """A scheduler created after ``initialize`` keeps its wrapper on ``opt.step`` after ``deinitialize()`` (it is
    not amp's to remove). Stepping through it must then be plain torch: a closure is fine again, and the update is
    the optimizer's own (compared with an untouched copy trained in fp32).

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem(seed=2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    amp_iteration(model, opt, x, y)
    scheduler.step()
    amp.deinitialize()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), opt.param_groups[0]["lr"])

    def closure(m: nn.Module, o: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            o.zero_grad()
            loss = mse(m(x), y)
            loss.backward()
            return loss

        return run

    opt.step(closure(model, opt))
    ref_opt.step(closure(ref, ref_opt))
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_a_remainder_step_is_seen_by_a_scheduler_created_before_initialize() -> None:
    """With ``master_weights="remainder"`` the step is always taken by amp and the original ``step`` (here the
    wrapper of an lr scheduler created before ``initialize``) is never called, so torch's scheduler never learnt
    that the optimizer had stepped and warned "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" on a correct loop. fp32 masters' fused path records the step (``opt._opt_called``); the
    remainder path must too.

    Found by: the review of the master-weight machinery, checkpoints and teardown.
    """
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    amp.initialize(model, opt, opt_level="O5", master_weights="remainder", verbosity=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp_iteration(model, opt, x, y)
        scheduler.step()
    amp.deinitialize()
    assert [str(w.message) for w in caught] == []
