"""ampinit.multi_tensor: Apex's amp_C ops checked against plain torch arithmetic."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from ampinit import multi_tensor as mt
from ampinit.multi_tensor import amp_C, multi_tensor_applier
from ampinit.optimizers.fused_lamb import global_grad_norm
from ampinit.optimizers.fused_novograd import layer_norms
from tests._device import device_under_test

SIZES = (0, 1, 17, 2**20 + 3)
POSITIONS = ("first", "middle", "last")


def tensors(dtype: torch.dtype, sizes: tuple[int, ...] = SIZES, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device_under_test(), dtype) for n in sizes]


def fp64_norm(t: Tensor) -> Tensor:
    """The L2 norm computed in float64, rounded to float32 (torch's own fp32 norm loses ~1e-5 at 1M elements)."""
    norm: Tensor = t.double().norm().float()
    return norm


def flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device_under_test())


def poison(ts: list[Tensor], position: str, value: float) -> None:
    index = {"first": 1, "middle": 2, "last": 3}[position]  # tensor 0 is empty
    ts[index][-1] = value


def test_applier_forwards_chunk_size_and_arguments() -> None:
    seen = []

    def op(chunk_size: int, noop: Tensor, lists: list[list[Tensor]], *args: object) -> str:
        seen.append((chunk_size, noop, lists, args))
        return "result"

    noop = flag()
    assert multi_tensor_applier(op, noop, [[]], 1.5, "x") == "result"
    assert seen == [(2048 * 32, noop, [[]], (1.5, "x"))]
    assert multi_tensor_applier.available is True
    assert mt.MultiTensorApply(512).chunk_size == 512


def test_amp_c_namespace_lists_the_ops() -> None:
    names = {n for n in mt.__all__ if n.startswith("multi_tensor_") and n != "multi_tensor_applier"}
    names.add("update_scale_hysteresis")
    assert names == set(amp_C.__all__)
    assert all(getattr(amp_C, n) is getattr(mt, n) for n in names)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_scale_matches_fp32_math(src: torch.dtype, dst: torch.dtype) -> None:
    inputs = tensors(src)
    outputs = [torch.full_like(t, 7.0, dtype=dst) for t in inputs]
    noop = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [inputs, outputs], 1 / 3)
    for i, o in zip(inputs, outputs):
        assert torch.equal(o, (i.float() * torch.tensor(1 / 3, dtype=torch.float32)).to(dst))
    assert noop.item() == 0


def test_scale_in_place() -> None:
    grads = tensors(torch.float32)
    expected = [g * 0.5 for g in grads]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [grads, grads], 0.5)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("position", POSITIONS)
def test_scale_flags_non_finite_inputs(position: str, bad: float) -> None:
    inputs = tensors(torch.float16)
    poison(inputs, position, bad)
    noop = flag()
    mt.multi_tensor_scale(0, noop, [inputs, [torch.empty_like(t, dtype=torch.float32) for t in inputs]], 2.0)
    assert noop.item() == 1


def test_scale_flag_is_about_inputs_and_is_never_cleared() -> None:
    inputs = [torch.tensor([3e38], device=device_under_test())]
    noop = flag()
    mt.multi_tensor_scale(
        0, noop, [inputs, [torch.empty(1, device=device_under_test())]], 10.0
    )  # the output overflows, the input is finite
    assert noop.item() == 0
    noop.fill_(1)
    mt.multi_tensor_scale(
        0, noop, [[torch.ones(2, device=device_under_test())], [torch.empty(2, device=device_under_test())]], 1.0
    )
    assert noop.item() == 1


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-6e4, 6e4, width=32), min_size=0, max_size=40),
    scale=st.floats(2**-14, 2**14, width=32),
)
def test_scale_property(values: list[float], scale: float) -> None:
    src = torch.tensor(values, dtype=torch.float32, device=device_under_test())
    out = torch.empty_like(src, dtype=torch.float16)
    noop = flag()
    mt.multi_tensor_scale(0, noop, [[src], [out]], scale)
    assert torch.equal(out, (src * torch.tensor(scale, dtype=torch.float32, device=device_under_test())).half())
    assert noop.item() == 0


