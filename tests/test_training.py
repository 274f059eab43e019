"""Training under every opt level, compared with references: plain fp32, native torch.amp, and plain
re-implementations of half-model + fp32-master training written out in the tests."""

from __future__ import annotations

import copy
import io
import logging
import re
import threading

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from tests._amp_loop import overflowing_run
from tests._device import device_under_test, on_device
from tests.conftest import SmallNet, make_problem

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
HALF = {
    "O1": torch.float16,
    "O2": torch.float16,
    "O3": torch.float16,
    "O4": torch.bfloat16,
    "O5": torch.bfloat16,
}


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def amp_train(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = mse(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_training(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bitwise on CPU. On CUDA, where amp's Triton kernels take the optimizer step (docs/opt-levels.md), within
    rounding: torch's CUDA kernels are compiled with fused multiply-adds (nvcc contracts ``a * b + c``), amp's
    kernels round each multiply and add as torch's CPU kernels do, so the two part in the last bits of a step (the
    H100 check: at most 1.9e-9 apart, 5 of 16 elements, after 6 SGD steps). The tolerance is float32 rounding for
    float32 tensors and one unit of the format for half ones, whose rounding a last-bit master difference flips.
    """
    assert actual.dtype == expected.dtype, name
    if actual.device.type == "cpu" or not actual.is_floating_point():  # counters (BatchNorm's) are exact anywhere
        assert torch.equal(actual, expected), name
        return
    rtol = 2e-6 if actual.dtype == torch.float32 else torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-7, msg=name)


# -- each level against its reference -------------------------------------------------------------------------
def test_o0_is_plain_fp32_training() -> None:
    model, x, y = on_device(make_problem())
    # fc1's bias feeds BatchNorm, so its grad is rounding noise, which Adam scales into full-size steps: where the
    # step's arithmetic differs in the last bit (on CUDA, above) the two runs would part ways there. Frozen.
    model.fc1.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], 1e-2)
    amp.initialize(model, opt, opt_level="O0", verbosity=0)
    try:
        amp_train(model, opt, x, y, 5)
    finally:
        amp.deinitialize()
    for _ in range(5):
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_same_training(a, b, k)


@pytest.mark.parametrize(("level", "dtype"), [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_function_cast_levels_match_native_autocast(level: str, dtype: torch.dtype) -> None:
    model, x, y = on_device(make_problem())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.05), torch.optim.SGD(ref.parameters(), 0.05)
    # With PyTorch's own op lists the O1/O4 engine must be native autocast (+ GradScaler), step for step.
    amp.initialize(model, opt, opt_level=level, verbosity=0, cast_policy="native")
    losses = amp_train(model, opt, x, y, 6)
    stats = amp.stats()
    amp.deinitialize()

    scaler = torch.amp.GradScaler(device_under_test().type, enabled=level == "O1")
    ref_losses = []
    for _ in range(6):
        ref_opt.zero_grad()
        with torch.autocast(device_under_test().type, dtype=dtype):
            loss = mse(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    if level == "O1":
        assert stats.loss_scales[0] == scaler.get_scale()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)


def reference_master_training(
    model: nn.Module, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, steps: int, scale: float
) -> nn.Module:
    """Half model, fp32 affine BatchNorm, fp32 master weights, static loss scale: written out by hand."""
    model = copy.deepcopy(model)
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for module in model.modules():
        if not isinstance(module, nn.BatchNorm1d):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                setattr(module, name, b.to(dtype))
    opt = torch.optim.SGD(masters, 0.05, momentum=0.9)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        loss = mse(model(x.to(dtype)).float(), y)
        (loss.float() * scale).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float() * (1.0 / scale)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return model


@pytest.mark.parametrize(
    ("level", "dtype", "scale"),
    [
        ("O2", torch.float16, 128.0),
        ("O2", torch.float16, 1.0),
        ("O5", torch.bfloat16, 1.0),
        ("O5", torch.bfloat16, 3.0),  # not a power of two: unscaled after widening
        ("O2", torch.bfloat16, 1024.0),  # a power of two on bf16: unscaled before widening, still exact
    ],
)
def test_master_weight_levels_match_a_plain_reimplementation(level: str, dtype: torch.dtype, scale: float) -> None:
    model, x, y = on_device(make_problem())
    ref = reference_master_training(model, dtype, x, y, 6, scale)
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    amp.initialize(model, opt, opt_level=level, cast_model_type=dtype, loss_scale=scale, verbosity=0)
    try:
        amp_train(model, opt, x, y, 6)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert_same_training(p.detach(), r.detach(), name)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_master_weight_levels_track_fp32_training(level: str) -> None:
    model, x, y = on_device(make_problem())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.parameters(), 1e-2)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    losses = amp_train(model, opt, x, y, 30)
    skipped = amp.stats().skipped_steps
    amp.deinitialize()
    ref_losses = []
    for _ in range(30 - skipped):
        ref_opt.zero_grad()
        loss = mse(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.1)


def test_o3_is_plain_half_training() -> None:
    model, x, y = on_device(make_problem())
    ref = copy.deepcopy(model).half()
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.05), torch.optim.SGD(ref.parameters(), 0.05)
    amp.initialize(model, opt, opt_level="O3", verbosity=0)
    amp_train(model, opt, x, y, 4)
    for _ in range(4):
        ref_opt.zero_grad()
        mse(ref(x.half()), y).backward()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
    amp.deinitialize()


# -- O2/O3/O5 model casting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_model_cast_inputs_outputs_and_batchnorm(level: str) -> None:
    model, x, _ = make_problem()
    seen = {}
    model.fc1.register_forward_pre_hook(lambda m, args: seen.update(input=args[0].dtype))
    amp.initialize(model, opt_level=level, verbosity=0)
    out = model(x.double())
    assert seen["input"] == HALF[level]
    assert out.dtype == torch.float32
    keep_bn = level != "O3"
    assert model.bn.weight.dtype == (torch.float32 if keep_bn else HALF[level])
    assert model.bn.running_mean.dtype == (torch.float32 if keep_bn else HALF[level])
    assert model.ln.weight.dtype == HALF[level]  # Apex keeps only BatchNorm in fp32
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())
    amp.deinitialize()


def test_cast_model_outputs_and_structured_io() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch: dict[str, torch.Tensor], *, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            assert batch["x"].dtype == torch.float16 and scale.dtype == torch.float16
            assert batch["ids"].dtype == torch.int64
            return self.fc(batch["x"]) * scale, batch["ids"]

    model = Pair()
    amp.initialize(model, opt_level="O2", cast_model_outputs=torch.bfloat16, verbosity=0)
    out, ids = model({"x": torch.randn(2, 4), "ids": torch.arange(2)}, scale=torch.tensor(2.0))
    assert out.dtype == torch.bfloat16 and ids.dtype == torch.int64
    amp.deinitialize()


def test_loading_fp32_state_dict_into_half_model_sets_masters() -> None:
    model, _, _ = make_problem()
    checkpoint = params_of(SmallNet())
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model.load_state_dict(checkpoint)
    for key, value in model.state_dict().items():
        assert torch.equal(value, checkpoint[key]), key  # exact: read back from the masters
    for p, m in zip(model.parameters(), amp.master_params(opt)):
        assert m.dtype == torch.float32
        assert torch.equal(p, m.to(p.dtype))
    amp.deinitialize()


# -- master weights ------------------------------------------------------------------------------------------
def test_master_params_clip_unscaled_grads() -> None:
    model, x, y = make_problem()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=1024.0, verbosity=0)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 and m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=1e9)
    mse(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1e9)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=2e-2)  # half forward, not 1024x off
    assert model.fc1.weight.grad.abs().max() > 10 * masters[0].grad.abs().max()  # model grads stay scaled (Apex)
    amp.deinitialize()


def test_existing_optimizer_state_is_carried_to_masters() -> None:
    model, x, y = make_problem()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    mse(model(x), y).backward()
    opt.step()
    before = {name: t.clone() for name, t in opt.state[model.fc1.weight].items()}
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    master = opt.param_groups[0]["params"][0]
    assert master is not model.fc1.weight and master.dtype == torch.float32
    for name, value in before.items():
        assert torch.equal(opt.state[master][name], value), name
    assert model.fc1.weight not in opt.state
    amp.deinitialize()


def test_add_param_group_after_initialize_gets_masters() -> None:
    model, x, y = make_problem()
    body = [p for n, p in model.named_parameters() if not n.startswith("head")]
    opt = torch.optim.SGD(body, 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.5})
    new = opt.param_groups[1]["params"]
    assert all(p.dtype == torch.float32 for p in new) and new[0] is not model.head.weight
    head_before = model.head.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(mse(model(x), y), opt, loss_id=0) as scaled:
            scaled.backward()
        opt.step()
    assert not torch.equal(model.head.weight, head_before)
    assert torch.equal(model.head.weight, new[0].to(torch.float16))
    amp.deinitialize()


def test_grads_that_skip_scale_loss_are_reported() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O5", verbosity=0)
    mse(model(x), y).backward()
    with pytest.raises(RuntimeError, match=re.escape("never reached the fp32 master weights")):
        opt.step()
    amp.deinitialize()


# -- skipped steps -------------------------------------------------------------------------------------------
def state_snapshot(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    tensors += [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("level", ["O1", "O2", "O5", "O3-dynamic"])
def test_overflow_skips_step_bitwise_and_backs_off(level: str) -> None:
    model, x, y = on_device(make_problem())
    opt = torch.optim.Adam(model.parameters(), 1e-3, eps=1e-4)  # eps=1e-8 underflows in pure fp16 (O3)
    opt_level, overrides = (level, {}) if "-" not in level else ("O3", {"loss_scale": "dynamic"})
    amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **overrides)
    amp_train(model, opt, x, y, 2)  # settle the scale (fp16 may overflow at 2**16)
    scale_before = amp.stats().loss_scales[0]
    skipped_before = amp.stats().skipped_steps
    weights_before = [p.detach().clone() for p in model.parameters()]  # buffers: BN statistics move in forward
    state_before = state_snapshot(opt)
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
        model.fc2.bias.grad[0] = float("nan")
    assert opt.step() is None
    assert amp.step_was_skipped() and amp.step_was_skipped(opt)
    for a, b in zip(state_snapshot(opt), state_before):
        assert torch.equal(a, b)
    for p, before in zip(model.parameters(), weights_before):
        assert torch.equal(p, before)
    expected_scale = scale_before / 2 if level != "O5" else scale_before  # O5: static scale, still skipped
    assert amp.stats().loss_scales[0] == expected_scale
    amp_train(model, opt, x, y, 1)
    assert not amp.step_was_skipped()
    stats = amp.stats()
    assert stats.skipped_steps == skipped_before + 1 and stats.steps == 4  # the injected NaN, and nothing after it
    amp.deinitialize()


def test_overflow_log_matches_apex_and_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ampinit"):
        overflowing_run(20)
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert messages[0] == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 536870912.0"
    assert len(messages) == 8 + 1  # the first 8, then only the 16th of 20
    assert "16 overflows so far" in messages[-1]
    amp.deinitialize()


def test_static_scale_with_masters_never_applies_inf() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=1.0, verbosity=0)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    opt.step()
    assert amp.step_was_skipped()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert amp.stats().loss_scales == (1.0,)
    amp.deinitialize()


def test_raise_at_min_scale() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    config = ampinit.DynamicLossScale(init_scale=4.0, min_scale=2.0, raise_at_min=True)
    amp.initialize(model, opt, opt_level="O2", loss_scale=config, verbosity=0)
    # The first overflow backs 4.0 off to the floor; the next one, at the floor, raises.
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    opt.step()
    assert amp.stats().loss_scales == (2.0,)
    with (
        pytest.raises(ampinit.LossScaleAtMinimumError, match=re.escape("already at its minimum loss scale 2.0")),
        amp.scale_loss(mse(model(x), y), opt) as scaled,
    ):
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    amp.deinitialize()


@pytest.mark.parametrize("defer", [False, True])
def test_raise_at_min_scale_still_skips_the_overflowing_step(defer: bool) -> None:
    """LossScaleAtMinimumError is raised once the overflow is decided: a loop that catches it and steps anyway (or
    retries a step that raised it, with ``delay_overflow_check=True``) must not put the inf into the weights.

    Found by: the loss-scaling audit (the raise came before the step was marked to skip, so the step after a caught
    error was taken with the non-finite grads)."""
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    config = ampinit.DynamicLossScale(init_scale=2.0, min_scale=2.0, raise_at_min=True)
    amp.initialize(model, opt, opt_level="O2", loss_scale=config, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampinit.LossScaleAtMinimumError):
        with amp.scale_loss(mse(model(x), y), opt, delay_overflow_check=defer) as scaled:
            scaled.backward()
            model.fc1.weight.grad[0, 0] = float("inf")
        opt.step()
    opt.step()  # the loop goes on after the error
    assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    stats = amp.stats()
    assert (stats.steps, stats.skipped_steps, stats.loss_scales, stats.unskipped) == (1, 1, (2.0,), (0,))
    amp.deinitialize()


def test_min_loss_scale_floor() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", min_loss_scale=16384.0, verbosity=0)
    for _ in range(4):
        with amp.scale_loss(mse(model(x), y), opt) as scaled:
            scaled.backward()
            model.fc1.weight.grad[0, 0] = float("nan")
        opt.step()
    assert amp.stats().loss_scales == (16384.0,)
    amp.deinitialize()


def test_delay_overflow_check_decides_at_step() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(mse(model(x), y), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    assert amp.stats().loss_scales == (65536.0,)  # not decided yet
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.step_was_skipped() and amp.stats().loss_scales == (32768.0,)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    amp.deinitialize()


# -- several losses, models, optimizers ----------------------------------------------------------------------
def test_per_loss_scalers_follow_apex_trace() -> None:
    # Apex's verified trace: num_losses=2, loss_id=1, inf injected at iteration 1.
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    trace = []
    for i in range(3):
        opt.zero_grad()
        with amp.scale_loss(mse(model(x), y) * 1e-3, opt, loss_id=1) as scaled:
            scaled.backward()
            if i == 1:
                model.fc1.weight.grad[0, 0] = float("inf")
        opt.step()
        trace.append(dict(amp.state_dict()))
    assert trace[0]["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert trace[0]["loss_scaler1"] == {"loss_scale": 65536.0, "unskipped": 1}
    assert trace[1]["loss_scaler1"] == {"loss_scale": 32768.0, "unskipped": 0}
    assert trace[2]["loss_scaler1"] == {"loss_scale": 32768.0, "unskipped": 1}
    amp.deinitialize()


def test_gan_style_models_optimizers_and_losses() -> None:
    torch.manual_seed(0)
    gen, disc = (
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)),
        nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(), nn.Linear(8, 1)),
    )
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O2", num_losses=3, verbosity=0)
    bce = nn.BCEWithLogitsLoss()
    real = torch.randn(16, 4)
    for _ in range(3):
        opt_d.zero_grad()
        err_real = bce(disc(real), torch.ones(16, 1))
        with amp.scale_loss(err_real, opt_d, loss_id=0) as s:
            s.backward()
        fake = gen(torch.randn(16, 4))
        err_fake = bce(disc(fake.detach()), torch.zeros(16, 1))
        with amp.scale_loss(err_fake, opt_d, loss_id=1) as s:
            s.backward()
        opt_d.step()
        opt_g.zero_grad()
        err_g = bce(disc(fake), torch.ones(16, 1))
        with amp.scale_loss(err_g, opt_g, loss_id=2) as s:
            s.backward()
        opt_g.step()
    assert len(amp.state_dict()) == 3
    assert all(torch.isfinite(p).all() and p.dtype == torch.float16 for p in [*gen.parameters(), *disc.parameters()])
    amp.deinitialize()


# -- gradient accumulation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("delay", [True, False])
def test_accumulation_equals_one_big_backward(level: str, delay: bool) -> None:
    model, x, y = on_device(make_problem(n=64))
    model.eval()  # BatchNorm in eval mode: per-micro-batch statistics would differ from the full batch
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(twin.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, loss_scale=256.0 if level != "O5" else None, verbosity=0)
    amp.initialize(twin, twin_opt, opt_level=level, loss_scale=256.0 if level != "O5" else None, verbosity=0)
    for i, (xb, yb) in enumerate(zip(x.chunk(4), y.chunk(4))):
        with amp.scale_loss(mse(model(xb), yb) / 4, opt, delay_unscale=delay and i < 3) as scaled:
            scaled.backward()
    with amp.scale_loss(mse(twin(x), y), twin_opt) as scaled:
        scaled.backward()
    atol = 1e-3 if level in ("O4", "O5") else 1e-4  # bf16 forward: micro-batches round differently
    for p, q in zip(amp.master_params(opt), amp.master_params(twin_opt)):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=atol)
    amp.deinitialize()
    amp.deinitialize()


def test_step_with_grads_still_scaled_is_refused() -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(mse(model(x), y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match=re.escape("gradients are still scaled")):
        opt.step()
    amp.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("where", ["body", "backward"])
def test_exception_in_scale_loss_leaves_grads_as_before(level: str, where: str) -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0, loss_scale=128.0)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    grads_before = [p.grad.clone() for p in amp.master_params(opt)]

    class Boom(Exception):
        pass

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise Boom

    out = model(x)
    if where == "backward":
        out.register_hook(explode)
    with pytest.raises(Boom), amp.scale_loss(mse(out, y), opt) as scaled:
        if where == "body":
            raise Boom
        scaled.backward()
    assert not torch.is_autocast_enabled("cpu") or level == "O1"
    for p, g in zip(amp.master_params(opt), grads_before):
        assert torch.equal(p.grad, g)
    if level == "O2":
        assert all(p.grad is None for p in model.parameters() if p.dtype == torch.float16)
    opt.step()  # a clean step still works
    assert not amp.step_was_skipped()
    amp.deinitialize()


# -- O1 scope --------------------------------------------------------------------------------------------------
def test_o1_scope_forward_loss_step_and_threads() -> None:
    model, x, y = make_problem()
    seen: dict[str, object] = {}

    class Probe(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            seen["step_autocast"] = torch.is_autocast_enabled("cpu")
            return super().step(closure)

    opt = Probe(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O4", verbosity=0)
    w = torch.randn(8, 8)
    assert (x @ w).dtype == torch.bfloat16  # outside the model, in the initializing thread
    with amp.disable_casts():
        assert (x @ w).dtype == torch.float32
        assert model(x).dtype == torch.float32
    assert (x @ w).dtype == torch.bfloat16
    with pytest.raises(ZeroDivisionError), amp.disable_casts():
        raise ZeroDivisionError
    assert (x @ w).dtype == torch.bfloat16

    def other_thread() -> None:
        seen["thread_model"] = model(x).dtype
        seen["thread_plain"] = (x @ w).dtype

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen["thread_model"] == torch.bfloat16 and seen["thread_plain"] == torch.float32
    amp_train(model, opt, x, y, 1)
    assert seen["step_autocast"] is False
    amp.deinitialize()
    assert (x @ w).dtype == torch.float32


# -- checkpoints -------------------------------------------------------------------------------------------------
def build(level: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = on_device(make_problem(seed=3)[0])
    opt = torch.optim.AdamW(model.parameters(), 1e-2, eps=1e-4)  # eps=1e-8 underflows in pure fp16 (O3)
    amp.initialize(
        model,
        opt,
        opt_level=level,
        verbosity=0,
        loss_scale=ampinit.DynamicLossScale(growth_interval=2) if level in ("O1", "O2") else None,
    )
    return model, opt


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_resume_is_bitwise(level: str) -> None:
    _, x, y = on_device(make_problem(seed=3))
    model, opt = build(level)
    amp_train(model, opt, x, y, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, buffer)
    expected_losses = amp_train(model, opt, x, y, 4)
    expected = params_of(model)
    expected_amp = amp.state_dict()
    amp.deinitialize()

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model, opt = build(level)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    assert amp_train(model, opt, x, y, 4) == expected_losses
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert amp.state_dict() == expected_amp
    amp.deinitialize()


def test_load_state_dict_follows_apex_key_rules() -> None:
    model = SmallNet()
    amp.initialize(model, opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict(
        {
            "loss_scaler7": {"loss_scale": 8.0, "unskipped": 3},
            "loss_scaler0": {"loss_scale": 4.0, "unskipped": 1},
        }
    )
    # Position decides, not the number in the key.
    assert amp.state_dict() == {
        "loss_scaler0": {"loss_scale": 8.0, "unskipped": 3},
        "loss_scaler1": {"loss_scale": 4.0, "unskipped": 1},
    }
    with pytest.warns(UserWarning, match=re.escape("state_dict contains 1 entries, while 2 loss_scalers are used")):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})
    with (
        pytest.raises(RuntimeError, match=re.escape('Unexpected key(s) in state_dict: "model", "step". ')),
        pytest.warns(UserWarning, match="3 entries"),
    ):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "model": {}, "step": 1})
    with pytest.warns(UserWarning) as record:
        amp.load_state_dict({f"loss_scaler{i}": {"loss_scale": 1.0, "unskipped": 0} for i in range(3)})
    assert [str(w.message) for w in record] == [
        "state_dict contains 3 entries, while 2 loss_scalers are used",
        "Skipping loss_scaler[2], since num_losses was set to 2",
    ]
    amp.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_resume_in_fresh_process_is_bitwise(level: str, tmp_path: pytest.TempPathFactory) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    base = str(tmp_path) + "/run"
    for mode in ("first", "resume"):
        subprocess.run(
            [sys.executable, "-m", "tests._resume_script", level, mode, base],
            cwd=root,
            check=True,
            timeout=120,
        )
    uninterrupted = torch.load(base + ".first", weights_only=True)
    resumed = torch.load(base + ".resume", weights_only=True)
    assert resumed["amp"] == uninterrupted["amp"]
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def test_verbosity_zero_silences_overflow_messages(caplog: pytest.LogCaptureFixture) -> None:
    model, x, y = make_problem()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with caplog.at_level(logging.DEBUG, logger="ampinit"):
        with amp.scale_loss(mse(model(x), y), opt) as scaled:
            scaled.backward()
            model.fc1.bias.grad[0] = float("inf")
        opt.step()
    assert amp.step_was_skipped() and caplog.records == []
    amp.deinitialize()
