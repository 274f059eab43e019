"""ampinit.optimizers against torch.optim and against plain re-implementations of the published formulas."""

from __future__ import annotations

import copy
import io
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from ampinit import _torch_kernels
from ampinit.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tests._device import device_under_test

STEPS = 7
SIZES = (0, 1, 7, 300)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = ("multi_tensor", "single_tensor")
# One rounding of a half parameter per step can land on the neighbouring value; allow a few ulps.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def make_params(dtype: torch.dtype, sizes: tuple[int, ...] = SIZES, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device_under_test(), dtype).requires_grad_() for n in sizes]


def make_grads(params: list[Tensor], steps: int = STEPS, seed: int = 1) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params] for _ in range(steps)]


def run(optimizer: torch.optim.Optimizer, params: list[Tensor], grads: list[list[Tensor]], after: Any = None) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        if after is not None:
            after()


def fp32_shadow(params: list[Tensor]) -> list[Tensor]:
    return [p.detach().float().requires_grad_() for p in params]


def round_to(shadow: list[Tensor], dtype: torch.dtype) -> Callable[[], None]:
    """After each reference step, round the fp32 shadow as the half parameter is rounded."""

    def _round() -> None:
        with torch.no_grad():
            for p in shadow:
                p.copy_(p.to(dtype).float())

    return _round


def assert_close(actual: list[Tensor], expected: list[Tensor], dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach().float(), e.detach().float(), atol=atol, rtol=rtol)


def assert_bitwise(actual: list[Tensor], expected: list[Tensor]) -> None:
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    tensors = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
    for group in optimizer.param_groups:
        for key, value in group.items():
            if key != "params":
                values = value if isinstance(value, list) else [value]
                tensors += [v for v in values if isinstance(v, Tensor)]
    return tensors


# ---------------------------------------------------------------- against torch.optim


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch(impl: str, dtype: torch.dtype, adam_w_mode: bool) -> None:
    params = make_params(dtype)
    shadow = fp32_shadow(params)
    grads = make_grads(params)
    ours = FusedAdam(params, lr=1e-2, weight_decay=0.05, adam_w_mode=adam_w_mode, implementation=impl)  # type: ignore[arg-type]
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(shadow, lr=1e-2, weight_decay=0.05)
    run(ours, params, grads)
    run(reference, shadow, [[g.float() for g in gs] for gs in grads], round_to(shadow, dtype))
    assert_close(params, shadow, dtype)
    assert all(s["exp_avg"].dtype == torch.float32 for s in ours.state.values())
    assert int(ours.param_groups[0]["step"]) == STEPS


