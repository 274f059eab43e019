"""O1/O4 cast engine: Apex's op lists on the CPU, checked against Apex's lists (facts from the Apex source) for
the expected dtype and against an fp32 computation of the same op for the numerics."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampinit as amp
from ampinit._casting import kernels as cast_kernels
from ampinit._casting import lists as cast_lists
from ampinit._casting import policy as cast_policy

Fn = Callable[..., torch.Tensor]
LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]
TOL = {torch.float16: {"rtol": 2e-2, "atol": 2e-2}, torch.bfloat16: {"rtol": 8e-2, "atol": 8e-2}}

# Apex's lists, verbatim from apex/amp/lists/*_overrides.py (shared/reference/apex-amp.md §3.1).
APEX_FP16 = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
             "linear", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "__matmul__", "addbmm", "baddbmm",
             "bmm"}  # fmt: skip
APEX_FP32 = {"interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu", "layer_norm",
             "group_norm", "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss",
             "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss",
             "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
             "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
             "triplet_margin_loss", "ctc_loss", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10",
             "log2", "reciprocal", "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std",
             "sum", "var", "renorm", "__ipow__", "__pow__", "__rpow__", "cpu"}  # fmt: skip
APEX_CASTS = {"addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "eq", "equal", "ge",
              "gt", "le", "lt", "ne", "cat", "stack", "__add__", "__sub__", "__mul__", "__truediv__"}  # fmt: skip
# On PyTorch's CUDA fp32 list, not on Apex's: ampinit gives every device the union.
CUDA_ONLY_FP32 = {"log1p", "logsumexp"}
APEX_BANNED_MESSAGE = (
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` It requires that the "
    "output of the previous function be already a FloatTensor. \n\nMost models have a Sigmoid right before "
    "BCELoss. In that case, you can use\n    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single "
    "layer that is compatible with amp.\nAnother option is to add\n    amp.register_float_function(torch, 'sigmoid')"
    "\nbefore calling `amp.init()`.\nIf you _really_ know what you are doing, you can disable this warning by "
    "passing allow_banned=True to `amp.init()`."
)
BANNED_MESSAGE = APEX_BANNED_MESSAGE.replace(
    "amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`",
    "ampinit.register_float_function(torch, 'sigmoid')\nbefore calling `ampinit.initialize()`",
).replace("allow_banned=True to `amp.init()`", "allow_banned=True to `ampinit.initialize(..., allow_banned=True)`")


@pytest.fixture
def session(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    level, dtype, policy = request.param
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0, cast_policy=policy)
    try:
        yield dtype
    finally:
        amp.deinitialize()


APEX_SESSIONS = [pytest.param((level, dtype, "apex"), id=level) for level, dtype in (("O1", torch.float16),
                 ("O4", torch.bfloat16))]  # fmt: skip


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def positive(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values in [0.1, 0.9]: inside the domain of every op tested (log, acos, erfinv, rsqrt, division...)."""
    return 0.1 + 0.8 * torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def fp32_reference(fn: Fn, *args: torch.Tensor) -> torch.Tensor:
    """The same op on the same values in fp32, with no casting anywhere."""
    with amp.disable_casts():
        return fn(*(a.float() if a.is_floating_point() else a for a in args))


# -- the data ------------------------------------------------------------------------------------------------------
def test_lists_are_apexs_lists() -> None:
    c = cast_lists
    assert set(c.APEX_FUNCTIONAL_FP16 + c.APEX_TORCH_FP16 + c.APEX_TENSOR_FP16) == APEX_FP16
    assert set(c.APEX_FUNCTIONAL_FP32 + c.APEX_TORCH_FP32 + c.APEX_TENSOR_FP32) == APEX_FP32
    assert set(c.APEX_TORCH_CASTS + c.APEX_TORCH_SEQUENCE_CASTS + c.APEX_TENSOR_CASTS) >= APEX_CASTS
    assert c.APEX_FUNCTIONAL_BANNED == ("binary_cross_entropy",)
    every_name = {*APEX_FP16, *APEX_FP32, *c.APEX_TORCH_CASTS, *c.APEX_TENSOR_CASTS, "cat", "stack"}
    assert every_name <= set(c.APEX_TO_ATEN), "every Apex name is mapped to the aten ops that carry it"


