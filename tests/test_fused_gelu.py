"""Apex's fp32 ``gelu`` of a half tensor by one-pass kernels (``ampinit._casting.fused_gelu`` / ``triton_gelu``).

On CPU the kernels run on Triton's interpreter, whose math functions are not CUDA's: the kernels' arithmetic is
checked against a re-implementation of torch's CUDA kernel written here with the interpreter's erf and exp, the
check's choice against references built to match one variant or none, and the fused path in training against the
unfused one (close, since their erf differ, and exact where both run the same torch ops). tests/test_cuda.py checks
on a GPU that the check finds a variant with torch's bits, and that training gives the unfused path's bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

import ampinit
from ampinit._casting import fused_gelu

try:
    import triton.language as tl
except ImportError:  # the tests that run kernels take the triton_interpreter fixture, which skips without Triton
    tl = None

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
CPU = torch.device("cpu")


@pytest.fixture
def gelu_kernels(triton_interpreter: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``triton_gelu`` on the interpreter, the fused path taking CPU tensors, and no decision left behind."""
    import ampinit._casting.triton_gelu as kernels

    monkeypatch.setattr(fused_gelu, "ON_CPU", True)
    fused_gelu.forget()
    # The interpreter runs the kernels in numpy, which warns where IEEE arithmetic gives inf or NaN (gelu(-inf)).
    numpy_errors = np.seterr(all="ignore")
    try:
        yield kernels
    finally:
        np.seterr(**numpy_errors)
        fused_gelu.forget()


# -- a re-implementation of torch's CUDA kernel (GeluCUDAKernelImpl, exact erf), with the interpreter's erf/exp ----
# <cmath>'s M_SQRT1_2 and M_2_SQRTPI, and kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5 in double, each rounded to a float.
ALPHA = torch.tensor(0.70710678118654752440, dtype=torch.float32)
BETA = torch.tensor(1.12837916709551257390 * 0.70710678118654752440 * 0.5, dtype=torch.float32)


def erf32(v: torch.Tensor) -> torch.Tensor:
    return torch.erf(v.double()).float()  # the interpreter: math.erf in double, rounded to float