def test_fused_adam_large_tensor_matches_torch() -> None:
    params = make_params(torch.float32, sizes=(2**20 + 3, 5))
    shadow = fp32_shadow(params)
    grads = make_grads(params, steps=2)
    run(FusedAdam(params, lr=1e-3), params, grads)
    run(torch.optim.AdamW(shadow, lr=1e-3, weight_decay=0.0), shadow, grads)
    assert_close(params, shadow, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [
        dict(momentum=0.0),
        dict(momentum=0.9, weight_decay=0.01),
        dict(momentum=0.9, dampening=0.3),
        dict(momentum=0.9, nesterov=True, weight_decay=0.02),
    ],
)
def test_fused_sgd_matches_torch(impl: str, dtype: torch.dtype, config: dict[str, Any]) -> None:
    params = make_params(dtype)
    shadow = fp32_shadow(params)
    grads = make_grads(params)
    run(FusedSGD(params, lr=0.05, implementation=impl, **config), params, grads)  # type: ignore[arg-type]
    reference = torch.optim.SGD(shadow, lr=0.05, foreach=False, **config)
    run(reference, shadow, [[g.float() for g in gs] for gs in grads], round_to(shadow, dtype))
    assert_close(params, shadow, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_adagrad_matches_torch(impl: str, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    shadow = fp32_shadow(params)
    grads = make_grads(params)
    run(FusedAdagrad(params, lr=0.05, weight_decay=0.01, implementation=impl), params, grads)  # type: ignore[arg-type]
    reference = torch.optim.Adagrad(shadow, lr=0.05, weight_decay=0.01, eps=1e-10, foreach=False)
    run(reference, shadow, [[g.float() for g in gs] for gs in grads], round_to(shadow, dtype))
    assert_close(params, shadow, dtype)


# ---------------------------------------------------------------- against plain formulas (fp32)


def adam_formula(p: Tensor, grads: list[Tensor], lr: float, wd: float, eps: float) -> Tensor:
    """AdamW without bias correction, written out."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - lr * (m / (v.sqrt() + eps) + wd * p)
    return p


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_adam_without_bias_correction(impl: str) -> None:
    params = make_params(torch.float32)
    expected = [
        adam_formula(p.detach(), [gs[i] for gs in make_grads(params)], 1e-2, 0.1, 1e-8) for i, p in enumerate(params)
    ]
    run(
        FusedAdam(params, lr=1e-2, weight_decay=0.1, bias_correction=False, implementation=impl),
        params,
        make_grads(params),
    )  # type: ignore[arg-type]
    assert_close(params, expected, torch.float32)


def sgd_wd_after_formula(p: Tensor, grads: list[Tensor], lr: float, mom: float, wd: float) -> Tensor:
    buf = None
    for g in grads:
        buf = g.clone() if buf is None else mom * buf + g
        p = p - lr * (buf + wd * p)
    return p


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_sgd_weight_decay_after_momentum(impl: str, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    grads = make_grads(params)
    expected = [
        sgd_wd_after_formula(p.detach().float(), [gs[i].float() for gs in grads], 0.05, 0.9, 0.1)
        for i, p in enumerate(params)
    ]
    run(
        FusedSGD(params, lr=0.05, momentum=0.9, weight_decay=0.1, wd_after_momentum=True, implementation=impl),
        params,
        grads,
    )  # type: ignore[arg-type]
    assert_close(params, expected, dtype if dtype == torch.float32 else torch.bfloat16)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_adagrad_decoupled_weight_decay(impl: str) -> None:
    params = make_params(torch.float32)
    grads = make_grads(params)
    expected = []
    for i, p in enumerate(params):
        p, h = p.detach(), torch.zeros_like(p)
        for gs in grads:
            h = h + gs[i] * gs[i]
            p = p - 0.05 * (gs[i] / (h.sqrt() + 1e-10) + 0.1 * p)
        expected.append(p)
    run(
        FusedAdagrad(params, lr=0.05, weight_decay=0.1, adagrad_w_mode=True, implementation=impl),
        params,
        grads,
    )  # type: ignore[arg-type]
    assert_close(params, expected, torch.float32)


def lamb_formula(
    params: list[Tensor],
    grads: list[list[Tensor]],
    *,
    lr: float,
    wd: float,
    max_norm: float,
    nvlamb: bool,
    adam_w: bool,
) -> list[Tensor]:
    """LAMB (You et al. 2019) as Apex's kernel describes it: clip by global norm, Adam step, trust ratio."""
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, start=1):
        norm = torch.cat([g.flatten() for g in gs]).norm()
        clip = norm / max_norm if norm > max_norm else 1.0
        for i, g in enumerate(gs):
            g = g / clip
            if not adam_w:
                g = g + wd * ps[i]
            ms[i] = 0.9 * ms[i] + 0.1 * g
            vs[i] = 0.999 * vs[i] + 0.001 * g * g
            update = (ms[i] / (1 - 0.9**t)) / ((vs[i] / (1 - 0.999**t)).sqrt() + 1e-6)
            if adam_w:
                update = update + wd * ps[i]
            ratio = lr
            if (nvlamb or wd != 0) and ps[i].norm() > 0 and update.norm() > 0:
                ratio = lr * float(ps[i].norm() / update.norm())
            ps[i] = ps[i] - ratio * update
    return ps


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "config",
    [
        dict(wd=0.01, max_norm=1.0, nvlamb=False, adam_w=True),
        dict(wd=0.0, max_norm=1.0, nvlamb=False, adam_w=True),
        dict(wd=0.0, max_norm=100.0, nvlamb=True, adam_w=True),
        dict(wd=0.05, max_norm=1.0, nvlamb=False, adam_w=False),
    ],
)
def test_fused_lamb_matches_formula(impl: str, config: dict[str, Any]) -> None:
    params = make_params(torch.float32)
    grads = make_grads(params)
    expected = lamb_formula(params, grads, lr=1e-2, **config)
    ours = FusedLAMB(
        params,
        lr=1e-2,
        weight_decay=config["wd"],
        max_grad_norm=config["max_norm"],
        use_nvlamb=config["nvlamb"],
        adam_w_mode=config["adam_w"],
        implementation=impl,  # type: ignore[arg-type]
    )
    run(ours, params, grads)
    assert_close(params, expected, torch.float32)