# PyTorch's documented CUDA autocast lists (docs "Automatic Mixed Precision package", "CUDA Op-Specific
# Behavior"), written here by hand under their aten names. Names with no aten op of their own (composites such as
# cross_entropy, normalize, softmin, and the Python operators __pow__, __rdiv__...) are left out: they dispatch to
# ops in these lists. GRUCell/LSTMCell/RNNCell are the aten *_cell ops; multi_dot is linalg_multi_dot; grid_sample
# is grid_sampler.
DOCUMENTED_CUDA_FP16 = {
    "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "gru_cell", "linear", "lstm_cell",
    "matmul", "mm", "mv", "prelu", "rnn_tanh_cell", "rnn_relu_cell",
}  # fmt: skip
DOCUMENTED_CUDA_FP32 = {
    "acos", "asin", "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
    "cosine_similarity", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss",
    "kl_div", "l1_loss", "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss",
    "mse_loss", "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "pdist", "poisson_nll_loss",
    "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softplus", "sum",
    "renorm", "tan", "triplet_margin_loss",
}  # fmt: skip
DOCUMENTED_CUDA_WIDEST = {
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add", "tensordot",
}  # fmt: skip


def test_cuda_reference_lists_hold_pytorchs_documented_lists() -> None:
    """ampinit's copy of PyTorch's CUDA lists (what ``cast_policy="apex"`` keeps on CUDA) contains every op the
    PyTorch documentation lists, each under the same policy."""
    assert set(cast_lists.PYTORCH_CUDA_LOWER) >= DOCUMENTED_CUDA_FP16
    assert set(cast_lists.PYTORCH_CUDA_FP32) >= DOCUMENTED_CUDA_FP32
    assert set(cast_lists.PYTORCH_CUDA_PROMOTE) >= DOCUMENTED_CUDA_WIDEST
    lists = (cast_lists.PYTORCH_CUDA_LOWER, cast_lists.PYTORCH_CUDA_FP32, cast_lists.PYTORCH_CUDA_PROMOTE)
    for one, other in itertools.combinations(lists, 2):
        assert not set(one) & set(other), "an op has one policy"


def test_plan_adds_only_what_the_device_lacks() -> None:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for key in ("AutocastCPU", "AutocastCUDA"):
        planned = cast_lists.plan(key)
        for op, policy in planned.items():
            assert policy == "banned" or not has_kernel(op.name(), key), (key, op)
    cpu = {op.name() for op in cast_lists.plan("AutocastCPU")}
    cuda = {op.name() for op in cast_lists.plan("AutocastCUDA")}
    assert {"aten::softmax.int", "aten::layer_norm", "aten::exp", "aten::mv", "aten::lstm.input"} <= cpu
    assert not {"aten::softmax.int", "aten::layer_norm", "aten::exp", "aten::mv"} & cuda  # CUDA's own lists have them
    assert "aten::binary_cross_entropy" in cuda and "aten::binary_cross_entropy" in cpu


# -- lower precision ----------------------------------------------------------------------------------------------
LOWER_CASES: list[tuple[str, Fn, tuple[tuple[int, ...], ...]]] = [
    ("linear", F.linear, ((3, 4), (5, 4))),
    ("matmul", torch.matmul, ((3, 4), (4, 5))),
    ("__matmul__", lambda a, b: a @ b, ((3, 4), (4, 5))),
    ("mm", torch.mm, ((3, 4), (4, 5))),
    ("bmm", torch.bmm, ((2, 3, 4), (2, 4, 5))),
    ("addmm", torch.addmm, ((3, 5), (3, 4), (4, 5))),
    ("baddbmm", torch.baddbmm, ((2, 3, 5), (2, 3, 4), (2, 4, 5))),
    ("addbmm", torch.addbmm, ((3, 5), (2, 3, 4), (2, 4, 5))),
    ("mv", torch.mv, ((3, 4), (4,))),
    ("addmv", torch.addmv, ((3,), (3, 4), (4,))),
    ("addr", torch.addr, ((3, 4), (3,), (4,))),
    ("conv1d", F.conv1d, ((1, 2, 8), (3, 2, 3))),
    ("conv2d", F.conv2d, ((1, 2, 6, 6), (3, 2, 3, 3))),
    ("conv3d", F.conv3d, ((1, 2, 4, 4, 4), (3, 2, 3, 3, 3))),
    ("conv_transpose1d", F.conv_transpose1d, ((1, 2, 8), (2, 3, 3))),
    ("conv_transpose2d", F.conv_transpose2d, ((1, 2, 5, 5), (2, 3, 3, 3))),
    ("conv_transpose3d", F.conv_transpose3d, ((1, 2, 3, 3, 3), (2, 3, 2, 2, 2))),
    ("prelu", F.prelu, ((3, 4), (1,))),
]


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
@pytest.mark.parametrize(("name", "fn", "shapes"), LOWER_CASES, ids=[c[0] for c in LOWER_CASES])
def test_lower_precision_ops(session: torch.dtype, name: str, fn: Fn, shapes: tuple[tuple[int, ...], ...]) -> None:
    assert name in APEX_FP16
    args = [g(*s, seed=i) for i, s in enumerate(shapes)]
    out = fn(*args)
    assert out.dtype == session
    torch.testing.assert_close(out.float(), fp32_reference(fn, *args), **TOL[session])


