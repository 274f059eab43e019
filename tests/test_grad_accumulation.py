"""What the optimizer reads between ``zero_grad()`` and ``step()``: gradients accumulated over several
``scale_loss`` blocks, zero-filled gradients, and an accumulation abandoned by ``zero_grad()``.

The rules used as the reference (shared/reference/apex-amp.md §1.2 and §5, ``docs/loss-scaling.md``), written
out in each test:

* grads kept scaled by ``delay_unscale`` are divided by the scale they were multiplied by, whatever the scale of
  the block that unscales them (Apex divides by the last one: wrong numbers with no error);
* ``zero_grad()`` means what it means in plain torch: nothing accumulated before it reaches the next step;
* a ``step()`` with zero-filled grads and no backward since ``zero_grad`` moves nothing, as in plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ampinit import amp
from tests._amp_loop import mse, plant_inf_in_fc1, scale_loss_block
from tests.conftest import make_problem


# -- delay_unscale: each micro-batch divided by the scale it was multiplied by -----------------------------------------
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
        with amp.scale_loss(mse(model(x), y), opt, loss_id=1) as scaled:
            scaled.backward()
            plant_inf_in_fc1(model)
        opt.step()
        assert amp.stats().loss_scales == (65536.0, 32768.0)
    opt.zero_grad()
    for index, (loss_id, delay) in enumerate(plan):
        sl = slice(16 * index, 16 * (index + 1))
        with amp.scale_loss(mse(model(x[sl]), y[sl]), opt, loss_id=loss_id, delay_unscale=delay) as scaled:
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

    Found by: the review of the loss-scaling and overflow machinery.
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

    Found by: the review of the loss-scaling and overflow machinery.
    """

    def grads(delay: bool) -> list[torch.Tensor]:
        (model_a, x, y), (model_b, _, _) = make_problem(0), make_problem(1)
        model_a.eval()
        model_b.eval()
        opt_a = torch.optim.SGD(model_a.parameters(), 0.0)
        opt_b = torch.optim.SGD(model_b.parameters(), 0.0)
        amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level="O2", verbosity=0)
        with amp.scale_loss(mse(model_a(x[:32]), y[:32]), opt_a, delay_unscale=delay) as scaled:
            scaled.backward()
        scale_loss_block(model_b, opt_b, x, y, inf=True, defer=False)
        assert amp.stats().loss_scales == (32768.0,)
        with amp.scale_loss(mse(model_a(x[32:]), y[32:]), opt_a) as scaled:
            scaled.backward()
        out = [p.grad.clone() for g in opt_a.param_groups for p in g["params"] if p.grad is not None]
        amp.deinitialize()
        return out

    for g, r in zip(grads(delay=True), grads(delay=False)):
        _assert_close_to_fp16_rounding(g, r)


# -- step() without scale_loss after zero_grad(set_to_none=False) ------------------------------------------------------
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_step_after_zero_grad_keeping_zero_tensors_is_not_refused(level: str) -> None:
    """``zero_grad(set_to_none=False)`` then ``step()`` with no backward in between must not raise.

    Plain torch and Apex both allow it (Apex's patched ``zero_grad`` zeroes the fp16 model grads in place and
    its ``step`` then finds no master grads: nothing moves). The current code takes the zero-filled model grads
    for "gradients that never reached the fp32 master weights" and raises RuntimeError.

    Found by: the review of the loss-scaling and overflow machinery.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    opt.zero_grad(set_to_none=False)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no backward since zero_grad: a step with zero (or no) grads
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    amp.deinitialize()


def test_backward_outside_scale_loss_after_zero_grad_keeping_tensors_is_still_refused() -> None:
    """The guard the previous test narrows must still catch a real misuse (passes before and after the fix).

    Found by: the review of the loss-scaling and overflow machinery.
    """
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    mse(model(x), y).backward()
    with pytest.raises(RuntimeError, match="never reached the fp32 master weights"):
        opt.step()
    amp.deinitialize()


# -- zero_grad() abandoning a delay_unscale accumulation ---------------------------------------------------------------
def _grads_of_one_block(level: str, abandon_first: bool, step_after: bool = False) -> list[torch.Tensor]:
    """The grads the optimizer reads after one plain block, optionally preceded by an abandoned accumulation."""
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    if abandon_first:
        opt.zero_grad()
        with amp.scale_loss(mse(model(x[:16]), y[:16]), opt) as scaled:
            scaled.backward()
        with amp.scale_loss(mse(model(x[16:32]), y[16:32]), opt, delay_unscale=True) as scaled:
            scaled.backward()
        opt.zero_grad()  # drop this accumulation: a bad batch, say
        if step_after:
            opt.step()  # nothing left to step on: must not be refused as "still scaled"
    opt.zero_grad()
    with amp.scale_loss(mse(model(x[32:]), y[32:]), opt) as scaled:
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

    Found by: the review of the loss-scaling and overflow machinery.
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

    Found by: the review of the loss-scaling and overflow machinery.
    """
    _grads_of_one_block(level, abandon_first=True, step_after=True)


# -- accumulation in a multi-rank job: the earlier blocks' grads stay in .grad ------------------------------------
def _accumulated(level: str, ranks: int, monkeypatch: pytest.MonkeyPatch, raise_in_second: bool = False) -> Any:
    """Grads and weights after two blocks and a step, with ``ranks`` as the job's world size (one process: what
    changes is where amp keeps the first block's grads while the second backward runs)."""
    import types

    from ampinit._masters import grads

    # The grads' view of the job only (the overflow agreement would all-reduce on a process group).
    monkeypatch.setattr(grads, "_distributed", types.SimpleNamespace(world_size=lambda: ranks))
    kept: list[bool] = []  # what the second block's entry decided
    decide = grads._accumulates_in_place
    monkeypatch.setattr(grads, "_accumulates_in_place", lambda *args: kept.append(decide(*args)) or kept[-1])
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        opt.zero_grad()
        scale_loss_block(model, opt, x[:32], y[:32], inf=False, defer=False)
        first = [p.grad.clone() for p in model.parameters()]
        if raise_in_second:
            with pytest.raises(KeyError):
                with amp.scale_loss(mse(model(x[32:]), y[32:]), opt):
                    raise KeyError("before the backward")
            assert kept == [ranks > 1]
            return first, [p.grad.clone() for p in model.parameters()]
        scale_loss_block(model, opt, x[32:], y[32:], inf=False, defer=False)
        assert kept == [ranks > 1]
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return grads, [p.detach().clone() for p in model.parameters()]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O0", "O1", "O4"])
def test_an_accumulation_kept_in_place_for_the_ranks_gives_the_stashed_bits(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a multi-rank job the first block's grads are multiplied by the second block's scale in place (a power of
    # two: exact) and unscaled with the second backward's, where one process stashes and adds them back.
    for got, want in zip(_accumulated(level, 2, monkeypatch), _accumulated(level, 1, monkeypatch)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_block_that_raises_gives_back_the_grads_kept_in_place(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first, after = _accumulated(level, 2, monkeypatch, raise_in_second=True)
    assert all(torch.equal(a, b) for a, b in zip(first, after))