def test_fused_lamb_clips_over_all_groups() -> None:
    a, b = make_params(torch.float32, sizes=(5,)), make_params(torch.float32, sizes=(6,), seed=3)
    grads = [[ga, gb] for (ga,), (gb,) in zip(make_grads(a), make_grads(b, seed=4))]
    expected = lamb_formula(a + b, grads, lr=1e-2, wd=0.01, max_norm=1.0, nvlamb=False, adam_w=True)
    run(FusedLAMB([{"params": a}, {"params": b}], lr=1e-2), a + b, grads)
    assert_close(a + b, expected, torch.float32)


def novograd_formula(
    params: list[Tensor],
    grads: list[list[Tensor]],
    *,
    lr: float,
    wd: float,
    norm_type: int,
    mode: int,
    init_zero: bool,
) -> list[Tensor]:
    """NovoGrad (Ginsburg et al. 2019) as Apex's kernel describes it, with a per-layer norm moment."""
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    norms: list[float | None] = [0.0 if init_zero else None for _ in ps]
    b1, b2 = 0.9, 0.999
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            n = float(g.norm()) if norm_type == 2 else (float(g.abs().max()) if g.numel() else 0.0)
            old = norms[i]
            if old is None:
                norms[i] = n
            elif norm_type == 2:
                norms[i] = math.sqrt(b2 * old * old + (1 - b2) * n * n)
            else:
                norms[i] = b2 * old + (1 - b2) * n
            denom = norms[i] / math.sqrt(1 - b2**t) + 1e-8  # type: ignore[operator]
            if mode == 0:
                ms[i] = b1 * ms[i] + (1 - b1) * (g / denom + wd * ps[i])
                ps[i] = ps[i] - lr * ms[i] / (1 - b1**t)
            else:
                ms[i] = b1 * ms[i] + (1 - b1) * g
                ps[i] = ps[i] - lr * (ms[i] / (1 - b1**t) / denom + wd * ps[i])
    return ps


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "config",
    [
        dict(wd=0.0, norm_type=2, mode=1, init_zero=False),
        dict(wd=0.01, norm_type=2, mode=0, init_zero=False),
        dict(wd=0.01, norm_type=0, mode=1, init_zero=True),
    ],
)
def test_fused_novograd_matches_formula(impl: str, config: dict[str, Any]) -> None:
    params = make_params(torch.float32)
    grads = make_grads(params)
    expected = novograd_formula(params, grads, lr=1e-2, **config)
    ours = FusedNovoGrad(
        params,
        lr=1e-2,
        weight_decay=config["wd"],
        norm_type=config["norm_type"],
        reg_inside_moment=config["mode"] == 0,
        init_zero=config["init_zero"],
        implementation=impl,  # type: ignore[arg-type]
    )
    run(ours, params, grads)
    assert_close(params, expected, torch.float32)
    assert len(ours.param_groups[0]["exp_avg_sq"]) == 2