# -- fp32 -------------------------------------------------------------------------------------------------------------
def _target(n: int, classes: int) -> torch.Tensor:
    return torch.arange(n) % classes


FP32_CASES: list[tuple[str, Fn, tuple[tuple[int, ...], ...]]] = [
    ("softmax", lambda x: torch.softmax(x, -1), ((3, 5),)),
    ("softmax", lambda x: F.softmax(x, -1), ((3, 5),)),
    ("softmax", lambda x: x.softmax(-1), ((3, 5),)),
    ("log_softmax", lambda x: F.log_softmax(x, -1), ((3, 5),)),
    ("log_softmax", lambda x: x.log_softmax(-1), ((3, 5),)),
    ("softmin", lambda x: F.softmin(x, -1), ((3, 5),)),
    ("layer_norm", lambda x: F.layer_norm(x, (5,)), ((3, 5),)),
    ("group_norm", lambda x: F.group_norm(x, 2), ((2, 4, 3),)),
    ("local_response_norm", lambda x: F.local_response_norm(x, 2), ((2, 4, 3),)),
    ("normalize", F.normalize, ((3, 5),)),
    ("gelu", F.gelu, ((3, 5),)),
    ("softplus", F.softplus, ((3, 5),)),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), ((1, 2, 3, 3),)),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2), ((1, 2, 3),)),
    ("exp", torch.exp, ((3, 5),)),
    ("exp", lambda x: x.exp(), ((3, 5),)),
    ("expm1", torch.expm1, ((3, 5),)),
    ("log", torch.log, ((3, 5),)),
    ("log1p", torch.log1p, ((3, 5),)),
    ("log2", lambda x: x.log2(), ((3, 5),)),
    ("log10", torch.log10, ((3, 5),)),
    ("pow", lambda x: torch.pow(x, 2), ((3, 5),)),
    ("__pow__", lambda x: x**3, ((3, 5),)),
    ("__rpow__", lambda x: 2**x, ((3, 5),)),
    ("pow", torch.pow, ((3, 5), (3, 5))),
    ("reciprocal", torch.reciprocal, ((3, 5),)),
    ("rsqrt", lambda x: x.rsqrt(), ((3, 5),)),
    ("sum", torch.sum, ((3, 5),)),
    ("sum", lambda x: x.sum(dim=1), ((3, 5),)),
    ("prod", lambda x: torch.prod(x, 1), ((3, 5),)),
    ("cumsum", lambda x: torch.cumsum(x, 1), ((3, 5),)),
    ("cumprod", lambda x: x.cumprod(1), ((3, 5),)),
    ("norm", torch.norm, ((3, 5),)),
    ("norm", lambda x: x.norm(dim=1), ((3, 5),)),
    ("norm", lambda x: torch.norm(x, p="fro"), ((3, 5),)),
    ("dist", torch.dist, ((3, 5), (3, 5))),
    ("std", torch.std, ((3, 5),)),
    ("std", lambda x: x.std(1), ((3, 5),)),
    ("var", lambda x: torch.var(x, 0), ((3, 5),)),
    ("renorm", lambda x: torch.renorm(x, 2, 0, 1.0), ((3, 5),)),
    ("acos", torch.acos, ((3, 5),)),
    ("asin", torch.asin, ((3, 5),)),
    ("cosh", torch.cosh, ((3, 5),)),
    ("sinh", torch.sinh, ((3, 5),)),
    ("tan", torch.tan, ((3, 5),)),
    ("erfinv", torch.erfinv, ((3, 5),)),
    ("logsumexp", lambda x: torch.logsumexp(x, 1), ((3, 5),)),
    ("mse_loss", F.mse_loss, ((3, 5), (3, 5))),
    ("l1_loss", F.l1_loss, ((3, 5), (3, 5))),
    ("smooth_l1_loss", F.smooth_l1_loss, ((3, 5), (3, 5))),
    ("nll_loss", lambda x: F.nll_loss(x, _target(6, 5)), ((6, 5),)),
    ("cross_entropy", lambda x: F.cross_entropy(x, _target(6, 5)), ((6, 5),)),
    ("kl_div", lambda x, y: F.kl_div(x, y, reduction="batchmean"), ((3, 5), (3, 5))),
    ("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits, ((3, 5), (3, 5))),
    ("cosine_similarity", F.cosine_similarity, ((3, 5), (3, 5))),
    ("poisson_nll_loss", F.poisson_nll_loss, ((3, 5), (3, 5))),
    ("hinge_embedding_loss", F.hinge_embedding_loss, ((3, 5), (3, 5))),
    ("margin_ranking_loss", lambda x, y: F.margin_ranking_loss(x, y, torch.ones(5)), ((5,), (5,))),
    ("soft_margin_loss", F.soft_margin_loss, ((3, 5), (3, 5))),
    ("multilabel_soft_margin_loss", lambda x: F.multilabel_soft_margin_loss(x, torch.ones(3, 5)), ((3, 5),)),
    ("multi_margin_loss", lambda x: F.multi_margin_loss(x, _target(3, 5)), ((3, 5),)),
    ("triplet_margin_loss", F.triplet_margin_loss, ((3, 5), (3, 5), (3, 5))),
    ("cosine_embedding_loss", lambda x, y: F.cosine_embedding_loss(x, y, torch.ones(3)), ((3, 5), (3, 5))),
]


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
@pytest.mark.parametrize(("name", "fn", "shapes"), FP32_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FP32_CASES)])
def test_fp32_ops_from_half_inputs(
    session: torch.dtype, name: str, fn: Fn, shapes: tuple[tuple[int, ...], ...]
) -> None:
    assert name in APEX_FP32 | CUDA_ONLY_FP32
    args = [positive(*s, seed=i).to(session) for i, s in enumerate(shapes)]
    out = fn(*args)
    assert out.dtype == torch.float32
    # Python compositions whose first steps are not on any list (the square and average pool of
    # local_response_norm, the logsigmoid of multilabel_soft_margin_loss) run those steps in half precision.
    tolerance = TOL[session] if name in PARTLY_HALF else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, fp32_reference(fn, *args), **tolerance)


