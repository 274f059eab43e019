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


# -- delay_unscale across a scale change ---------------------------------------------------------------------
def _assert_close_to_fp16_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the fp16 rounding of accumulating scaled grads (a few fp16 ulps of the largest grad)."""
    torch.testing.assert_close(got, expected, rtol=0.0, atol=4e-3 * float(expected.abs().max()))


def _o2_grads_after(plan: list[tuple[int, bool]], *, overflow_loss_1_first: bool) -> list[torch.Tensor]:
    """The fp32 master grads that ``step()`` would read after ``plan``'s blocks (``(loss_id, delay_unscale)``).

    With ``overflow_loss_1_first`` an earlier iteration plants an inf in loss 1's block, so scaler 1 sits at
    32768 while scaler 0 stays at 65536.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.0)  # lr 0: the weights, hence the grads, stay the same
    amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    if overflow_loss_1_first:
        opt.zero_grad()
        with amp.scale_loss(_mse(model(x), y), opt, loss_id=1) as scaled:
            scaled.backward()
            _plant_inf(model)
        opt.step()
        assert amp.stats().loss_scales == (65536.0, 32768.0)
    opt.zero_grad()
    for index, (loss_id, delay) in enumerate(plan):
        sl = slice(16 * index, 16 * (index + 1))
        with amp.scale_loss(_mse(model(x[sl]), y[sl]), opt, loss_id=loss_id, delay_unscale=delay) as scaled:
            scaled.backward()
    grads = [p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]
    amp.deinitialize()
    return grads


def test_delay_unscale_grads_of_one_loss_unscaled_by_another_losses_scale() -> None:
    """Grads kept scaled by ``delay_unscale`` must be divided by the scale they were multiplied by.

    One optimizer, ``num_losses=2``: loss 0's micro-batch is accumulated with ``delay_unscale=True`` (scale
    65536), then loss 1's block (scale 32768 after an earlier overflow) unscales. Expected: the same grads as
    with no ``delay_unscale`` (g0 + g1, within fp16 rounding). The current code divides the whole sum by
    loss 1's scale, so loss 0's contribution comes out doubled. (Apex's ``scale_loss`` does the same, which its
    docstring only calls a "gotcha"; it is wrong numbers with no error.)
    """
    plan = [(0, True), (1, False)]
    reference = _o2_grads_after([(0, False), (1, False)], overflow_loss_1_first=True)
    got = _o2_grads_after(plan, overflow_loss_1_first=True)
    for g, r in zip(got, reference):
        _assert_close_to_fp16_rounding(g, r)


def test_delay_unscale_grads_kept_across_a_back_off_of_their_own_scaler() -> None:
    """The same with one loss: the kept grads' scaler backs off before they are unscaled.

    Two models, two optimizers, one scaler: optimizer A accumulates a micro-batch with ``delay_unscale=True``
    at 65536; optimizer B's block then overflows (scale -> 32768); A's closing block unscales at 32768.
    Expected: A's grads equal those of the same blocks without ``delay_unscale``. Got: the first micro-batch
    doubled.
    """

    def grads(delay: bool) -> list[torch.Tensor]:
        (model_a, x, y), (model_b, _, _) = make_problem(0), make_problem(1)
        model_a.eval()
        model_b.eval()
        opt_a = torch.optim.SGD(model_a.parameters(), 0.0)
        opt_b = torch.optim.SGD(model_b.parameters(), 0.0)
        amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level="O2", verbosity=0)
        with amp.scale_loss(_mse(model_a(x[:32]), y[:32]), opt_a, delay_unscale=delay) as scaled:
            scaled.backward()
        _block(model_b, opt_b, x, y, inf=True, defer=False)
        assert amp.stats().loss_scales == (32768.0,)
        with amp.scale_loss(_mse(model_a(x[32:]), y[32:]), opt_a) as scaled:
            scaled.backward()
        out = [p.grad.clone() for g in opt_a.param_groups for p in g["params"] if p.grad is not None]
        amp.deinitialize()
        return out

    for g, r in zip(grads(delay=True), grads(delay=False)):
        _assert_close_to_fp16_rounding(g, r)