# ---------------------------------------------------------------- implementations against each other

FACTORIES: dict[str, Callable[[list[Tensor], str], torch.optim.Optimizer]] = {
    "adam": lambda ps, impl: FusedAdam(ps, lr=1e-2, weight_decay=0.01, implementation=impl),  # type: ignore[arg-type]
    "adam_l2": lambda ps, impl: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False, implementation=impl),  # type: ignore[arg-type]
    "sgd": lambda ps, impl: FusedSGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, implementation=impl),  # type: ignore[arg-type]
    "sgd_damp": lambda ps, impl: FusedSGD(ps, lr=0.05, momentum=0.9, dampening=0.5, implementation=impl),  # type: ignore[arg-type]
    "sgd_wd_after": lambda ps, impl: FusedSGD(
        ps,
        lr=0.05,
        momentum=0.9,
        weight_decay=0.01,
        wd_after_momentum=True,
        implementation=impl,  # type: ignore[arg-type]
    ),
    "adagrad": lambda ps, impl: FusedAdagrad(ps, lr=0.05, implementation=impl),  # type: ignore[arg-type]
    "adagrad_w": lambda ps, impl: FusedAdagrad(ps, lr=0.05, weight_decay=0.1, adagrad_w_mode=True, implementation=impl),  # type: ignore[arg-type]
    "lamb": lambda ps, impl: FusedLAMB(ps, lr=1e-2, implementation=impl),  # type: ignore[arg-type]
    "novograd": lambda ps, impl: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01, implementation=impl),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_multi_tensor_matches_single_tensor(name: str, dtype: torch.dtype) -> None:
    fast, slow = make_params(dtype), make_params(dtype)
    grads = make_grads(fast)
    run(FACTORIES[name](fast, "multi_tensor"), fast, grads)
    run(FACTORIES[name](slow, "single_tensor"), slow, grads)
    assert_close(fast, slow, dtype)