PARTLY_HALF = {"local_response_norm", "multilabel_soft_margin_loss"}


@pytest.mark.parametrize("session", [pytest.param(("O1", torch.float16, "native"), id="O1-native")], indirect=True)
def test_native_policy_keeps_pytorchs_cpu_lists(session: torch.dtype) -> None:
    x = g(3, 5).half()
    assert torch.softmax(x, -1).dtype == torch.float16  # not on PyTorch's CPU lists
    assert F.mse_loss(x, x).dtype == torch.float32  # on them
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")
    assert cast_kernels.KERNELS.registered() == {}


def test_ops_that_aten_promotes_itself_get_no_kernel() -> None:
    """Where aten's type promotion already gives Apex's promote (mixed half/fp32 -> fp32), nothing is added."""
    half, full = torch.ones(3, 4, dtype=torch.float16), torch.ones(3, 4)
    assert torch.addcmul(half, full, full).dtype == torch.float32  # no session: aten's own promotion
    planned = {op.name() for op in cast_lists.plan("AutocastCPU")}
    assert not {"aten::addcmul", "aten::addcdiv", "aten::atan2"} & planned
    assert {"aten::dot", "aten::scatter_add"} <= planned  # these raise on mixed dtypes natively


# -- promote and match --------------------------------------------------------------------------------------------
PROMOTE_CASES: list[tuple[str, Fn, tuple[tuple[int, ...], ...]]] = [
    ("add", torch.add, ((3, 4), (3, 4))),
    ("__add__", lambda a, b: a + b, ((3, 4), (3, 4))),
    ("__sub__", lambda a, b: a - b, ((3, 4), (3, 4))),
    ("mul", torch.mul, ((3, 4), (3, 4))),
    ("__truediv__", lambda a, b: a / b, ((3, 4), (3, 4))),
    ("div", torch.div, ((3, 4), (3, 4))),
    ("cat", lambda a, b: torch.cat([a, b]), ((3, 4), (3, 4))),
    ("stack", lambda a, b: torch.stack([a, b]), ((3, 4), (3, 4))),
    ("addcmul", lambda a, b: torch.addcmul(a, b, b), ((3, 4), (3, 4))),
    ("addcdiv", lambda a, b: torch.addcdiv(a, b, b), ((3, 4), (3, 4))),
    ("atan2", torch.atan2, ((3, 4), (3, 4))),
    ("dot", torch.dot, ((4,), (4,))),
    ("vdot", torch.vdot, ((4,), (4,))),
    ("cross", lambda a, b: torch.cross(a, b, dim=1), ((4, 3), (4, 3))),
    ("cross", torch.linalg.cross, ((4, 3), (4, 3))),
    ("bilinear", lambda a, b: F.bilinear(a, b, torch.ones(2, 4, 4)), ((3, 4), (3, 4))),
    ("index_put", lambda a, b: a.index_put((torch.tensor([0, 2]),), b[:2]), ((3, 4), (3, 4))),
    ("scatter_add", lambda a, b: a.scatter_add(0, torch.tensor([[0, 1, 2, 0]]), b[:1]), ((3, 4), (3, 4))),
    ("tensordot", lambda a, b: torch.tensordot(a, b.T, dims=1), ((3, 4), (3, 4))),
]


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
@pytest.mark.parametrize(
    ("name", "fn", "shapes"), PROMOTE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(PROMOTE_CASES)]
)
@pytest.mark.parametrize("half_first", [True, False])
def test_promote_ops_run_in_the_widest_type(
    session: torch.dtype, name: str, fn: Fn, shapes: tuple[tuple[int, ...], ...], half_first: bool
) -> None:
    assert name in APEX_CASTS | {"vdot", "index_put", "scatter_add", "tensordot"}  # the last four: CUDA's list
    a, b = positive(*shapes[0], seed=0), positive(*shapes[1], seed=1)
    a, b = (a.to(session), b) if half_first else (a, b.to(session))
    out = fn(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fp32_reference(fn, a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
def test_comparisons_promote_and_other_ops_match_their_input(session: torch.dtype) -> None:
    a, b = g(3, 4).to(session), g(3, 4, seed=1)
    for op in (torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge):
        assert torch.equal(op(a, b), op(a.float(), b))
    assert F.relu(a).dtype == session and F.relu(b).dtype == torch.float32
    bn = nn.BatchNorm1d(4)  # fp32 weights and statistics, half input
    out = bn(a)
    assert out.dtype == session and bn.weight.dtype == torch.float32
    torch.testing.assert_close(out.float(), fp32_reference(nn.BatchNorm1d(4), a), **TOL[session])


# -- banned -------------------------------------------------------------------------------------------------------
def test_banned_message_is_apexs_addressed_to_ampinit() -> None:
    assert cast_lists.BANNED_BCE_MESSAGE == BANNED_MESSAGE


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
def test_binary_cross_entropy_on_half_inputs_is_banned(session: torch.dtype) -> None:
    p, y = torch.sigmoid(g(3, 4).to(session)), torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError, match=re.escape(BANNED_MESSAGE)):
        F.binary_cross_entropy(p, y.to(session))
    with pytest.raises(NotImplementedError, match=re.escape(BANNED_MESSAGE)):
        nn.BCELoss()(p, y)
    assert F.binary_cross_entropy(p.float(), y).dtype == torch.float32  # fp32 inputs are fine, as in Apex


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_allow_banned_computes_binary_cross_entropy_in_fp32(level: str, dtype: torch.dtype) -> None:
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level=level, verbosity=0, allow_banned=True)
    try:
        p, y = torch.sigmoid(g(3, 4).to(dtype)), torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
        out = nn.BCELoss()(p, y.to(dtype))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, fp32_reference(F.binary_cross_entropy, p, y.to(dtype)))
    finally:
        amp.deinitialize()