@pytest.mark.parametrize(("arg_to_check", "bad_in", "flagged"), [(0, "y", 0), (1, "y", 1), (-1, "x", 1), (1, "x", 0)])
def test_axpby_checks_the_requested_argument(arg_to_check: int, bad_in: str, flagged: int) -> None:
    x, y = tensors(torch.float32, seed=1), tensors(torch.float16, seed=2)
    out = [torch.empty_like(t) for t in x]
    poison(x if bad_in == "x" else y, "middle", float("nan"))
    noop = flag()
    mt.multi_tensor_axpby(0, noop, [x, y, out], 2.0, -0.5, arg_to_check)
    assert noop.item() == flagged
    for a, b, o in zip(x, y, out):
        torch.testing.assert_close(o, 2.0 * a - 0.5 * b.float(), equal_nan=True)


def test_axpby_rejects_unknown_arg_to_check() -> None:
    message = "Invalid arg_to_check: 2. Allowed values: -1 (both), 0 (x), 1 (y)"
    with pytest.raises(ValueError, match=re.escape(message)):
        mt.multi_tensor_axpby(0, flag(), [[torch.ones(1, device=device_under_test())]] * 3, 1.0, 1.0, 2)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_torch(per_tensor: bool) -> None:
    ts = tensors(torch.float32) + tensors(torch.bfloat16, sizes=(5, 9), seed=3)
    noop = flag()
    norm, per = mt.multi_tensor_l2norm(0, noop, [ts], per_tensor)
    expected = fp64_norm(torch.cat([t.double() for t in ts]))
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected)
    if per_tensor:
        torch.testing.assert_close(per, torch.stack([fp64_norm(t) for t in ts]))
    else:
        assert per.shape == (0,)
    assert noop.item() == 0


@pytest.mark.parametrize("position", POSITIONS)
def test_l2norm_flags_non_finite(position: str) -> None:
    ts = tensors(torch.float16)
    poison(ts, position, float("inf"))
    noop = flag()
    norm, _ = mt.multi_tensor_l2norm(0, noop, [ts])
    assert noop.item() == 1 and torch.isinf(norm).all()


def test_l2norm_of_nothing_is_zero() -> None:
    norm, per = mt.multi_tensor_l2norm(0, flag(), [[]], True)
    assert torch.equal(norm, torch.zeros(1, device=device_under_test())) and per.shape == (0,)


def test_l2norm_scale_norms_the_input_and_scales_it() -> None:
    src = tensors(torch.float16, sizes=(4, 33))
    out = [torch.empty_like(t, dtype=torch.float32) for t in src]
    norm, per = mt.multi_tensor_l2norm_scale(0, flag(), [src, out], 0.25, True)
    torch.testing.assert_close(norm[0], fp64_norm(torch.cat([t.double() for t in src])))
    assert all(torch.equal(o, t.float() * 0.25) for t, o in zip(src, out))
    assert per.shape == (2,)


def test_unscale_l2norm_leaves_tensors_alone() -> None:
    ts = tensors(torch.float32, sizes=(8, 100))
    before = [t.clone() for t in ts]
    noop = flag()
    norm, per = mt.multi_tensor_unscale_l2norm(0, noop, [ts], torch.tensor([1 / 64], device=device_under_test()), True)
    torch.testing.assert_close(norm[0], fp64_norm(torch.cat(ts) / 64))
    torch.testing.assert_close(per, torch.stack([fp64_norm(t / 64) for t in ts]))
    assert all(torch.equal(a, b) for a, b in zip(ts, before)) and noop.item() == 0


# norms of large tensors: fp32 accumulation per chunk, as Apex
def test_norms_of_a_30m_element_tensor_match_float64() -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(30_000_000, generator=gen).mul_(3).add_(1)  # a mean offset is what defeats naive sums
    small = torch.randn(1000, generator=gen)
    expected = torch.tensor([big.double().norm().item(), small.double().norm().item()], dtype=torch.float64)
    total_expected = expected.square().sum().sqrt()

    def close(actual: Tensor, wanted: Tensor) -> None:
        torch.testing.assert_close(actual.double().reshape(wanted.shape), wanted, rtol=1e-6, atol=0)

    flag = torch.zeros(1, dtype=torch.int32)
    total, per = mt.multi_tensor_l2norm(0, flag, [[big, small]], True)
    close(total, total_expected)
    close(per, expected)
    total, per = mt.multi_tensor_l2norm_mp(0, flag, [[big, small]], True)
    close(total, total_expected)
    close(global_grad_norm([big, small], big.device), total_expected)
    close(layer_norms([big, small], 2), expected)