# ---------------------------------------------------------------- AMP-scaling protocol


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_found_inf_skips_step_bitwise(name: str, impl: str) -> None:
    params = make_params(torch.float16)
    optimizer = FACTORIES[name](params, impl)
    run(optimizer, params, make_grads(params, steps=2))
    before_params = [p.detach().clone() for p in params]
    before_state = [t.clone() for t in state_tensors(optimizer)]
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    optimizer.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    optimizer.grad_scale = torch.tensor(1024.0)  # type: ignore[attr-defined]
    optimizer.step()
    assert_bitwise([p.detach() for p in params], before_params)
    assert_bitwise(state_tensors(optimizer), before_state)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_found_inf_summed_over_devices_still_skips(name: str) -> None:
    params = make_params(torch.float32)
    optimizer = FACTORIES[name](params, "multi_tensor")
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.found_inf = torch.tensor(2.0)  # type: ignore[attr-defined]
    optimizer.step()
    assert_bitwise([p.detach() for p in params], before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_grad_scale_divides_gradients(name: str, impl: str) -> None:
    scaled, plain = make_params(torch.float32), make_params(torch.float32)
    grads = make_grads(scaled)
    optimizer = FACTORIES[name](scaled, impl)
    optimizer.grad_scale = torch.tensor(512.0)  # type: ignore[attr-defined]
    optimizer.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
    run(optimizer, scaled, [[g * 512 for g in gs] for gs in grads])
    run(FACTORIES[name](plain, impl), plain, grads)
    assert_close(scaled, plain, torch.float32)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, poison: set[int], scaler: Any) -> None:
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=gen)
        if step in poison:
            x[0, 0] = float("inf")
        loss = model(x).square().mean()
        optimizer.zero_grad()
        if scaler is None:
            if step not in poison:
                loss.backward()
                optimizer.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("poison", [{0}, {3}, {6}])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_grad_scaler_drives_optimizers(name: str, poison: set[int]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = FACTORIES[name](list(model.parameters()), "multi_tensor")
    train(model, optimizer, poison, scaler)
    train(reference, FACTORIES[name](list(reference.parameters()), "multi_tensor"), poison, None)
    assert scaler.get_scale() == 2.0**9
    assert_close(list(model.parameters()), list(reference.parameters()), torch.float32)


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_sgd_skipped_first_step_has_no_uninitialised_momentum(dampening: float) -> None:
    """torch's fused SGD creates momentum buffers with empty_like on the first step; if that step is skipped
    they stay uninitialised and the next step treats them as real momentum."""
    params = make_params(torch.float32, sizes=(64,))
    (grad,) = make_grads(params, steps=1)[0]

    def skipped_then_normal(optimizer: torch.optim.Optimizer, p: Tensor) -> Tensor:
        p.grad = torch.full_like(p, float("nan"))
        optimizer.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
        optimizer.step()
        del optimizer.found_inf  # type: ignore[attr-defined]
        p.grad = grad.clone()
        optimizer.step()
        return p.detach()

    reference_param = params[0].detach().clone().requires_grad_()
    reference_param.grad = grad.clone()
    torch.optim.SGD([reference_param], lr=0.1, momentum=0.9, dampening=dampening).step()

    ours_param = params[0].detach().clone().requires_grad_()
    ours = skipped_then_normal(FusedSGD([ours_param], lr=0.1, momentum=0.9, dampening=dampening), ours_param)
    assert torch.equal(ours, reference_param.detach())

    if dampening != 0:
        # The torch bug, deterministic with dampening: the garbage buffer is taken as existing momentum.
        torch_param = params[0].detach().clone().requires_grad_()
        buggy = skipped_then_normal(
            torch.optim.SGD([torch_param], lr=0.1, momentum=0.9, dampening=dampening, fused=True), torch_param
        )
        assert not torch.allclose(buggy, reference_param.detach())


# ---------------------------------------------------------------- state_dict


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_round_trip(name: str, dtype: torch.dtype) -> None:
    grads = make_grads(make_params(dtype))
    straight = make_params(dtype)
    run(FACTORIES[name](straight, "multi_tensor"), straight, grads)

    resumed = make_params(dtype)
    first = FACTORIES[name](resumed, "multi_tensor")
    run(first, resumed, grads[:3])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    fresh = FACTORIES[name](resumed, "multi_tensor")
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert all(t.dtype == torch.float32 for s in fresh.state.values() for k, t in s.items() if k != "step")
    run(fresh, resumed, grads[3:])
    assert_bitwise([p.detach() for p in resumed], [p.detach() for p in straight])


def test_loaded_state_is_not_shared_with_the_source() -> None:
    params = make_params(torch.float32)
    source = FusedAdam(params)
    run(source, params, make_grads(params, steps=1))
    target = FusedAdam(make_params(torch.float32))
    target.load_state_dict(source.state_dict())
    run(target, target.param_groups[0]["params"], make_grads(params, steps=1))
    assert int(source.param_groups[0]["step"]) == 1 and int(target.param_groups[0]["step"]) == 2


def test_apex_checkpoint_with_int_step_loads() -> None:
    params = make_params(torch.float32)
    optimizer = FusedAdam(params)
    state = optimizer.state_dict()
    state["param_groups"][0]["step"] = 4
    optimizer.load_state_dict(state)
    run(optimizer, params, make_grads(params, steps=1))
    assert float(optimizer.param_groups[0]["step"]) == 5.0


# ---------------------------------------------------------------- FusedAdam master weights, zero_grad


def test_fused_adam_master_weights_track_fp32_training() -> None:
    half = make_params(torch.float16)
    shadow = fp32_shadow(half)
    grads = make_grads(half)
    optimizer = FusedAdam(half, lr=1e-3, capturable=True, master_weights=True)
    run(optimizer, half, grads)
    run(
        torch.optim.AdamW(shadow, lr=1e-3, weight_decay=0.0),
        shadow,
        [[g.float() for g in gs] for gs in grads],
    )
    masters = [optimizer.state[p]["master_param"] for p in half if p.numel()]
    assert_close(masters, [s for s in shadow if s.numel()], torch.float32)
    assert_bitwise([p.detach() for p in half if p.numel()], [m.half() for m in masters])


@pytest.mark.parametrize(
    ("factory", "expect_none"),
    [
        (lambda ps: FusedAdam(ps), True),
        (lambda ps: FusedSGD(ps, lr=0.1), False),
        (lambda ps: FusedLAMB(ps), True),
    ],
)
def test_zero_grad_follows_set_grad_none(factory: Any, expect_none: bool) -> None:
    params = make_params(torch.float32, sizes=(3,))
    params[0].grad = torch.ones_like(params[0])
    factory(params).zero_grad()
    assert (params[0].grad is None) == expect_none
    if not expect_none:
        assert torch.equal(params[0].grad, torch.zeros_like(params[0]))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda ps: FusedAdam(ps, amsgrad=True),
            RuntimeError,
            "FusedAdam does not support the AMSGrad variant.",
        ),
        (
            lambda ps: FusedLAMB(ps, amsgrad=True),
            RuntimeError,
            "FusedLAMB does not support the AMSGrad variant.",
        ),
        (
            lambda ps: FusedNovoGrad(ps, amsgrad=True),
            RuntimeError,
            "FusedNovoGrad does not support the AMSGrad variant.",
        ),
        (
            lambda ps: FusedAdam(ps, master_weights=True),
            RuntimeError,
            "Master weights is currently only supported with the capturable version.",
        ),
        (lambda ps: FusedSGD(ps, lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
        (lambda ps: FusedSGD(ps, lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
        (lambda ps: FusedSGD(ps, lr=0.1, weight_decay=-2.0), ValueError, "Invalid weight_decay value: -2.0"),
        (
            lambda ps: FusedSGD(ps, lr=0.1, nesterov=True),
            ValueError,
            "Nesterov momentum requires a momentum and zero dampening",
        ),
        (
            lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            "Nesterov momentum requires a momentum and zero dampening",
        ),
        (lambda ps: FusedAdam(ps, betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0: 1.0"),
        (lambda ps: FusedAdam(ps, eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
        (lambda ps: FusedAdagrad(ps, lr=-0.5), ValueError, "Invalid learning rate: -0.5"),
        (lambda ps: FusedLAMB(ps, max_grad_norm=-1.0), ValueError, "Invalid max_grad_norm value: -1.0"),
        (
            lambda ps: FusedNovoGrad(ps, norm_type=1),
            ValueError,
            "Invalid norm_type: 1. FusedNovoGrad supports 2 (L2) and 0 (infinity)",
        ),
        (
            lambda ps: FusedAdam(ps, implementation="foreach"),
            ValueError,
            "Invalid implementation: 'foreach'. Allowed values: ('multi_tensor', 'single_tensor')",
        ),
    ],
)
def test_constructor_errors(build: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        build(make_params(torch.float32, sizes=(2,)))


def test_fused_adam_rejects_deprecated_step_arguments() -> None:
    optimizer = FusedAdam(make_params(torch.float32, sizes=(2,)))
    with pytest.raises(RuntimeError, match=re.escape("FusedAdam has been updated.  Simply initialize it")):
        optimizer.step(scale=128.0)


def test_sparse_gradients_and_bad_dtypes_are_refused() -> None:
    sparse = torch.zeros(4, requires_grad=True)
    sparse.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match=re.escape("FusedSGD does not support sparse gradients")):
        FusedSGD([sparse], lr=0.1).step()
    double = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    double.grad = torch.zeros_like(double)
    message = "FusedLAMB supports float32, float16 and bfloat16 parameters, got one of torch.float64"
    with pytest.raises(TypeError, match=re.escape(message)):
        FusedLAMB([double]).step()


def test_novograd_refuses_a_changed_parameter_set() -> None:
    params = make_params(torch.float32, sizes=(3, 4))
    optimizer = FusedNovoGrad(params)
    run(optimizer, params, make_grads(params, steps=1))
    params[1].grad = None
    with pytest.raises(RuntimeError, match=re.escape("had 2 torch.float32 such parameters and now has 1")):
        optimizer.step()


def test_grad_scaler_sees_amp_support_flag() -> None:
    for cls in (FusedAdam, FusedSGD, FusedLAMB, FusedAdagrad, FusedNovoGrad):
        assert cls._step_supports_amp_scaling is True


# ---------------------------------------------------------------- empty and frozen param groups
# Apex and torch.optim skip them. Each fused optimizer in the configurations whose steps take different paths.
OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (FusedAdam, {"weight_decay": 0.01}),
    (FusedAdam, {"bias_correction": False}),
    (FusedAdam, {"capturable": True, "master_weights": True}),
    (FusedLAMB, {}),
    (FusedNovoGrad, {}),
    (FusedSGD, {"lr": 0.1, "momentum": 0.9}),
    (FusedAdagrad, {"weight_decay": 0.01}),
]
IDS = ["adam", "adam-no-bias-correction", "adam-capturable-master", "lamb", "novograd", "sgd", "adagrad"]


def small_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train_steps(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(6, 4, generator=gen)).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_empty_and_frozen_groups_change_nothing_and_do_not_disturb_live_ones(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    frozen, live, reference = small_net(0), small_net(1), small_net(1)
    for p in frozen.parameters():
        p.requires_grad_(False)
    before = [p.clone() for p in frozen.parameters()]
    groups: list[dict[str, Any]] = [
        {"params": []},
        {"params": list(frozen.parameters())},
        {"params": list(live.parameters())},
    ]
    train_steps(live, cls(groups, **kwargs))
    train_steps(reference, cls(reference.parameters(), **kwargs))
    for p, b in zip(frozen.parameters(), before):
        assert torch.equal(p, b)
    for p, q in zip(live.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_all_frozen_or_empty_optimizer_steps_like_torch_optim(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    net = small_net(0)
    for p in net.parameters():
        p.requires_grad_(False)
    before = [p.clone() for p in net.parameters()]
    groups: list[dict[str, Any]] = [{"params": []}, {"params": list(net.parameters())}]
    fused = cls(groups, **kwargs)
    plain = torch.optim.SGD([dict(g) for g in groups], lr=0.1)
    for optimizer in (fused, plain):
        optimizer.zero_grad()
        optimizer.step()
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert not any(fused.state[p] for p in net.parameters())


# ---------------------------------------------------------------- FusedAdagrad without a fused kernel
# (CUDA before torch 2.9)
@pytest.mark.parametrize(
    ("device", "version", "expected"),
    [("cuda", "2.8.1+cu128", False), ("cuda", "2.9.0", True), ("cuda", "2.10.0a0+git", True), ("cpu", "2.5.0", True)],
)
def test_fused_adagrad_kernel_availability(device: str, version: str, expected: bool) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    assert _torch_kernels.has_fused_adagrad(torch.device(device), version) is expected
    assert _torch_kernels.has_fused_adagrad(torch.device("mps"), version) is False


def test_fused_adagrad_unknown_version_is_a_clear_error() -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    with pytest.raises(ValueError, match="'nightly'"):
        _torch_kernels.has_fused_adagrad(torch.device("cuda"), "nightly")


@pytest.mark.parametrize("adagrad_w_mode", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adagrad_falls_back_to_foreach_without_a_kernel(
    monkeypatch: pytest.MonkeyPatch, adagrad_w_mode: bool, dtype: torch.dtype
) -> None:
    """With the version check answering 'no kernel' (as on CUDA before 2.9), the step must not call
    torch._fused_adagrad_ and must match the plain per-tensor reference, including a skipped step.

    Found by: the sweep of edge cases of the fused optimizers and amp_C ops.
    """
    reference, fallback = small_net(0).to(dtype), small_net(0).to(dtype)
    ref_opt = FusedAdagrad(
        reference.parameters(), weight_decay=0.1, adagrad_w_mode=adagrad_w_mode, implementation="single_tensor"
    )
    new_opt = FusedAdagrad(fallback.parameters(), weight_decay=0.1, adagrad_w_mode=adagrad_w_mode)

    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch._fused_adagrad_ called although the version check said it has no kernel")

    monkeypatch.setattr(_torch_kernels, "has_fused_adagrad", lambda device, version=None: False)
    monkeypatch.setattr(torch, "_fused_adagrad_", no_kernel)
    for found in (0.0, 1.0, 0.0):
        for opt in (ref_opt, new_opt):
            opt.grad_scale = torch.full((), 8.0)  # type: ignore[attr-defined]
            opt.found_inf = torch.full((), found)  # type: ignore[attr-defined]
        for net in (reference, fallback):
            torch.manual_seed(3)
            net.zero_grad()
            (net(torch.randn(6, 4, dtype=dtype)).float().square().mean() * 8).backward()
        ref_opt.step()
        new_opt.step()
        rtol, atol = (2e-6, 1e-7) if dtype == torch.float32 else (1e-2, 1e-2)
        for p, q in zip(fallback.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
            # Like torch's fused kernels, the fallback leaves the gradients unscaled unless the step is skipped.
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad if found else q.grad / 8, rtol=rtol, atol=atol)
            torch.testing.assert_close(new_opt.state[p]["sum"], ref_opt.state[q]["sum"], rtol=rtol, atol=atol)


# ---------------------------------------------------------------- FusedAdam(capturable=True)
def test_capturable_fused_adam_keeps_lr_on_the_device_and_follows_a_scheduler() -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    plain_net, graph_net = small_net(0), small_net(0)
    plain = FusedAdam(plain_net.parameters(), lr=0.01)
    capturable = FusedAdam(graph_net.parameters(), lr=0.01, capturable=True)
    assert isinstance(capturable.param_groups[0]["lr"], Tensor)
    lr_tensor = capturable.param_groups[0]["lr"]
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, capturable)]
    for optimizer, net in ((plain, plain_net), (capturable, graph_net)):
        train_steps(net, optimizer, steps=1)
    for _ in range(2):
        for schedule in schedules:
            schedule.step()
        for optimizer, net in ((plain, plain_net), (capturable, graph_net)):
            train_steps(net, optimizer, steps=1)
    # The scheduler filled the same tensor (what a replayed graph reads) rather than replacing it.
    assert capturable.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.0025)
    for p, q in zip(graph_net.parameters(), plain_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_capturable_fused_adam_replays_in_a_cuda_graph() -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    torch.manual_seed(0)
    eager_net = nn.Linear(16, 16).cuda().half()
    graph_net = copy.deepcopy(eager_net)
    eager = FusedAdam(eager_net.parameters(), capturable=True, master_weights=True, weight_decay=0.01)
    graphed = FusedAdam(graph_net.parameters(), capturable=True, master_weights=True, weight_decay=0.01)
    grads = [[torch.randn_like(p) for p in eager_net.parameters()] for _ in range(6)]
    static = [torch.zeros_like(p) for p in graph_net.parameters()]
    for p, g in zip(graph_net.parameters(), static):
        p.grad = g
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up creates the state outside the graph
        for g, new in zip(static, grads[0]):
            g.copy_(new)
        graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for p, g in zip(eager_net.parameters(), grads[0]):
        p.grad = g.clone()
    eager.step()
    for step_grads in grads[1:]:
        for g, new in zip(static, step_grads):
            g.copy_(new)
        graph.replay()
        for p, g in zip(eager_net.parameters(), step_grads):
            p.grad = g.clone()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(graph_net.parameters(), eager_net.parameters()):
        assert torch.equal(p, q)