def test_register_float_sigmoid_is_the_documented_way_out_of_the_ban() -> None:
    amp.register_float_function(torch, "sigmoid")
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level="O1", verbosity=0)
    try:
        logits = model(g(3, 4))
        assert logits.dtype == torch.float16
        p = torch.sigmoid(logits)
        assert p.dtype == torch.float32
        assert nn.BCELoss()(p, torch.full((3, 4), 0.5)).dtype == torch.float32
    finally:
        amp.deinitialize()
    assert torch.sigmoid is torch._C._VariableFunctions.sigmoid


# -- lifecycle of the kernels ---------------------------------------------------------------------------------------
def test_kernels_are_reference_counted_and_removed_at_close() -> None:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has_kernel("aten::softmax.int", "AutocastCPU")
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    s1 = amp.initialize(first, opt_level="O1", verbosity=0)
    session1 = amp.session_of(s1)
    amp.initialize(second, opt_level="O4", verbosity=0)
    session2 = amp.session_of(second)
    assert session1 is not None and session2 is not None
    assert cast_kernels.KERNELS.registered() == {"cpu": 2}
    session1.close()
    assert has_kernel("aten::softmax.int", "AutocastCPU")
    session2.close()
    assert cast_kernels.KERNELS.registered() == {}
    assert not has_kernel("aten::softmax.int", "AutocastCPU")
    with torch.autocast("cpu", dtype=torch.float16):  # native behaviour is back, including the banned op
        h = g(2, 2).half()
        assert torch.softmax(h, -1).dtype == torch.float16
        assert F.binary_cross_entropy(torch.sigmoid(h), torch.rand(2, 2).half()).dtype == torch.float32


