"""O1/O4 on whole models: recurrent layers, the weight-cast cache, other threads and torch.compile."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit as amp
from tests._device import on_device

LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]


def assert_within_rounding(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (computed in ``dtype``) is the fp32 ``reference`` to ``dtype``'s rounding, at the reference's scale.

    Casting rounds the inputs, the weights and each gate's result to ``dtype`` (relative error eps/2 each); along
    a few recurrent steps these add up to a few eps of the tensor's largest value. 4 eps of it, per tensor, leaves
    room for that and no more (the largest seen is 2.3 eps, a GRU weight's grad).
    """
    bound = 4 * torch.finfo(dtype).eps * reference.abs().max().item()
    torch.testing.assert_close(actual.float(), reference, rtol=0, atol=bound)


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class CastCounter(TorchDispatchMode):
    """Counts dtype casts (``_to_copy``) of tensors with a given storage, below autocast."""

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.ptr = watched.data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == self.ptr:
            self.count += 1
        return func(*args, **(kwargs or {}))


# -- recurrent layers ------------------------------------------------------------------------------------------------
RNNS: list[tuple[str, Callable[[], nn.Module]]] = [
    ("LSTM", lambda: nn.LSTM(4, 6, num_layers=2)),
    ("GRU", lambda: nn.GRU(4, 6, bidirectional=True)),
    ("RNN-tanh", lambda: nn.RNN(4, 6)),
    ("RNN-relu", lambda: nn.RNN(4, 6, nonlinearity="relu")),
    ("LSTMCell", lambda: nn.LSTMCell(4, 6)),
    ("GRUCell", lambda: nn.GRUCell(4, 6)),
    ("RNNCell", lambda: nn.RNNCell(4, 6)),
]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
@pytest.mark.parametrize(("name", "build"), RNNS, ids=[r[0] for r in RNNS])
def test_recurrent_layers_run_in_half_with_fp32_weights(
    level: str, dtype: torch.dtype, name: str, build: Callable[[], nn.Module]
) -> None:
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    x = g(3, 4) if "Cell" in name else g(5, 3, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    try:
        out = _first(model(x))
        assert out.dtype == dtype
        out.float().sum().backward()
    finally:
        amp.deinitialize()
    ref_out = _first(ref(x))
    ref_out.sum().backward()
    assert_within_rounding(out, ref_out, dtype)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert r.grad is not None
        assert_within_rounding(p.grad, r.grad, dtype)


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_lstm_with_packed_sequence(level: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.LSTM(4, 6)
    ref = copy.deepcopy(model)
    packed = nn.utils.rnn.pack_padded_sequence(g(5, 3, 4), torch.tensor([5, 3, 2]))
    amp.initialize(model, opt_level=level, verbosity=0)
    try:
        out = model(packed)[0]
        assert out.data.dtype == dtype
        out.data.float().sum().backward()
    finally:
        amp.deinitialize()
    ref_out = ref(packed)[0]
    ref_out.data.sum().backward()
    assert_within_rounding(out.data, ref_out.data, dtype)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32 and r.grad is not None
        assert_within_rounding(p.grad, r.grad, dtype)


# -- the weight-cast cache --------------------------------------------------------------------------------------------
class Tied(nn.Module):
    """One Linear applied twice, a second Linear tied to it, and an LSTMCell unrolled over 4 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.cell = nn.LSTMCell(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(self.a(x)))
        state = (h, h)
        for _ in range(4):
            state = self.cell(h, state)
        return state[0]


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_weights_are_cast_once_per_forward_and_reused(level: str, dtype: torch.dtype) -> None:
    model = Tied()
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    try:
        for weight in (model.a.weight, model.cell.weight_ih):  # native linear cache / ampinit's lstm_cell cache
            counter = CastCounter(weight)
            with counter:
                model(g(2, 6))
            assert counter.count == 1
    finally:
        amp.deinitialize()


def _expected(model: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return F.linear(x.to(dtype), model.weight.to(dtype), model.bias.to(dtype))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_cast_weights_are_never_stale(level: str, dtype: torch.dtype) -> None:
    model = nn.Linear(6, 6)
    opt = torch.optim.SGD(model.parameters(), 0.5)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    x = g(4, 6)
    try:
        # train -> step -> train: the second forward uses the stepped weights
        for _ in range(2):
            out = model(x)
            assert torch.equal(out, _expected(model, x, dtype).detach())
            with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        # train -> eval/no_grad -> train: the train forward after no_grad still reaches the fp32 weights
        with torch.no_grad():
            model(x)
        opt.zero_grad()
        model(x).float().sum().backward()
        assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
        # eval forwards around a load_state_dict (no optimizer step in between)
        with torch.no_grad():
            model(x)
            model.load_state_dict(nn.Linear(6, 6).state_dict())
            assert torch.equal(model(x), _expected(model, x, dtype))
        # and outside the model, in the initializing thread
        with torch.no_grad():
            torch.mv(model.weight, x[0])
            model.weight.mul_(2)
            expected = torch.mv(model.weight.to(dtype), x[0].to(dtype))
            assert torch.equal(torch.mv(model.weight, x[0]), expected)
    finally:
        amp.deinitialize()


def linear_in(dtype: torch.dtype, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """What a lower-precision ``F.linear`` must give: inputs and the weights *as they are now*, cast to ``dtype``."""
    with torch.no_grad():
        return F.linear(x.to(dtype), layer.weight.to(dtype), layer.bias.to(dtype))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_weights_outside_the_model_are_not_read_stale_after_an_in_place_update(level: str, dtype: torch.dtype) -> None:
    """A module outside the initialized model (a loss head, a probe) used in the training loop, updated in place,
    then used again: the second call must see the new weights.

    docs/cast-policy.md ("Weight-cast cache") promises that weights changed outside the optimizer are never read
    stale, and ``test_cast_weights_are_never_stale`` above checks it outside the model only for an op of ampinit's
    own cache (``torch.mv``, which compares versions). The native autocast kernels (``linear``, ``mm``,
    ``matmul``...) go through torch's cache, which checks no version: ampinit keeps the initializing thread inside
    one autocast region for the whole session and clears that cache only at model-forward entry, ``scale_loss`` exit
    and ``step``, so outside the model the old cast came back (got: the output of the weights before ``mul_``).
    Native ``torch.autocast`` has the same cache, but its region is the user's ``with`` block.

    Found by: the review of the O1/O4 cast policy.
    """
    model = nn.Linear(6, 6)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    head = nn.Linear(6, 6)
    x = g(4, 6)
    try:
        assert torch.equal(head(x), linear_in(dtype, x, head).detach())
        with torch.no_grad():
            head.weight.mul_(2)
        assert torch.equal(head(x), linear_in(dtype, x, head))
        # the same under no_grad (an eval loop over checkpoints of the head)
        with torch.no_grad():
            head(x)
            head.load_state_dict(nn.Linear(6, 6).state_dict())
            assert torch.equal(head(x), linear_in(dtype, x, head))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_weights_outside_the_model_are_not_read_stale_after_a_data_swap(level: str, dtype: torch.dtype) -> None:
    """``param.data = new`` keeps the Parameter and its version counter: ampinit's own cache (the extra kernels,
    here ``torch.mv`` on the CPU) compares object and version only, so outside a model forward it returned the
    cast of the old data. Same rule as above: weights changed outside the optimizer are never read stale.

    Found by: the review of the O1/O4 cast policy.
    """
    model = nn.Linear(6, 6)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    weight = nn.Parameter(g(6, 6))
    v = g(6, seed=1)
    try:
        torch.mv(weight, v)
        weight.data = g(6, 6, seed=2)
        with torch.no_grad():
            expected = torch.mv(weight.to(dtype), v.to(dtype))
        assert torch.equal(torch.mv(weight, v).detach(), expected)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_weights_are_still_cast_once_per_model_forward(level: str, dtype: torch.dtype) -> None:
    """The fix keeps the cache inside model forwards: a weight used twice in one forward is one cast (one autograd
    node), and the thread's cache flag is what it was once the forward and the session are over.

    Found by: the review of the O1/O4 cast policy.
    """
    cache_before = torch.is_autocast_cache_enabled()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.a(x)

    model = Twice()
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    try:
        first, second = model(g(2, 6))
        assert first.dtype == second.dtype == dtype
        # the weight's cast node (ToCopyBackward) is shared by the two linears
        weight_node = lambda out: next(  # noqa: E731
            f for f, _ in out.grad_fn.next_functions if f is not None and "ToCopy" in type(f).__name__
        )
        # Both nodes are held while compared (see ``_weight_casts``: an ``id()`` of a dropped one proves nothing).
        first_cast, second_cast = weight_node(first), weight_node(second)
        assert first_cast is second_cast
    finally:
        amp.deinitialize()
    assert torch.is_autocast_cache_enabled() == cache_before


# -- threads and torch.compile ---------------------------------------------------------------------------------------
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, self.ln(h), torch.softmax(h, -1).sum(-1)


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_model_forward_follows_the_apex_policy_in_other_threads(level: str, dtype: torch.dtype) -> None:
    model = Head()
    amp.initialize(model, opt_level=level, verbosity=0)
    seen: dict[str, Any] = {}

    def worker() -> None:
        seen["model"] = [t.dtype for t in model(g(2, 6))]
        seen["plain"] = torch.softmax(g(2, 6).to(dtype), -1).dtype

    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        amp.deinitialize()
    assert seen == {"model": [dtype, torch.float32, torch.float32], "plain": dtype}


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_compiled_model_gives_the_same_dtypes(level: str, dtype: torch.dtype) -> None:
    torch._dynamo.reset()
    model = on_device(Head())
    amp.initialize(model, opt_level=level, verbosity=0)
    try:
        x = on_device(g(2, 6))
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager")
        out = compiled(x)
        assert [t.dtype for t in out] == [t.dtype for t in eager] == [dtype, torch.float32, torch.float32]
        for a, b in zip(out, eager):
            torch.testing.assert_close(a, b)
    finally:
        amp.deinitialize()
        torch._dynamo.reset()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _Outer(nn.Module):
    """Tries an initialized inner model and falls back when it refuses the input (its pre-hook raises)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            h = self.inner(x)
        except ValueError:
            h = x
        return self.fc(h)


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_a_nested_forward_refused_by_a_pre_hook_leaves_the_enclosing_forward_cast(
    level: str, dtype: torch.dtype
) -> None:
    """In a thread other than the initializing one, a model forward is cast by the policy's forward hooks
    (docs/cast-policy.md, "Scope"). Here the outer model's forward calls an initialized inner model whose own
    pre-hook (an input check) raises before the policy's pre-hook runs; the outer forward catches it and goes on.

    Got: the policy's forward hook runs with ``always_call=True``, so it ran for the refused inner call and closed
    the *outer* forward's region: the rest of the outer forward ran uncast (its Linear gave float32, not the half
    dtype that native ``torch.autocast`` around the same forward gives).

    Found by: the review of the O1/O4 cast policy.
    """
    inner = _Inner()

    def refuse_batches(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].shape[0] > 1:
            raise ValueError("the inner path takes one sample at a time")

    inner.register_forward_pre_hook(refuse_batches)
    outer = _Outer(inner)
    amp.initialize([outer, inner], opt_level=level, verbosity=0)
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["dtype"] = outer(g(2, 4)).dtype
        seen["autocast after"] = torch.is_autocast_enabled("cpu")

    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        amp.deinitialize()
    with torch.autocast("cpu", dtype=dtype):
        native = outer(g(2, 4)).dtype
    assert seen == {"dtype": native, "autocast after": False}
    assert native == dtype
