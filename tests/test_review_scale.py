"""Review of the loss-scaling and overflow machinery: corner cases checked against Apex's rules, written out here.

The rules used as the reference (``/work/wt/shared/reference/apex-amp.md`` §1.2 and §5, ``docs/loss-scaling.md``):

* each ``scale_loss`` exit checks only the gradients produced since the last unscale, and an overflow there halves
  the scale once and skips the next step of every optimizer passed to that block, and of no other optimizer;
* ``delay_overflow_check=True`` moves that decision (and the scale update) from the block's exit to the next
  ``step()`` of an optimizer the block fed (ampinit's documented replacement for Apex's "never decided").
"""

from __future__ import annotations

import pytest
import torch

from ampinit import amp
from tests.conftest import SmallNet, make_problem


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _plant_inf(model: SmallNet) -> None:
    grad = model.fc1.weight.grad
    assert grad is not None
    grad[0, 0] = float("inf")


def _block(
    model: SmallNet, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, inf: bool, defer: bool
) -> None:
    with amp.scale_loss(_mse(model(x), y), opt, delay_overflow_check=defer) as scaled:
        scaled.backward()
        if inf:
            _plant_inf(model)


# -- delay_overflow_check followed by a plain block on the same scaler ------------------------------------------
@pytest.mark.parametrize("inf_in", [0, 1], ids=["inf-in-deferred-block", "inf-in-plain-block"])
def test_deferred_then_plain_block_backs_off_once_for_one_overflow(inf_in: int) -> None:
    """One overflow must halve the scale once, whichever of the two blocks it is in.

    Two accumulation blocks on loss 0 before one ``step()``: the first with ``delay_overflow_check=True``, the
    second plain; an inf is planted in one of them. Apex's rule (one decision per exit, each on the grads of its
    own backward; an overflow halves the scale once) gives 65536 -> 32768 and a skipped step. The current code
    leaves the deferred block's flag uncleared, so the plain block's decision sees it, and the deferred decision
    taken at ``step()`` reads the same flag again: 65536 -> 16384, the overflow counted twice.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.zero_grad()
    _block(model, opt, x[:32], y[:32], inf=inf_in == 0, defer=True)
    _block(model, opt, x[32:], y[32:], inf=inf_in == 1, defer=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert amp.stats().loss_scales == (32768.0,)
    amp.deinitialize()


def test_deferred_overflow_of_one_optimizer_does_not_skip_another_optimizers_clean_block() -> None:
    """A clean plain block must not be skipped because of another block's deferred overflow.

    Optimizer A's block (loss 0, ``delay_overflow_check=True``) overflows; optimizer B's block (loss 0, plain)
    is clean. Apex's rule: only the optimizers passed to an overflowing block skip, and the scale backs off once.
    Expected: B steps, A skips, scale 32768. The current code decides B's block on the flag A's block left
    raised: B skips, and A's deferred decision backs off a second time (16384).
    """
    (model_a, x, y), (model_b, _, _) = make_problem(0), make_problem(1)
    model_a.eval()
    model_b.eval()
    opt_a = torch.optim.SGD(model_a.parameters(), 0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), 0.1)
    amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level="O2", verbosity=0)
    _block(model_a, opt_a, x, y, inf=True, defer=True)
    _block(model_b, opt_b, x, y, inf=False, defer=False)
    b_before = [p.detach().clone() for p in model_b.parameters()]
    opt_b.step()
    assert not amp.step_was_skipped(opt_b), "B's own block was clean"
    assert not all(torch.equal(p, b) for p, b in zip(model_b.parameters(), b_before))
    opt_a.step()
    assert amp.step_was_skipped(opt_a)
    assert amp.stats().loss_scales == (32768.0,)
    amp.deinitialize()