@pytest.mark.parametrize("session", APEX_SESSIONS[:1], indirect=True)
def test_other_threads_with_native_autocast_keep_native_semantics(session: torch.dtype) -> None:
    seen: dict[str, torch.dtype] = {}

    def worker() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            h = g(2, 3).half()
            seen["softmax"] = torch.softmax(h, -1).dtype
            seen["bce"] = F.binary_cross_entropy(torch.sigmoid(h), torch.rand(2, 3).half()).dtype

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"softmax": torch.float16, "bce": torch.float32}


def test_unknown_policy_and_device_are_refused_before_any_change() -> None:
    # The policy name is one of initialize's options, checked with them (``ampinit._options``), not again here.
    with pytest.raises(
        ValueError, match=re.escape("cast_policy must be one of ['auto', 'apex', 'native'], got 'fast'")
    ):
        amp.initialize(nn.Linear(2, 2), opt_level="O1", cast_policy="fast", verbosity=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("needs an autocast dispatch key for device type 'meta'")):
        cast_policy.CastPolicy(["meta"], torch.float16)
    assert cast_kernels.KERNELS.registered() == {}


@pytest.mark.parametrize("session", APEX_SESSIONS, indirect=True)
def test_disable_casts_covers_the_new_kernels_and_restores_on_error(session: torch.dtype) -> None:
    h = g(3, 4).to(session)
    with amp.disable_casts():
        assert torch.softmax(h, -1).dtype == session
        assert torch.mv(g(3, 4), g(4)).dtype == torch.float32
    with pytest.raises(KeyError), amp.disable_casts():
        raise KeyError
    assert torch.softmax(h, -1).dtype == torch.float32
    assert torch.mv(g(3, 4), g(4)).dtype == session


