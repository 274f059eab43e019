"""The situations of Apex's L0 amp tests (tests/L0/run_amp), written afresh for the CPU against the Apex aliases:
basic casts, promotion, the cast cache, add_param_group, several models/optimizers/losses with injected
overflows, FusedSGD, LARC under amp, and the multi-tensor ops. Each compares with a plain fp32 reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampinit
from ampinit.compat.apex import amp, amp_C
from ampinit.compat.apex.amp.amp import cast_devices
from ampinit.compat.apex.multi_tensor_apply import multi_tensor_applier
from ampinit.compat.apex.optimizers import FusedSGD
from ampinit.compat.apex.parallel.LARC import LARC
from tests._device import device_under_test


def cast_by_amp_init(device: torch.device) -> bool:
    """Apex's rule: ``amp.init()`` casts CUDA tensors only; ampinit casts the CPU's on a machine without CUDA."""
    return device.type == "cuda" or not torch.cuda.is_available()


@pytest.fixture
def handle():  # type: ignore[no-untyped-def]
    h = amp.init()
    yield h
    h._deactivate()


# -- test_basic_casts / test_promotion -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x, w: torch.mm(x, w), torch.float16),
        (lambda x, w: nn.functional.linear(x, w), torch.float16),
        (lambda x, w: torch.softmax(x, 0), torch.float32),
        (lambda x, w: torch.exp(x.half()), torch.float32),
        (lambda x, w: x.half().sum(), torch.float32),
        (lambda x, w: nn.functional.layer_norm(x.half(), (4,)), torch.float32),
        (lambda x, w: x.relu(), torch.float32),  # not on any list: input type kept
    ],
)
def test_basic_casts(handle: object, fn: object, expected: torch.dtype) -> None:
    device = device_under_test()
    x, w = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    if not cast_by_amp_init(device):
        with amp.disable_casts():
            expected = fn(x, w).dtype  # type: ignore[operator]  # plain torch's
    assert fn(x, w).dtype == expected  # type: ignore[operator]


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.add(a, b),
        lambda a, b: a * b,
        lambda a, b: torch.cat([a, b]),
        lambda a, b: torch.stack([a, b]),
    ],
)
def test_promotion_of_mixed_inputs(handle: object, fn: object) -> None:
    a, b = torch.randn(3).half(), torch.randn(3)
    assert fn(a, b).dtype == torch.float32  # type: ignore[operator]
    assert fn(a, a).dtype == torch.float16  # type: ignore[operator]


def test_disable_casts_region(handle: object) -> None:
    x = torch.randn(2, 2, device=device_under_test())
    with amp.disable_casts():
        assert torch.mm(x, x).dtype == torch.float32
    assert torch.mm(x, x).dtype == (torch.float16 if cast_by_amp_init(x.device) else torch.float32)


def test_cpu_is_float(handle: object) -> None:
    """TestTensorCasts.test_cpu_is_float: ``x.cpu()`` of an fp32 or fp16 tensor is a FloatTensor (on the device
    ``amp.init()`` casts: CUDA where there is one, as in Apex's test)."""
    device = cast_devices()[0]
    for dtype in (torch.float32, torch.float16):
        assert torch.randn(4, 4, device=device).to(dtype).cpu().type() == "torch.FloatTensor"


def test_inplace_exp_is_error_for_half(handle: object) -> None:
    """test_promotion's test_inplace_exp_is_error_for_half: fp32 ``exp_`` runs, fp16 ``exp_`` is refused."""
    xs = torch.randn(4)
    xs.exp_()
    assert xs.type() == "torch.FloatTensor"
    with pytest.raises(NotImplementedError):
        torch.randn(4, dtype=torch.half).exp_()


# -- test_cache ------------------------------------------------------------------------------------------------
def test_weight_used_twice_and_train_eval_train(handle: object) -> None:
    # Apex's cache raised IndexError on current torch when a cached weight was used twice in one iteration.
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    out = layer(layer(x)).float().sum()
    out.backward()
    grad = layer.weight.grad.clone()  # type: ignore[union-attr]
    with handle._disable_casts():  # type: ignore[attr-defined]
        reference = nn.Linear(4, 4)
        reference.load_state_dict(layer.state_dict())
        reference(reference(x)).sum().backward()
    torch.testing.assert_close(grad, reference.weight.grad, rtol=2e-2, atol=2e-2)
    layer.zero_grad()
    with torch.no_grad():
        layer(x)  # eval: casts made without grad
    layer(x).float().sum().backward()  # train again: the grad must still flow
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


# -- add_param_group -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_add_param_group_trains_the_new_params(level: str) -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    reference = [p.detach().clone() for p in second.parameters()]
    opt = torch.optim.SGD(first.parameters(), lr=0.5)
    model = nn.Sequential(first, second)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        opt.add_param_group({"params": list(second.parameters()), "lr": 0.25})
        if level == "O2":
            assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert all(not torch.equal(p.float(), r) for p, r in zip(second.parameters(), reference))
    finally:
        ampinit.deinitialize()


# -- test_multiple_models_optimizers_losses --------------------------------------------------------------------
def _two_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(4, 1, bias=False), nn.Linear(4, 1, bias=False)


@pytest.mark.parametrize("inject_loss", [0, 1])
def test_injected_overflow_skips_only_the_affected_optimizer(inject_loss: int) -> None:
    """Two models, two optimizers, two losses, O0 with a dynamic scale (exact fp32 math): an inf injected into the
    grads of loss ``inject_loss`` at iteration 2 skips that step of the optimizers in that block and halves only
    that loss's scale; the reference is plain fp32 SGD that simply omits the same step."""
    m0, m1 = _two_models()
    r0, r1 = _two_models()
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)
    p0, p1 = torch.optim.SGD(r0.parameters(), lr=0.1), torch.optim.SGD(r1.parameters(), lr=0.1)
    [m0, m1], [o0, o1] = amp.initialize(
        [m0, m1], [o0, o1], opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    x = torch.randn(8, 4)
    try:
        for it in range(4):
            for model, opt, ref, ref_opt, loss_id in ((m0, o0, r0, p0, 0), (m1, o1, r1, p1, 1)):
                opt.zero_grad()
                with amp.scale_loss(model(x).pow(2).mean(), opt, loss_id=loss_id) as scaled:
                    scaled.backward()
                    if it == 2 and loss_id == inject_loss:
                        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
                opt.step()
                if not (it == 2 and loss_id == inject_loss):
                    ref_opt.zero_grad()
                    ref(x).pow(2).mean().backward()
                    ref_opt.step()
                torch.testing.assert_close(model.weight, ref.weight, rtol=0, atol=0)
        scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
        assert scales == [32768.0 if i == inject_loss else 65536.0 for i in range(2)]
        assert amp.state_dict()[f"loss_scaler{inject_loss}"]["unskipped"] == 1
    finally:
        ampinit.deinitialize()


# -- test_fused_sgd / LARC under amp ---------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_sgd_matches_torch_sgd_under_amp(level: str) -> None:
    results = []
    for optimizer_class in (FusedSGD, torch.optim.SGD):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = optimizer_class(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        x, y = torch.randn(16, 6), torch.randn(16, 1)
        try:
            for _ in range(3):
                opt.zero_grad()
                with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                opt.step()
            results.append([p.detach().float().clone() for p in amp.master_params(opt)])
        finally:
            ampinit.deinitialize()
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_larc_under_amp_skips_on_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    model, larc = amp.initialize(model, larc, opt_level="O1", verbosity=0)
    try:
        before = model.weight.detach().clone()
        with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), larc) as scaled:
            scaled.backward()
            model.weight.grad.fill_(float("nan"))  # type: ignore[union-attr]
        larc.step()
        assert torch.equal(model.weight, before) and ampinit.step_was_skipped()
    finally:
        ampinit.deinitialize()


# -- multi-tensor ops (test_multi_tensor_scale / axpby / l2norm) ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multi_tensor_scale_axpby_l2norm(dtype: torch.dtype) -> None:
    flag = torch.zeros(1, dtype=torch.int)
    ins = [torch.randn(n).to(dtype) for n in (7, 333, 4096)]
    outs = [torch.empty(t.shape, dtype=torch.float32) for t in ins]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.5)
    assert flag.item() == 0 and all(torch.equal(o, t.float() * 0.5) for t, o in zip(ins, outs))
    ins[1][5] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.5)
    assert flag.item() == 1
    ys = [torch.randn(t.shape).to(dtype) for t in ins]
    ins[1][5] = 1.0
    result = [torch.empty(t.shape, dtype=dtype) for t in ins]
    flag.zero_()
    multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [ins, ys, result], 2.0, -1.0, -1)
    for x, y, r in zip(ins, ys, result):
        torch.testing.assert_close(r, (2.0 * x.float() - y.float()).to(dtype))
    norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ins], True)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([t.float() for t in ins])).reshape(1))
    torch.testing.assert_close(per_tensor, torch.stack([torch.linalg.vector_norm(t.float()) for t in ins]))
