"""Which scaler backs off, by how much, and which optimizer skips, against a plain re-implementation of Apex's rule.

Apex checks, at each ``scale_loss`` exit, only the gradients that the backward inside that block produced (with
``delay_unscale``, everything accumulated since the last unscale): an inf left in the fp32 master grads by an
earlier block of the same iteration was counted by that block and is not counted again. The reference below
is that rule written out; the tests drive ampinit through scripted iterations and compare, bitwise, the scales,
the clean-step counters, which optimizers skipped, and that a skipped optimizer's weights did not move.

``delay_overflow_check=True`` moves a block's decision (and its scale update) from the block's exit to the next
``step()`` of an optimizer the block fed (ampinit's documented replacement for Apex's "never decided"); the same
rule holds across it: one overflow halves the scale once and skips only the optimizers of its block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests._amp_loop import scale_loss_block
from tests.conftest import SmallNet, make_problem


@dataclass(frozen=True)
class Block:
    """One ``scale_loss`` block: its loss id, the optimizers passed, where an inf is planted, and delay_unscale."""

    loss_id: int
    optimizers: tuple[int, ...]
    inf_in: int | None = None  # index of the optimizer (model) whose grads get an inf in this backward
    delay: bool = False


@dataclass
class ApexReference:
    """Apex's per-exit rule (apex/amp/scaler.py and handle.py), for a dynamic or a static scale.

    Dynamic: an overflow halves the scale and zeroes ``unskipped``; a clean exit adds one (growth after 2000
    never happens in these short runs). Static (ampinit's documented extension: the step is skipped too): the
    scale never moves and an overflow zeroes the clean-step count. Every optimizer passed to an overflowing
    block skips its next step; the others step.
    """

    scales: list[float]
    dynamic: bool
    unskipped: list[int] = field(default_factory=list)
    pending: dict[int, bool] = field(default_factory=dict)  # optimizer -> whether its next step skips
    dirty: dict[int, bool] = field(default_factory=dict)  # optimizer -> inf since the last unscale (delay)

    def __post_init__(self) -> None:
        self.unskipped = [0] * len(self.scales)

    def exit_block(self, block: Block) -> None:
        for o in block.optimizers:
            self.dirty[o] = self.dirty.get(o, False) or block.inf_in == o
        if block.delay:
            return
        overflow = any(self.dirty.pop(o, False) for o in block.optimizers)
        if overflow:
            if self.dynamic:
                self.scales[block.loss_id] *= 0.5
            self.unskipped[block.loss_id] = 0
            for o in block.optimizers:
                self.pending[o] = True
        else:
            self.unskipped[block.loss_id] += 1

    def step(self, opt: int) -> bool:
        return self.pending.pop(opt, False)


def _plant_inf(model: nn.Module) -> None:
    grad = model.fc2.bias.grad
    assert grad is not None
    grad[1] = float("inf")


def _run(level: str, overrides: dict[str, object], num_losses: int, iterations: list[list[Block]]) -> None:
    torch.manual_seed(0)
    models: list[SmallNet] = []
    x = y = torch.empty(0)
    for seed in (0, 1):
        model, x, y = make_problem(seed=seed)
        model.eval()  # fixed BatchNorm statistics: weights move only through the optimizer
        models.append(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    amp.initialize(models, opts, opt_level=level, num_losses=num_losses, verbosity=0, **overrides)
    ref = ApexReference(list(amp.stats().loss_scales), dynamic=bool(amp.current_session().properties.dynamic))
    for blocks in iterations:
        for opt in opts:
            opt.zero_grad()
        for block in blocks:
            # Small losses: no natural fp16 overflow at 2**16, so every overflow is a planted one.
            out = sum(models[o](x) for o in block.optimizers)
            assert isinstance(out, torch.Tensor)
            loss = (out.float() - y).pow(2).mean() * 1e-4
            with amp.scale_loss(
                loss, [opts[o] for o in block.optimizers], block.loss_id, delay_unscale=block.delay
            ) as s:
                s.backward()
                if block.inf_in is not None:
                    _plant_inf(models[block.inf_in])
            ref.exit_block(block)
        used = {o for block in blocks for o in block.optimizers}
        for index, (model, opt) in enumerate(zip(models, opts)):
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            expect_skip = ref.step(index)
            assert amp.step_was_skipped(opt) == expect_skip, f"optimizer {index}"
            after = list(model.parameters())
            if expect_skip:
                assert all(torch.equal(a, b) for a, b in zip(after, before)), f"optimizer {index} moved on a skip"
            elif index in used:
                assert all(torch.isfinite(a).all() for a in after)
                assert not all(torch.equal(a, b) for a, b in zip(after, before)), f"optimizer {index} did not step"
        stats = amp.stats()
        assert list(stats.loss_scales) == ref.scales
        assert list(stats.unskipped) == ref.unskipped
    amp.deinitialize()


LEVELS = [
    pytest.param("O1", {}, id="O1"),
    pytest.param("O2", {}, id="O2"),
    pytest.param("O5", {}, id="O5-static"),
    pytest.param("O5", {"loss_scale": "dynamic"}, id="O5-dynamic"),
    pytest.param("O2", {"loss_scale": 128.0}, id="O2-static"),
]


@pytest.mark.parametrize(("level", "overrides"), LEVELS)
def test_accumulation_with_one_overflowing_micro_batch_backs_off_once(level: str, overrides: dict[str, object]) -> None:
    # Four micro-batches, each in its own scale_loss block (docs/faq.md's pattern), the second overflows:
    # 65536 -> 32768 once (not 65536 -> 4096, one halving per later block), then clean iterations.
    accumulate = [Block(0, (0,), inf_in=0 if i == 1 else None) for i in range(4)]
    clean = [Block(0, (0,))]
    _run(level, overrides, 1, [accumulate, clean, accumulate, clean])


@pytest.mark.parametrize(("level", "overrides"), LEVELS)
def test_delay_unscale_checks_everything_since_the_last_unscale_once(level: str, overrides: dict[str, object]) -> None:
    # Micro-batch 0 overflows with delay_unscale: block 1 unscales and counts it; blocks 2 and 3 are clean.
    blocks = [
        Block(0, (0,), inf_in=0, delay=True),
        Block(0, (0,)),
        Block(0, (0,), delay=True),
        Block(0, (0,)),
    ]
    _run(level, overrides, 1, [blocks, [Block(0, (0,))]])


@pytest.mark.parametrize(("level", "overrides"), LEVELS)
def test_inf_in_loss_0_backs_off_only_scaler_0(level: str, overrides: dict[str, object]) -> None:
    blocks = [Block(0, (0,), inf_in=0), Block(1, (0,))]
    _run(level, overrides, 2, [blocks, [Block(0, (0,)), Block(1, (0,))], blocks])


@pytest.mark.parametrize(("level", "overrides"), LEVELS)
def test_optimizer_with_finite_grads_does_not_skip(level: str, overrides: dict[str, object]) -> None:
    # Loss 0 overflows in optimizer 0's grads; loss 1 reaches both optimizers with finite grads: optimizer 0 skips
    # (marked by loss 0), optimizer 1 steps, and scaler 1 does not back off.
    blocks = [Block(0, (0,), inf_in=0), Block(1, (0, 1))]
    _run(level, overrides, 2, [blocks, [Block(0, (0,)), Block(1, (0, 1))], blocks])


@pytest.mark.parametrize(("level", "overrides"), LEVELS)
def test_overflow_in_one_of_two_optimizers_of_a_block_skips_both(level: str, overrides: dict[str, object]) -> None:
    # Apex: one scaler, one flag for the block, every optimizer passed to it skips.
    _run(level, overrides, 1, [[Block(0, (0, 1), inf_in=1)], [Block(0, (0, 1))]])


# -- delay_overflow_check: one overflow, one back-off, only the optimizers of its block skip ---------------------------
@pytest.mark.parametrize("inf_in", [0, 1], ids=["inf-in-deferred-block", "inf-in-plain-block"])
def test_deferred_then_plain_block_backs_off_once_for_one_overflow(inf_in: int) -> None:
    """One overflow must halve the scale once, whichever of the two blocks it is in.

    Two accumulation blocks on loss 0 before one ``step()``: the first with ``delay_overflow_check=True``, the
    second plain; an inf is planted in one of them. Apex's rule (one decision per exit, each on the grads of its
    own backward; an overflow halves the scale once) gives 65536 -> 32768 and a skipped step. The current code
    leaves the deferred block's flag uncleared, so the plain block's decision sees it, and the deferred decision
    taken at ``step()`` reads the same flag again: 65536 -> 16384, the overflow counted twice.

    Found by: the review of the loss-scaling and overflow machinery.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.zero_grad()
    scale_loss_block(model, opt, x[:32], y[:32], inf=inf_in == 0, defer=True)
    scale_loss_block(model, opt, x[32:], y[32:], inf=inf_in == 1, defer=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert amp.stats().loss_scales == (32768.0,)
    amp.deinitialize()


def _two_models_at_o2() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, Any, Any]:
    """Two models (eval: no BatchNorm statistics move), an SGD optimizer each, one O2 session over both."""
    (model_a, x, y), (model_b, _, _) = make_problem(0), make_problem(1)
    model_a.eval()
    model_b.eval()
    opt_a = torch.optim.SGD(model_a.parameters(), 0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), 0.1)
    amp.initialize([model_a, model_b], [opt_a, opt_b], opt_level="O2", verbosity=0)
    return model_a, model_b, opt_a, opt_b, x, y


