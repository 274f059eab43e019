"""No inf/NaN gradient reaches the weights, at any level, by default (and Apex's behaviour when asked for).

The fault-injection test plants inf or NaN at random (seeded) iterations, micro-batches, losses and parameters,
under every level, 1-3 losses, 1-2 optimizers, gradient accumulation and sync-free mode on and off. Its reference
is the rule written out in the test: an optimizer skips exactly when a ``scale_loss`` block it was passed to,
since its last step, produced a non-finite gradient; a skipped step leaves weights and optimizer state bitwise
unchanged; a taken step leaves every weight finite.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests._amp_loop import mse, plant_inf_in_fc1
from tests.conftest import SmallNet, make_problem

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "fused-adamw":
        # Adam's eps=1e-8 underflows in pure fp16 (O3): a larger one keeps O3 finite without faults.
        return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _fault_injection_case(seed: int) -> None:
    rng = random.Random(seed)
    level = LEVELS[seed % len(LEVELS)]
    num_losses = rng.randint(1, 3)
    num_opts = rng.randint(1, 2)
    micro = rng.randint(1, 3)
    sync_free = rng.random() < 0.5
    kind = rng.choice(["sgd", "fused-adamw"])
    models: list[SmallNet] = []
    x = y = torch.empty(0)
    for i in range(num_opts):
        model, x, y = make_problem(seed=seed * 10 + i)
        model.eval()  # fixed BatchNorm statistics: weights move only through the optimizer
        models.append(model)
    opts = [_make_optimizer(kind, m) for m in models]
    amp.initialize(models, opts, opt_level=level, num_losses=num_losses, verbosity=0, sync_free=sync_free)
    expected_skips = 0
    for iteration in range(10):
        for opt in opts:
            opt.zero_grad()
        marked = [False] * num_opts
        for _ in range(micro):
            for loss_id in range(num_losses):
                # Each loss reaches a random non-empty subset of the optimizers; small losses, so that fp16 at a
                # scale of 2**16 never overflows by itself and every non-finite gradient is a planted one.
                members = [o for o in range(num_opts) if rng.random() < 0.7] or [rng.randrange(num_opts)]
                out = sum(models[o](x[loss_id::num_losses]) for o in members)
                assert isinstance(out, torch.Tensor)
                loss = (out.float() - y[loss_id::num_losses]).pow(2).mean() * 1e-4
                fault = rng.random() < 0.15
                with amp.scale_loss(loss, [opts[o] for o in members], loss_id=loss_id) as scaled:
                    scaled.backward()
                    if fault:
                        victim = models[rng.choice(members)]
                        param = rng.choice([p for p in victim.parameters() if p.grad is not None])
                        assert param.grad is not None
                        flat = param.grad.view(-1)
                        flat[rng.randrange(flat.numel())] = rng.choice([float("inf"), float("-inf"), float("nan")])
                if fault:
                    for o in members:
                        marked[o] = True
        for index, (model, opt) in enumerate(zip(models, opts)):
            weights, state = _model_tensors(model), _state(opt)
            opt.step()
            context = f"seed {seed} ({level}, {num_losses} losses, {num_opts} opts, {micro} micro, sync_free="
            context += f"{sync_free}, {kind}) iteration {iteration} optimizer {index}"
            assert amp.step_was_skipped(opt) == marked[index], context
            if marked[index]:
                expected_skips += 1
                assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights)), context
                assert all(torch.equal(a, b) for a, b in zip(_state(opt), state)), context
            else:
                assert all(torch.isfinite(p).all() for p in model.parameters()), context
                assert all(torch.isfinite(m).all() for m in amp.master_params(opt)), context
    stats = amp.stats()
    assert stats.skipped_steps == expected_skips and stats.steps == 10 * num_opts
    amp.deinitialize()


@pytest.mark.parametrize("seed", range(18))
def test_fault_injection_never_corrupts_an_update(seed: int) -> None:
    _fault_injection_case(seed)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_loss_is_skipped_at_every_level(level: str, bad: float) -> None:
    model, x, y = make_problem()
    opt = torch.optim.AdamW(model.parameters(), 1e-3, eps=1e-4)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    weights = _model_tensors(model)
    with amp.scale_loss((model(x).float() - y).pow(2).mean() * bad, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt) and amp.stats().skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())
    amp.deinitialize()


@pytest.mark.parametrize("level", LEVELS)
def test_unskipped_counts_clean_unscale_steps_at_every_level(level: str) -> None:
    # Apex's ``_unskipped``: clean unscale steps since the scale last changed. 60 clean steps give 60 at every
    # level (dynamic scales grow only after 2000), where O0/O3/O4 used to report 0.
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    for _ in range(60):
        opt.zero_grad()
        with amp.scale_loss((model(x).float() - y).pow(2).mean() * 1e-3, opt) as scaled:
            scaled.backward()
        opt.step()
    assert amp.stats().unskipped == (60,)
    assert amp.stats().skipped_steps == 0
    amp.deinitialize()


@pytest.mark.parametrize(("level", "overrides"), [("O0", {}), ("O3", {}), ("O4", {}), ("O2", {"loss_scale": 128.0})])
def test_opt_out_gives_apex_static_scale_behaviour(level: str, overrides: dict[str, object]) -> None:
    # Apex never checks under a static scale: the step is taken and the weights become non-finite.
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0, skip_nonfinite=False, **overrides)
    with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
        grad = model.fc2.bias.grad
        assert grad is not None
        grad[0] = float("inf")
    opt.step()
    assert not amp.step_was_skipped(opt) and amp.stats().skipped_steps == 0
    assert not torch.isfinite(model.fc2.bias).all()
    # O0/O3/O4 then do nothing at scale_loss (no unscale step to count); O2 counts it as Apex's static scaler does.
    assert amp.stats().unskipped == ((1,) if level == "O2" else (0,))
    amp.deinitialize()


def test_opt_out_keeps_dynamic_skipping() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0, skip_nonfinite=False)
    weights = _model_tensors(model)
    with amp.scale_loss((model(x).float() - y).pow(2).mean() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt) and amp.stats().loss_scales == (32768.0,)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    amp.deinitialize()


@pytest.mark.parametrize("value", ["False", 0, None])
def test_skip_nonfinite_must_be_a_bool(value: object) -> None:
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False, got"):
        ampinit.initialize(model, opt, opt_level="O0", skip_nonfinite=value)  # type: ignore[arg-type]
    assert ampinit.current_session() is None


# -- a refused closure does not consume the pending skip ---------------------------------------------------------------
@pytest.mark.parametrize("sync_free", [False, True])
def test_pending_skip_survives_a_step_refused_for_its_closure(sync_free: bool) -> None:
    """After an overflow, ``step(closure)`` is refused; the skip must still be pending for the next ``step()``.

    Apex (§1.2: ``skip_step`` raises "Currently, Amp does not support closure use with optimizers." before it
    restores ``opt.step``) keeps the one-shot skip in place when the closure is refused, so the following
    ``step()`` is still skipped. The current code consumes the skip decision and then raises: at O1 the next
    ``step()`` applies the inf grads, and the weights become non-finite.

    Found by: the review of the loss-scaling and overflow machinery.
    """
    model, x, y = make_problem()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0, sync_free=sync_free)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
        plant_inf_in_fc1(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="does not support closure"):
        opt.step(lambda: mse(model(x), y))
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    amp.deinitialize()