def adam_reference(g: Tensor, p: Tensor, m: Tensor, v: Tensor, step: int, mode: int, wd: float) -> Tensor:
    g = g.float() + (wd * p.float() if mode == 0 else 0)
    m.mul_(0.9).add_(0.1 * g)
    v.mul_(0.999).add_(0.001 * g * g)
    update = (m / (1 - 0.9**step)) / ((v / (1 - 0.999**step)).sqrt() + 1e-8)
    if mode != 0:  # Apex's kernel: mode 0 is L2, every other value decoupled (AdamW)
        update = update + wd * p.float()
    return p.float() - 1e-2 * update


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adam_op(mode: int, dtype: torch.dtype) -> None:
    g, p = tensors(dtype, sizes=(0, 40), seed=1), tensors(dtype, sizes=(0, 40), seed=2)
    m, v = (
        [torch.zeros_like(t, dtype=torch.float32) for t in p],
        [torch.zeros_like(t, dtype=torch.float32) for t in p],
    )
    rm, rv = [t.clone() for t in m], [t.clone() for t in v]
    expected = [adam_reference(a, b, c, d, 3, mode, 0.1) for a, b, c, d in zip(g, p, rm, rv)]
    multi_tensor_applier(amp_C.multi_tensor_adam, flag(), [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 3, mode, 1, 0.1)
    atol = 1e-6 if dtype == torch.float32 else 2e-3
    for actual, e in zip(p, expected):
        torch.testing.assert_close(actual.float(), e, atol=atol, rtol=atol)
    torch.testing.assert_close(m, rm)


@pytest.mark.parametrize("four_lists", [False, True])
def test_sgd_op_math_and_early_exit(four_lists: bool) -> None:
    g16 = tensors(torch.float16, sizes=(30,), seed=1)
    p32 = tensors(torch.float32, sizes=(30,), seed=2)
    m32 = [torch.ones(30, device=device_under_test())]
    lists = [g16, p32, m32] + (
        [[torch.zeros(30, dtype=torch.float16, device=device_under_test())]] if four_lists else []
    )
    noop = flag().fill_(1)
    before = [t.clone() for lst in lists for t in lst]
    mt.multi_tensor_sgd(0, noop, lists, 0.1, 0.9, 0.0, 0.5, True, False, False, 0.5)
    assert all(torch.equal(a, b) for a, b in zip([t for lst in lists for t in lst], before))

    g = g16[0].float() * 0.5 + 0.1 * p32[0]
    buf = 0.9 * m32[0] + g
    expected = p32[0] - 0.5 * (g + 0.9 * buf)
    mt.multi_tensor_sgd(0, noop.zero_(), lists, 0.1, 0.9, 0.0, 0.5, True, False, False, 0.5)
    torch.testing.assert_close(p32[0], expected)
    torch.testing.assert_close(m32[0], buf)
    if four_lists:
        assert torch.equal(lists[3][0], expected.half())
    assert noop.item() == 0


def test_adagrad_op_decoupled() -> None:
    g, p, h = (
        tensors(torch.float32, sizes=(25,), seed=1),
        tensors(torch.float32, sizes=(25,), seed=2),
        [torch.ones(25, device=device_under_test())],
    )
    expected = p[0] - 0.1 * (g[0] / ((1 + g[0] ** 2).sqrt() + 1e-10) + 0.01 * p[0])
    mt.multi_tensor_adagrad(0, flag(), [g, p, h], 0.1, 1e-10, 1, 0.01)
    torch.testing.assert_close(p[0], expected)


def test_lamb_op_writes_update_into_grads() -> None:
    g, p = tensors(torch.float32, sizes=(12, 20), seed=1), tensors(torch.float32, sizes=(12, 20), seed=2)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    p0 = [t.clone() for t in p]
    gnorm = torch.cat(g).norm().reshape(1)
    clipped = [t / gnorm for t in g]  # the global norm exceeds max_grad_norm=1
    updates = [c / (c.abs() + 1e-6) + 0.01 * q for c, q in zip(clipped, p0)]  # first step: m_hat/sqrt(v_hat) = sign
    noop = flag()
    mt.multi_tensor_lamb(0, noop, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, gnorm, 1.0, False)
    for grad, u, param, q in zip(g, updates, p, p0):
        torch.testing.assert_close(grad, u)
        torch.testing.assert_close(param, q - 1e-2 * q.norm() / u.norm() * u)
    assert noop.item() == 0


def test_novograd_op_blends_norms() -> None:
    g, p, m = (
        tensors(torch.float32, sizes=(10,), seed=1),
        tensors(torch.float32, sizes=(10,), seed=2),
        [torch.zeros(10, device=device_under_test())],
    )
    norms = torch.tensor([2.0], device=device_under_test())
    new_norm = (0.999 * 4.0 + 0.001 * g[0].norm() ** 2).sqrt()
    expected = p[0] - 1e-2 * ((0.1 * g[0] / 0.1) / (new_norm / (1 - 0.999) ** 0.5 + 1e-8))
    mt.multi_tensor_novograd(0, flag(), [g, p, m], norms, 1e-2, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2)
    torch.testing.assert_close(norms[0], new_norm)
    torch.testing.assert_close(p[0], expected)


@pytest.mark.parametrize(
    ("lists", "message"),
    [
        ([[torch.ones(1)]], "multi_tensor_scale takes 2 tensor lists, got 1"),
        (
            [[torch.ones(1)], []],
            "multi_tensor_scale: every tensor list must have the same length, got lengths [1, 0]",
        ),
        (
            [[torch.ones(2)], [torch.ones(3)]],
            "multi_tensor_scale: tensor 0 has 2 elements in the first list and 3",
        ),
    ],
)
def test_list_shape_errors(lists: list[list[Tensor]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        mt.multi_tensor_scale(0, flag(), lists, 1.0)


def test_amp_c_ops_accept_empty_lists() -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    flag = torch.zeros(1, dtype=torch.int32)
    lr, step, scale = torch.full((), 0.1), torch.ones((), dtype=torch.int32), torch.ones(1)
    mt.multi_tensor_scale(0, flag, [[], []], 2.0)
    mt.multi_tensor_axpby(0, flag, [[], [], []], 1.0, 1.0, -1)
    mt.multi_tensor_adam(0, flag, [[], [], [], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    mt.multi_tensor_adam_capturable(0, flag, [[], [], [], []], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, scale)
    mt.multi_tensor_adam_capturable_master(0, flag, [[]] * 5, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, scale)
    mt.multi_tensor_sgd(0, flag, [[], [], []], 0.0, 0.9, 0.0, 0.1, False, True, False)
    mt.multi_tensor_adagrad(0, flag, [[], [], []], 0.1, 1e-10, 0, 0.0)
    mt.multi_tensor_novograd(0, flag, [[], [], []], torch.zeros(0), 1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2)
    norm = torch.zeros(1)
    mt.multi_tensor_lamb(0, flag, [[]] * 4, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, norm, 1.0)
    mt.multi_tensor_lamb_mp(
        0, flag, [[]] * 4, lr, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, torch.ones(1), False, norm, scale
    )
    for op in (mt.multi_tensor_l2norm, mt.multi_tensor_l2norm_mp):
        total, per = op(0, flag, [[]], True)
        assert torch.equal(total, torch.zeros(1)) and per.numel() == 0
    total, _ = mt.multi_tensor_l2norm_scale(0, flag, [[], []], 2.0)
    assert torch.equal(total, torch.zeros(1))
    total, _ = mt.multi_tensor_unscale_l2norm(0, flag, [[]], torch.ones(1))
    assert torch.equal(total, torch.zeros(1))
    assert flag.item() == 0