def test_deferred_overflow_of_one_optimizer_does_not_skip_another_optimizers_clean_block() -> None:
    """A clean plain block must not be skipped because of another block's deferred overflow.

    Optimizer A's block (loss 0, ``delay_overflow_check=True``) overflows; optimizer B's block (loss 0, plain)
    is clean. Apex's rule: only the optimizers passed to an overflowing block skip, and the scale backs off once.
    Expected: B steps, A skips, scale 32768. The current code decides B's block on the flag A's block left
    raised: B skips, and A's deferred decision backs off a second time (16384).

    Found by: the review of the loss-scaling and overflow machinery.
    """
    model_a, model_b, opt_a, opt_b, x, y = _two_models_at_o2()
    scale_loss_block(model_a, opt_a, x, y, inf=True, defer=True)
    scale_loss_block(model_b, opt_b, x, y, inf=False, defer=False)
    b_before = [p.detach().clone() for p in model_b.parameters()]
    opt_b.step()
    assert not amp.step_was_skipped(opt_b), "B's own block was clean"
    assert not all(torch.equal(p, b) for p, b in zip(model_b.parameters(), b_before))
    opt_a.step()
    assert amp.step_was_skipped(opt_a)
    assert amp.stats().loss_scales == (32768.0,)
    amp.deinitialize()