# -- step() without scale_loss after zero_grad(set_to_none=False) ----------------------------------------------
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_step_after_zero_grad_keeping_zero_tensors_is_not_refused(level: str) -> None:
    """``zero_grad(set_to_none=False)`` then ``step()`` with no backward in between must not raise.

    Plain torch and Apex both allow it (Apex's patched ``zero_grad`` zeroes the fp16 model grads in place and
    its ``step`` then finds no master grads: nothing moves). The current code takes the zero-filled model grads
    for "gradients that never reached the fp32 master weights" and raises RuntimeError.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    opt.zero_grad(set_to_none=False)
    with amp.scale_loss(_mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no backward since zero_grad: a step with zero (or no) grads
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    amp.deinitialize()


def test_backward_outside_scale_loss_after_zero_grad_keeping_tensors_is_still_refused() -> None:
    """The guard the previous test narrows must still catch a real misuse (passes before and after the fix)."""
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(_mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    _mse(model(x), y).backward()
    with pytest.raises(RuntimeError, match="never reached the fp32 master weights"):
        opt.step()
    amp.deinitialize()


# -- a refused closure must not consume the pending skip ---------------------------------------------------------
@pytest.mark.parametrize("sync_free", [False, True])
def test_pending_skip_survives_a_step_refused_for_its_closure(sync_free: bool) -> None:
    """After an overflow, ``step(closure)`` is refused; the skip must still be pending for the next ``step()``.

    Apex (§1.2: ``skip_step`` raises "Currently, Amp does not support closure use with optimizers." before it
    restores ``opt.step``) keeps the one-shot skip in place when the closure is refused, so the following
    ``step()`` is still skipped. The current code consumes the skip decision and then raises: at O1 the next
    ``step()`` applies the inf grads, and the weights become non-finite.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0, sync_free=sync_free)
    with amp.scale_loss(_mse(model(x), y), opt) as scaled:
        scaled.backward()
        _plant_inf(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="does not support closure"):
        opt.step(lambda: _mse(model(x), y))
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    amp.deinitialize()


# -- zero_grad() abandoning a delay_unscale accumulation ---------------------------------------------------------
def _grads_of_one_block(level: str, abandon_first: bool, step_after: bool = False) -> list[torch.Tensor]:
    """The grads the optimizer reads after one plain block, optionally preceded by an abandoned accumulation."""
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    if abandon_first:
        opt.zero_grad()
        with amp.scale_loss(_mse(model(x[:16]), y[:16]), opt) as scaled:
            scaled.backward()
        with amp.scale_loss(_mse(model(x[16:32]), y[16:32]), opt, delay_unscale=True) as scaled:
            scaled.backward()
        opt.zero_grad()  # drop this accumulation: a bad batch, say
        if step_after:
            opt.step()  # nothing left to step on: must not be refused as "still scaled"
    opt.zero_grad()
    with amp.scale_loss(_mse(model(x[32:]), y[32:]), opt) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]
    amp.deinitialize()
    return grads


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zero_grad_drops_an_unfinished_delay_unscale_accumulation(level: str) -> None:
    """``optimizer.zero_grad()`` in the middle of a ``delay_unscale`` accumulation must discard all of it.

    Expected (plain torch's meaning of ``zero_grad``): the next iteration's grads are those of its own block
    only, bitwise as in a fresh run. The current code keeps the grads stashed when the delayed block began (here
    the first micro-batch's, on every fp32 parameter: all of them at O1, BatchNorm's at O2), and the next
    unscale adds them back into the next iteration's grads.
    """
    fresh = _grads_of_one_block(level, abandon_first=False)
    after_abandon = _grads_of_one_block(level, abandon_first=True)
    assert len(fresh) == len(after_abandon)
    for got, expected in zip(after_abandon, fresh):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_after_zero_grad_amid_delay_unscale_is_not_refused(level: str) -> None:
    """After ``zero_grad()`` nothing scaled is left: ``step()`` must not raise "gradients are still scaled".

    The current code keeps the optimizer in its scaled stage through ``zero_grad`` and refuses the step.
    """
    _grads_of_one_block(level, abandon_first=True, step_after=True)