class _Checkpointed(nn.Module):
    """Linear -> (LayerNorm -> GELU -> Linear, checkpointed or not): the segment holds ops only Apex casts on CPU."""

    def __init__(self, checkpoint: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.segment = nn.Sequential(nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.checkpoint is None:
            return self.segment(h)
        reentrant = self.checkpoint == "reentrant"
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.segment, h, use_reentrant=reentrant)
        return out


def _grads_with_backward_in(checkpoint: str | None, other_thread: bool) -> list[torch.Tensor]:
    model = _Checkpointed(checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = model(x).float().pow(2).sum()
        errors: list[BaseException] = []

        def backward() -> None:
            try:
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
            except BaseException as error:  # re-raised in the test's thread
                errors.append(error)

        if other_thread:
            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
        else:
            backward()
        if errors:
            raise errors[0]
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("checkpoint", ["reentrant", "non-reentrant"])
def test_checkpoint_recompute_in_another_thread_casts_like_the_forward(checkpoint: str) -> None:
    # CUDA backward, and with it the checkpoint's recompute, runs on autograd's device thread; on the CPU a
    # backward started in another thread shows the same: the recompute must cast as the forward did (LayerNorm
    # and GELU in fp32), or its values and dtypes differ from the forward's.
    reference = _grads_with_backward_in(None, other_thread=False)
    grads = _grads_with_backward_in(checkpoint, other_thread=True)
    assert len(grads) == len(reference) == 6
    for grad, expected in zip(grads, reference):
        assert torch.equal(grad, expected)


def _grads_of_whole_model_checkpoint(checkpoint: str | None) -> list[torch.Tensor]:
    """The model passed to initialize, checkpointed as a whole, trained in a thread other than initialize's."""
    model = _Checkpointed(None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grads: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def train() -> None:
            try:
                if checkpoint is None:
                    out = model(x)
                else:
                    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=checkpoint == "reentrant")
                assert out.dtype == torch.bfloat16
                with amp.scale_loss(out.float().pow(2).sum(), optimizer) as scaled:
                    scaled.backward()
                grads.extend(p.grad.clone() for p in model.parameters())
            except BaseException as error:  # re-raised in the test's thread
                errors.append(error)

        thread = threading.Thread(target=train)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return grads
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("checkpoint", ["reentrant", "non-reentrant"])
def test_checkpoint_around_the_model_in_another_thread_recomputes_with_its_casts(checkpoint: str) -> None:
    # In a thread other than initialize's only the model's forward hooks cast; the recompute runs them again inside
    # scale_loss's backward, whose cast suspension must not leave that forward uncast (non-reentrant: a
    # CheckpointError, saved bf16 and recomputed fp32; reentrant: other gradients).
    reference = _grads_of_whole_model_checkpoint(None)
    grads = _grads_of_whole_model_checkpoint(checkpoint)
    assert len(grads) == len(reference) == 6
    for grad, expected in zip(grads, reference):
        assert torch.equal(grad, expected)


def test_a_forward_inside_disable_casts_stays_uncast_in_any_thread() -> None:
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0)
    try:
        x = torch.randn(2, 8)
        with amp.disable_casts():
            assert model(x).dtype == torch.float32
        assert model(x).dtype == torch.bfloat16
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("checkpoint", ["reentrant", "non-reentrant"])
def test_checkpoint_around_the_model_inside_disable_casts_recomputes_uncast(checkpoint: str) -> None:
    # The forward ran inside the user's disable_casts(), the backward outside it: the recompute stays uncast too.
    model = _Checkpointed(None)
    reference = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with amp.disable_casts():
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=checkpoint == "reentrant")
        assert out.dtype == torch.float32
        with amp.scale_loss(out.pow(2).sum(), optimizer) as scaled:
            scaled.backward()
        fp32 = _Checkpointed(None)
        with torch.no_grad():
            for p, value in zip(fp32.parameters(), reference):
                p.copy_(value)
        with amp.disable_casts():  # the fp32 reference, in the initializing thread
            fp32(x).pow(2).sum().backward()
        for p, expected in zip(model.parameters(), fp32.parameters()):
            assert torch.equal(p.grad, expected.grad)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("other_thread", [False, True], ids=["initializing-thread", "other-thread"])
def test_a_step_closure_runs_its_forward_with_the_casts(other_thread: bool) -> None:
    # The optimizer step runs without casts, but its closure is the user's forward and backward.
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0)
    try:
        x = torch.randn(2, 8)
        seen: list[tuple[torch.dtype, torch.dtype]] = []
        errors: list[BaseException] = []

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            out = model(x)
            seen.append((out.dtype, torch.mm(x, x.t()).dtype))
            loss = out.float().pow(2).mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            return loss

        def train() -> None:
            try:
                optimizer.step(closure)
                seen.append((model(x).dtype, torch.mm(x, x.t()).dtype))
            except BaseException as error:  # re-raised in the test's thread
                errors.append(error)

        if other_thread:
            thread = threading.Thread(target=train)
            thread.start()
            thread.join()
        else:
            train()
        if errors:
            raise errors[0]
        # As the same code outside a closure: the model's forward cast in any thread, other torch calls in the
        # initializing thread only.
        outside = torch.float32 if other_thread else torch.bfloat16
        assert seen == [(torch.bfloat16, outside), (torch.bfloat16, outside)]
    finally:
        amp.deinitialize()
