"""The amp_C ops that Megatron, NeMo and Apex's capturable/mixed-precision optimizers call, against plain
re-implementations of Apex's kernels (csrc/update_scale_hysteresis.cu, multi_tensor_adam.cu,
multi_tensor_lamb_mp.cu) written element by element in float32."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from torch import Tensor

import ampinit.multi_tensor as mt

# ---- update_scale_hysteresis -----------------------------------------------------------------------


def f32(x: float) -> float:
    """Round a Python float to float32, as the kernel's float stores do."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return value


def hysteresis_reference(
    scale: float, growth: int, hyst: int, found: float, gf: float, bf: float, interval: int, hysteresis: int
) -> tuple[float, int, int]:
    """Apex's kernel, line by line."""
    if found > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if found:
        scale, growth = f32(scale * bf), 0
    else:
        successful = growth + 1
        if successful == interval:
            grown = f32(scale * gf)
            if grown != float("inf"):
                scale = grown
            growth = 0
        else:
            growth = successful
    if found <= 0:
        hyst = hysteresis
    return scale, growth, hyst


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_update_scale_hysteresis_matches_apex_kernel(hysteresis: int) -> None:
    founds = [0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    scale = torch.full((1,), 2.0**16)
    growth = torch.zeros(1, dtype=torch.int32)
    hyst = torch.full((1,), hysteresis, dtype=torch.int32)
    expected = (2.0**16, 0, hysteresis)
    for found in founds:
        out = mt.update_scale_hysteresis(scale, growth, hyst, torch.full((1,), float(found)), 2.0, 0.5, 3, hysteresis)
        expected = hysteresis_reference(*expected, float(found), 2.0, 0.5, 3, hysteresis)
        assert out is scale
        assert (scale.item(), growth.item(), hyst.item()) == expected
    assert growth.dtype == hyst.dtype == torch.int32 and scale.dtype == torch.float32


def test_update_scale_hysteresis_never_grows_to_inf() -> None:
    scale = torch.full((1,), 3e38)
    growth, hyst = torch.full((1,), 0, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
    mt.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1), 2.0, 0.5, 1, 2)
    assert scale.item() == f32(3e38) and growth.item() == 0


# ---- adam capturable ---------------------------------------------------------------------------------