def exp32(v: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(v.numpy()))  # the interpreter: numpy's float32 exp


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float. The product is exact in double; the sum is rounded there first, which gives
    the once-rounded float except where it lands within 2**-29 of a float's half-way point: there the emulation
    would disagree with a true fused multiply-add, and the test fail rather than pass."""
    return (a.double() * b.double() + c.double()).float()


def _fma_probe(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(b_ptr), tl.load(c_ptr)))


@functools.cache
def interpreter_fma_rounds_once() -> bool:
    """Whether Triton's interpreter rounds ``tl.fma`` once, as the GPU does (3.9's does; 3.6's, torch 2.11's
    Triton, multiplies and adds in float32). (1 + 2**-12)**2 - (1 + 2**-11) is 2**-24 exactly, 0 rounded twice."""
    from triton.runtime.interpreter import InterpretedFunction

    a, c, out = torch.tensor([1 + 2**-12]), torch.tensor([-(1 + 2**-11)]), torch.zeros(1)
    InterpretedFunction(_fma_probe)[(1,)](a, a, c, out)
    assert out.item() in (0.0, 2**-24)
    return out.item() == 2**-24


def interpreter_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return fma32(a, b, c) if interpreter_fma_rounds_once() else a * b + c


def reference_forward(x: torch.Tensor) -> torch.Tensor:
    w = x.float()
    return w * 0.5 * (1.0 + erf32(w * ALPHA))


def reference_backward(dy: torch.Tensor, x: torch.Tensor, variant: int) -> torch.Tensor:
    w = x.float()
    one_plus_erf = 1.0 + erf32(w * ALPHA)
    pdf = exp32(-0.5 * w * w) * BETA
    if variant == 1:
        slope = interpreter_fma(w, pdf, 0.5 * one_plus_erf)
    elif variant == 2:
        slope = interpreter_fma(torch.full_like(w, 0.5), one_plus_erf, w * pdf)
    else:
        slope = 0.5 * one_plus_erf + w * pdf
    return (dy * slope).to(x.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: equal bits, or both NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())


# -- the kernels ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_each_variant_computes_torchs_cuda_arithmetic_in_its_order(
    gelu_kernels: ModuleType, dtype: torch.dtype
) -> None:
    x = fused_gelu.every_value(dtype, CPU)
    assert torch.equal(x.view(torch.int16).sort().values, torch.arange(-(2**15), 2**15).to(torch.int16))
    expected = reference_forward(x)
    for variant in gelu_kernels.FORWARD_VARIANTS:
        assert same_bits(gelu_kernels.forward(x, variant), expected).all(), variant
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    for variant in gelu_kernels.BACKWARD_VARIANTS:
        got = gelu_kernels.backward(dy, x, variant)
        assert got.dtype == dtype
        assert same_bits(got, reference_backward(dy, x, variant[0])).all(), variant
    if interpreter_fma_rounds_once() and dtype == torch.float16:
        # The variants are told apart here (by the last bits that survive rounding to fp16's 11 significant bits;
        # bf16's 8 need not keep any): the comparisons above pin which multiply each one fuses.
        written, fused_at_x = (gelu_kernels.backward(torch.ones(x.shape), x, (v, False)) for v in (0, 1))
        assert not same_bits(written, fused_at_x).all()


def test_a_large_tensor_is_covered_block_by_block(gelu_kernels: ModuleType) -> None:
    x = torch.randn(3 * gelu_kernels.BLOCK + 5, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert same_bits(gelu_kernels.forward(x, (0, False)), reference_forward(x)).all()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    assert same_bits(gelu_kernels.backward(dy, x, (0, False)), reference_backward(dy, x, 0)).all()


# -- the check -----------------------------------------------------------------------------------------------------
def kernel_reference(kernels: ModuleType, dtype: torch.dtype, forward: tuple[int, bool], backward: tuple[int, bool]):
    """A reference that is the kernels' ``forward``/``backward`` variants (in the check's fp32 terms)."""
    return fused_gelu.Reference(
        lambda wide: kernels.forward(wide.to(dtype), forward),
        lambda dy, wide: kernels.backward(dy, wide.to(dtype), backward, torch.float32),
    )


def off_by_one_ulp_at(y: torch.Tensor, index: int) -> torch.Tensor:
    y = y.clone()
    y[index] = torch.nextafter(y[index], torch.tensor(math.inf, dtype=y.dtype))
    return y


class Variants:
    """Stands in for ``triton_gelu``: variants of which only ``exact`` give the reference's bits."""

    FORWARD_VARIANTS = ((0, True), (0, False))
    BACKWARD_VARIANTS = ((0, True), (0, False), (1, False), (2, False))

    def __init__(self, exact: set[tuple[str, tuple[int, bool]]], slope_off: bool = False) -> None:
        self.exact, self.slope_off = exact, slope_off

    def forward(self, x: torch.Tensor, variant: tuple[int, bool]) -> torch.Tensor:
        y = F.gelu(x.float())
        return y if ("forward", variant) in self.exact else off_by_one_ulp_at(y, 4321)

    def backward(
        self, dy: torch.Tensor, x: torch.Tensor, variant: tuple[int, bool], out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        dx = torch.ops.aten.gelu_backward(dy, x.float()).to(out_dtype or x.dtype)
        if ("backward", variant) not in self.exact or (self.slope_off and out_dtype == torch.float32):
            return off_by_one_ulp_at(dx, 4321)
        return dx


def test_the_check_takes_the_first_variant_that_gives_the_references_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = {("forward", (0, False)), ("backward", (1, False)), ("backward", (2, False))}
    monkeypatch.setattr(fused_gelu, "_kernels", lambda: Variants(exact))
    assert fused_gelu._check(CPU, torch.bfloat16) == fused_gelu.Choice((0, False), (1, False))
    monkeypatch.setattr(fused_gelu, "_kernels", lambda: Variants({("forward", (0, True))}))
    assert fused_gelu._check(CPU, torch.bfloat16) is None  # no backward variant matches
    monkeypatch.setattr(fused_gelu, "_kernels", lambda: None)  # no Triton
    assert fused_gelu._check(CPU, torch.bfloat16) is None


def test_a_backward_whose_slope_differs_is_refused_though_its_half_results_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One fp32 ulp of slope can vanish in the rounding to half for the upstream grads tried and show for others:
    # the check compares the slope itself.
    every = {("forward", v) for v in Variants.FORWARD_VARIANTS} | {("backward", v) for v in Variants.BACKWARD_VARIANTS}
    monkeypatch.setattr(fused_gelu, "_kernels", lambda: Variants(every, slope_off=True))
    assert fused_gelu._check(CPU, torch.bfloat16) is None
    monkeypatch.setattr(fused_gelu, "_kernels", lambda: Variants(every))
    assert fused_gelu._check(CPU, torch.bfloat16) == fused_gelu.Choice((0, True), (0, True))


def test_one_differing_value_refuses_the_kernels(gelu_kernels: ModuleType) -> None:
    exact = kernel_reference(gelu_kernels, torch.bfloat16, (0, False), (0, False))
    assert fused_gelu._check(CPU, torch.bfloat16, exact) is not None

    def one_off(wide: torch.Tensor) -> torch.Tensor:
        return off_by_one_ulp_at(exact.forward(wide), 1234)

    assert fused_gelu._check(CPU, torch.bfloat16, fused_gelu.Reference(one_off, exact.backward)) is None


def test_where_no_variant_gives_torchs_bits_apex_unfused_gelu_runs(gelu_kernels: ModuleType) -> None:
    # The interpreter's erf is not torch's CPU erf: the check against torch refuses, and a gelu is Apex's own.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert fused_gelu.gelu(x, "none") is None
    assert fused_gelu.status() == {"cpu bfloat16": "unfused"}


@pytest.mark.parametrize(("level", "where"), [("O4", "cpu bfloat16"), ("O1", "cpu float16")])
def test_initialize_decides_for_the_sessions_half_dtype(gelu_kernels: ModuleType, level: str, where: str) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampinit.initialize(model, optimizer, opt_level=level, cast_policy="apex", verbosity=0)
    try:
        assert set(fused_gelu.status()) == {where}  # the other half dtype waits for a gelu of it
    finally:
        session = ampinit.session_of(model)
        assert session is not None
        session.close()
    x = torch.randn(3, 4).to(torch.float16 if where.endswith("bfloat16") else torch.bfloat16)
    fused_gelu.gelu(x, "none")
    assert len(fused_gelu.status()) == 2


# -- the fused path ------------------------------------------------------------------------------------------------
@pytest.fixture
def fused_on_cpu(gelu_kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fused path taken on CPU: the check told to accept the interpreted kernels' first variants."""
    accepted = fused_gelu.Choice((0, False), (0, False))
    monkeypatch.setattr(fused_gelu, "_check", lambda device, dtype, reference=None: accepted)
    return gelu_kernels


class GeluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def train_o4_apex(fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two O4 steps with Apex's lists; the grads of the last and the saved tensors' dtypes and shapes."""
    if not fused:
        monkeypatch.setattr(fused_gelu, "gelu", lambda x, approximate: None)
    torch.manual_seed(0)
    model = GeluNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampinit.initialize(model, optimizer, opt_level="O4", cast_policy="apex", verbosity=0)
    saved: list[torch.Tensor] = []
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    try:
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                loss = model(data).float().pow(2).mean()
            with ampinit.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    finally:
        session = ampinit.session_of(model)
        assert session is not None
        session.close()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], saved


def test_o4_with_apex_lists_trains_through_the_fused_gelu_as_through_apexs(
    fused_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    forward = fused_on_cpu.forward
    monkeypatch.setattr(fused_on_cpu, "forward", lambda x, v: calls.append(x.numel()) or forward(x, v))
    fused_grads, fused_saved = train_o4_apex(True, monkeypatch)
    assert calls == [16 * 32, 16 * 32]
    unfused_grads, unfused_saved = train_o4_apex(False, monkeypatch)
    # The interpreter's erf differs from torch's CPU erf by an fp32 ulp here and there; nothing else differs.
    for got, want in zip(fused_grads, unfused_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    # Apex's path saves an fp32 copy of gelu's input; the fused one the bf16 input itself, as native autocast.
    hidden = torch.Size([16, 32])
    assert [t.dtype for t in unfused_saved if t.shape == hidden].count(torch.float32) == 2
    assert [t.dtype for t in fused_saved if t.shape == hidden].count(torch.float32) == 0


# Forward-mode AD loads torch's decompositions, which call torch.jit.script: torch's own deprecation warning (a
# DeprecationWarning in 2.13, a FutureWarning in 2.14).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_double_backward_and_forward_mode_give_the_unfused_paths_values(fused_on_cpu: ModuleType) -> None:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).requires_grad_()
    y = fused_gelu.gelu(x, "none")
    assert y is not None and y.dtype == torch.float32
    (first,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.float().pow(2).sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.gelu(x_ref.float())
    (first_ref,) = torch.autograd.grad(y_ref.sum(), x_ref, create_graph=True)
    (second_ref,) = torch.autograd.grad(first_ref.float().pow(2).sum(), x_ref)
    assert torch.equal(first, first_ref) and torch.equal(second, second_ref)

    tangent = torch.randn(6, 5, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with fwAD.dual_level():
        out = fused_gelu.gelu(fwAD.make_dual(x.detach(), tangent), "none")
        assert out is not None
        got = fwAD.unpack_dual(out).tangent
        want = fwAD.unpack_dual(F.gelu(fwAD.make_dual(x.detach(), tangent).float())).tangent
    assert torch.equal(got, want)


class Marked(torch.Tensor):
    """A tensor subclass (as FakeTensor, DTensor, FunctionalTensor are)."""


@pytest.mark.parametrize(
    "case",
    ["tanh", "fp32", "strided", "subclass", "vmap"],
)
def test_what_the_fused_path_leaves_to_apexs(fused_on_cpu: ModuleType, case: str) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    if case == "tanh":
        assert fused_gelu.gelu(x, "tanh") is None
    elif case == "fp32":
        assert fused_gelu.gelu(x.float(), "none") is None
    elif case == "strided":
        assert fused_gelu.gelu(x.t(), "none") is None
    elif case == "subclass":
        assert fused_gelu.gelu(x.as_subclass(Marked), "none") is None
    else:
        seen: list[object] = []
        torch.vmap(lambda row: seen.append(fused_gelu.gelu(row, "none")) or row)(x)
        assert seen == [None]
    assert fused_gelu.gelu(x, "none") is not None  # the same tensor, plain: fused
