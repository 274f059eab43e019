"""Review of the master-weight machinery, checkpoints and teardown: each test here failed on the code it was written
against, and its docstring says which rule it checks (Apex's documented behaviour, plain torch, or fp32 training
written out in the test)."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests.conftest import make_problem

FP32_MASTER_SETUPS: list[tuple[str, bool | str]] = [("O2", True), ("O5", True)]
MASTER_SETUPS: list[tuple[str, bool | str]] = [*FP32_MASTER_SETUPS, ("O5", "remainder")]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def amp_iteration(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- lr schedulers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "master_weights"), [("O0", None), ("O1", None), *MASTER_SETUPS])
def test_an_lr_scheduler_created_after_initialize_works(level: str, master_weights: bool | str | None) -> None:
    """The usual order, ``model, opt = amp.initialize(...)`` and then ``scheduler = StepLR(opt, ...)``, must work.

    torch's LRScheduler wraps ``opt.step`` through ``opt.step.__func__`` (torch/optim/lr_scheduler.py,
    ``patch_track_step_called``). Apex bound its patched step with ``types.MethodType``, so that worked; amp's
    step was a plain function and the scheduler's constructor raised ``AttributeError: 'function' object has no
    attribute '__func__'`` at every opt level. The run must equal the same run with the scheduler created before
    ``initialize`` (which the old code handled).
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
    the optimizer's own (compared with an untouched copy trained in fp32)."""
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


# -- a refused step must not consume the pending skip ----------------------------------------------------------
@pytest.mark.parametrize(("level", "master_weights"), MASTER_SETUPS)
def test_a_refused_closure_step_keeps_the_overflow_skip(level: str, master_weights: bool | str) -> None:
    """After an overflow, ``opt.step(closure)`` is refused (closures are not supported with master weights). The
    skip that the overflow decided must still apply to the next ``opt.step()``.

    Apex: the overflow patches ``step`` with ``skip_step``, which raises on a closure *before* restoring the
    original step (shared/reference/apex-amp.md §1.2), so the following ``step()`` is still the skip. The old code
    consumed the skip before raising, and the retried step applied the inf/NaN gradients to the weights.
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


def test_a_remainder_step_is_seen_by_a_scheduler_created_before_initialize() -> None:
    """With ``master_weights="remainder"`` the step is always taken by amp and the original ``step`` (here the
    wrapper of an lr scheduler created before ``initialize``) is never called, so torch's scheduler never learnt
    that the optimizer had stepped and warned "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" on a correct loop. fp32 masters' fused path records the step (``opt._opt_called``); the
    remainder path must too."""
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
    two groups after ``deinitialize()``). It must be refused as torch refuses it, with the optimizer unchanged."""
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
    ``step()`` after closing moved the weights 65536 times too far. Reference: fp32 backward on a copy."""
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
    and ``deinitialize()`` raised ``ValueError: join needs a bfloat16 weight``."""
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


# -- deep copies (EMA helpers) --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "master_weights"), [("O1", None), ("O4", None), *MASTER_SETUPS])
def test_a_model_can_be_deep_copied_after_initialize(level: str, master_weights: bool | str | None) -> None:
    """``copy.deepcopy(model)`` after ``initialize`` is how EMA helpers (timm's ``ModelEmaV2``, created after
    ``amp.initialize`` in timm's train.py) build their copy; Apex's O1 leaves the model alone, so it works there.
    It raised ``TypeError: cannot pickle '_thread._local' object`` at O1/O4: the model's hooks were bound
    methods of its ``ModelCast``, and copying that copied the session (at O2/O5 too, without an error). The copy
    must run like the original, give its own weights in its state dict, and stay put while the original trains."""
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
    same module without amp (no hook of the session runs), and the original keeps training."""
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