def test_deferred_blocks_of_one_loss_are_decided_block_by_block() -> None:
    """Two deferred blocks on loss 0, one per optimizer, A's overflowing: only A skips, and the scale backs off once
    and counts B's clean block, as without ``delay_overflow_check`` (the decision only moves to the step).

    The deferred blocks of a scaler were folded into one flag for every optimizer they fed: B's clean step was
    skipped, and the clean block was not counted.

    Found by: the loss-scaling audit.
    """
    model_a, model_b, opt_a, opt_b, x, y = _two_models_at_o2()
    scale_loss_block(model_a, opt_a, x, y, inf=True, defer=True)
    scale_loss_block(model_b, opt_b, x, y, inf=False, defer=True)
    b_before = [p.detach().clone() for p in model_b.parameters()]
    opt_a.step()
    opt_b.step()
    assert amp.step_was_skipped(opt_a)
    assert not amp.step_was_skipped(opt_b), "B's own block was clean"
    assert not all(torch.equal(p, b) for p, b in zip(model_b.parameters(), b_before))
    stats = amp.stats()
    assert (stats.loss_scales, stats.unskipped, stats.skipped_steps) == ((32768.0,), (1,), 1)
    amp.deinitialize()


@pytest.mark.parametrize("defer", [False, True])
def test_deferred_micro_batches_count_one_unscale_step_each(defer: bool) -> None:
    """Counting is per ``scale_loss`` exit, deferred or not: two overflowing micro-batches back off twice, and
    clean ones each count towards the growth interval."""
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=ampinit.DynamicLossScale(growth_interval=4))
    opt.zero_grad()
    scale_loss_block(model, opt, x[:32], y[:32], inf=True, defer=defer)
    scale_loss_block(model, opt, x[32:], y[32:], inf=True, defer=defer)
    opt.step()
    assert amp.step_was_skipped(opt) and amp.stats().loss_scales == (16384.0,)
    for _ in range(2):
        opt.zero_grad()
        for i in range(4):
            scale_loss_block(model, opt, x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)], inf=False, defer=defer)
        opt.step()
    stats = amp.stats()
    assert (stats.loss_scales, stats.unskipped, stats.skipped_steps) == ((65536.0,), (0,), 1)
    amp.deinitialize()