def tensors(dtype: torch.dtype, seed: int, positive: bool = False) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=gen) for n in (0, 3, 1000)]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def adam_reference(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, lr: float, step: int, mode: int, bias: int, wd: float, inv: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b1, b2, eps = 0.9, 0.999, 1e-8
    gs = g.float() * inv
    pf = p.float()
    if mode == 0:
        gs = gs + wd * pf
    m2 = b1 * m + (1 - b1) * gs
    v2 = b2 * v + (1 - b2) * gs * gs
    c1 = 1 - b1**step if bias else 1.0
    c2 = 1 - b2**step if bias else 1.0
    update = (m2 / c1) / ((v2 / c2).sqrt() + eps)
    if mode == 1:
        update = update + wd * pf
    return (g.float() * inv).to(g.dtype), pf - lr * update, m2, v2


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize(("mode", "bias"), [(0, 1), (1, 1), (1, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adam_capturable_matches_apex_kernel(master: bool, mode: int, bias: int, dtype: torch.dtype) -> None:
    g, p = tensors(dtype, 1), tensors(dtype, 2)
    m, v = tensors(torch.float32, 3), tensors(torch.float32, 4, positive=True)
    masters = [t.float() + 1e-3 for t in p]  # deliberately not equal to p: the update must start from it
    lists = [[t.clone() for t in ts] for ts in (g, p, m, v)] + ([[t.clone() for t in masters]] if master else [])
    lr, step, inv = torch.full((1,), 0.01), torch.full((1,), 5, dtype=torch.int32), torch.full((1,), 0.25)
    op = mt.multi_tensor_adam_capturable_master if master else mt.multi_tensor_adam_capturable
    flag = torch.zeros(1, dtype=torch.int32)
    op(2048, flag, lists, lr, 0.9, 0.999, 1e-8, step, mode, bias, 0.1, inv)
    for i in range(len(g)):
        start = masters[i] if master else p[i]
        eg, ep, em, ev = adam_reference(g[i], start, m[i], v[i], 0.01, 5, mode, bias, 0.1, 0.25)
        assert torch.equal(lists[0][i], eg)
        torch.testing.assert_close(lists[1][i], ep.to(dtype), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lists[2][i], em, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lists[3][i], ev, rtol=1e-6, atol=1e-7)
        if master:
            torch.testing.assert_close(lists[4][i], ep, rtol=1e-6, atol=1e-7)
            assert torch.equal(lists[1][i], lists[4][i].to(dtype))
    assert flag.item() == 0


@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable_does_nothing_when_flagged(master: bool) -> None:
    lists = [tensors(torch.float16, s) for s in range(4)] + ([tensors(torch.float32, 9)] if master else [])
    lists[2] = [t.float() for t in lists[2]]
    lists[3] = [t.float().abs() for t in lists[3]]
    before = [[t.clone() for t in ts] for ts in lists]
    op = mt.multi_tensor_adam_capturable_master if master else mt.multi_tensor_adam_capturable
    flag = torch.ones(1, dtype=torch.int32)
    one = torch.ones(1)
    op(2048, flag, lists, one, 0.9, 0.999, 1e-8, torch.ones(1, dtype=torch.int32), 1, 1, 0.1, one * 0.5)
    assert all(torch.equal(a, b) for ts, bs in zip(lists, before) for a, b in zip(ts, bs))


# ---- lamb mp ------------------------------------------------------------------------------------------


def lamb_reference(
    g: list[Tensor],
    p: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    *,
    lr: float,
    step: int,
    wd: float,
    mode: int,
    gnorm: float,
    max_norm: float,
    nvlamb: bool,
    inv: float,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    b1, b2, eps = 0.9, 0.999, 1e-6
    b3 = 1 - b1
    clip = gnorm / max_norm if gnorm > max_norm else 1.0
    updates, params, ms, vs = [], [], [], []
    for gi, pi, mi, vi in zip(g, p, m, v):
        pf = pi.double()
        sg = gi.double() * inv / clip
        if mode == 0:
            sg = sg + wd * pf
        m2 = mi.double() * b1 + b3 * sg
        v2 = vi.double() * b2 + (1 - b2) * sg * sg
        upd = (m2 / (1 - b1**step)) / ((v2 / (1 - b2**step)).sqrt() + eps)
        if mode == 1:
            upd = upd + wd * pf
        upd = upd.to(gi.dtype).double()  # the update is stored in the gradient's dtype, then read back
        pn, un = pf.norm(), upd.norm()
        ratio = lr * pn / un if (nvlamb or wd != 0) and pn != 0 and un != 0 else lr
        updates.append(upd)
        params.append(pf - ratio * upd)
        ms.append(m2)
        vs.append(v2)
    return updates, params, ms, vs


@pytest.mark.parametrize("reduced", [None, torch.bfloat16])
@pytest.mark.parametrize(
    ("mode", "wd", "nvlamb"), [(1, 0.01, False), (0, 0.01, False), (1, 0.0, True), (1, 0.0, False)]
)
@pytest.mark.parametrize("gnorm", [0.5, 40.0])
def test_lamb_mp_matches_apex_kernel(
    reduced: torch.dtype | None, mode: int, wd: float, nvlamb: bool, gnorm: float
) -> None:
    gdtype = reduced or torch.float32
    g, p = tensors(gdtype, 1), tensors(torch.float32, 2)
    m, v = tensors(torch.float32, 3), tensors(torch.float32, 4, positive=True)
    lists = [[t.clone() for t in ts] for ts in (g, p, m, v)]
    if reduced is not None:
        lists.append([t.to(reduced) for t in p])
    flag = torch.zeros(1, dtype=torch.int32)
    f = torch.full
    mt.multi_tensor_lamb_mp(
        2048, flag, lists, f((1,), 0.01), 0.9, 0.999, 1e-6, f((1,), 3, dtype=torch.int32), 1, wd, 1, mode,
        f((1,), gnorm), f((1,), 4.0), nvlamb, torch.zeros(1), f((1,), 0.5),
    )  # fmt: skip
    eu, ep, em, ev = lamb_reference(
        g, p, m, v, lr=0.01, step=3, wd=wd, mode=mode, gnorm=gnorm, max_norm=4.0, nvlamb=nvlamb, inv=0.5
    )
    for i in range(len(g)):
        torch.testing.assert_close(lists[0][i].double(), eu[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lists[1][i].double(), ep[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lists[2][i].double(), em[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lists[3][i].double(), ev[i], rtol=1e-5, atol=1e-6)
        if reduced is not None:
            assert torch.equal(lists[4][i], lists[1][i].to(reduced))
    assert flag.item() == 0


def test_lamb_mp_non_finite_parameter_norm_flags_and_skips() -> None:
    g, p = tensors(torch.float32, 1), tensors(torch.float32, 2)
    p[2][7] = float("inf")
    m, v = tensors(torch.float32, 3), tensors(torch.float32, 4, positive=True)
    lists = [g, p, m, v]
    before = [[t.clone() for t in ts] for ts in lists]
    flag = torch.zeros(1, dtype=torch.int32)
    one = torch.ones(1)
    mt.multi_tensor_lamb_mp(
        2048, flag, lists, one, 0.9, 0.999, 1e-6, one.int(), 1, 0.01, 1, 1, one, one, False, one * 0, one
    )
    assert flag.item() == 1
    assert all(torch.equal(a, b) for ts, bs in zip(lists, before) for a, b in zip(ts, bs))


def test_l2norm_mp_is_l2norm() -> None:
    ts = tensors(torch.float16, 5)
    expected = mt.multi_tensor_l2norm(2048, torch.zeros(1, dtype=torch.int32), [ts], True)
    actual = mt.multi_tensor_l2norm_mp(2048, torch.zeros(1, dtype=torch.int32), [ts], True)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))


# ---- FusedMixedPrecisionLamb -------------------------------------------------------------------------


def _grads(shapes: list[torch.Size], steps: int) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _lamb_trajectory(params: list[Tensor], grads: list[list[Tensor]], wd: float, max_norm: float) -> list[Tensor]:
    """Apex's LAMB (global clipping, trust ratio, AdamW decay) in float64, one tensor at a time; the update
    is rounded to the gradient's dtype, where Apex's kernel stores it."""
    p = [t.double() for t in params]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step, step_grads in enumerate(grads, start=1):
        gnorm = torch.cat([g.double().flatten() for g in step_grads]).norm().item()
        _, p, m, v = lamb_reference(
            list(step_grads), p, m, v,
            lr=0.01, step=step, wd=wd, mode=1, gnorm=gnorm, max_norm=max_norm, nvlamb=False, inv=1.0,
        )  # fmt: skip
    return p


@pytest.mark.parametrize("reduced", [None, torch.bfloat16])
def test_fused_mixed_precision_lamb_follows_apex_lamb(reduced: torch.dtype | None) -> None:
    from ampinit.optimizers import FusedMixedPrecisionLamb

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)]
    dtype = reduced or torch.float32
    params = [t.to(dtype, copy=True).requires_grad_() for t in start]
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [], "lr": 0.02}]
    opt = FusedMixedPrecisionLamb(
        groups, lr=0.01, weight_decay=0.01, max_grad_norm=2.0,
        reduced_precision_dtype=reduced,
    )  # fmt: skip
    grads = _grads([p.shape for p in params], 4)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype, copy=True)  # the optimizer overwrites the gradient, as Apex does
        opt.step()
    # The masters (bf16 case) or the fp32 parameters follow the float64 trajectory from the rounded start.
    expected = _lamb_trajectory(
        [p.float() for p in (t.to(dtype) for t in start)], [[g.to(dtype) for g in s] for s in grads], 0.01, 2.0
    )
    followed = [m for m in opt.param_groups_full_precision[0]["params"]] if reduced else params
    for f, e in zip(followed, expected):
        assert f is not None
        torch.testing.assert_close(f.double(), e, rtol=1e-5, atol=1e-6)
    if reduced is not None:
        for p, f in zip(params, followed):
            assert f is not None and torch.equal(p, f.to(reduced))
    assert opt.param_groups[0]["step"].tolist() == [4]  # not 8: the empty group has its own counter
    assert opt.param_groups[1]["lr"].item() == pytest.approx(0.02)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32


def test_fused_mixed_precision_lamb_with_grad_scaler_skips_and_unscales() -> None:
    from ampinit.optimizers import FusedMixedPrecisionLamb

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(6, generator=gen).requires_grad_()]
    reference = [params[0].detach().clone().requires_grad_()]
    opt = FusedMixedPrecisionLamb(params, lr=0.01)
    ref_opt = FusedMixedPrecisionLamb(reference, lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as scaling a loss does
    grad = torch.randn(6, generator=gen)
    # An overflowing step first: nothing moves, the step counter stays, the scale backs off.
    params[0].grad = torch.full((6,), float("inf"))
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(opt)
    scaler.update()
    assert opt.param_groups[0]["step"].tolist() == [0] and torch.equal(params[0], reference[0])
    assert scaler.get_scale() == 4.0
    params[0].grad = grad * 4.0
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(opt)
    reference[0].grad = grad.clone()
    ref_opt.step()
    torch.testing.assert_close(params[0], reference[0], rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["step"].tolist() == [1]


def test_fused_mixed_precision_lamb_state_dict_round_trip_keeps_fp32_moments() -> None:
    from ampinit.optimizers import FusedMixedPrecisionLamb

    params = [torch.randn(5).bfloat16().requires_grad_()]
    opt = FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.bfloat16)
    params[0].grad = torch.randn(5).bfloat16()
    opt.step()
    other = FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.bfloat16)
    other.load_state_dict(opt.state_dict())
    assert other.state[params[0]]["exp_avg"].dtype == torch.float32
    assert torch.equal(other.state[params[0]]["exp_avg"], opt.state[params[0]]["exp_avg"])
    assert other.param_groups[0]["step"] is not opt.param_groups[0]["step"]
    assert other.param_groups[0]["step"].tolist() == [1]


def test_lamb_mp_non_finite_update_flags_and_leaves_parameters() -> None:
    """Apex's stage 2 exits when the update norms set the flag: moments and gradients were already written,
    the parameters are not."""
    g, p = tensors(torch.float32, 1), tensors(torch.float32, 2)
    g[1][0] = float("nan")
    m, v = tensors(torch.float32, 3), tensors(torch.float32, 4, positive=True)
    lists = [g, p, m, v]
    p_before, m_before = [t.clone() for t in p], [t.clone() for t in m]
    flag = torch.zeros(1, dtype=torch.int32)
    one = torch.ones(1)
    mt.multi_tensor_lamb_mp(
        2048, flag, lists, one, 0.9, 0.999, 1e-6, one.int(), 1, 0.01, 1, 1, one, one, False, one * 0, one
    )
    assert flag.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(p, p_before))
    assert not torch.equal(m[2], m_before[2])
