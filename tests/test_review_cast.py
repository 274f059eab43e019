"""Review of the O1/O4 cast policy: defects found, each shown by a test that failed on the code it was found in.

Expected values come from a plain re-implementation written here (``F.linear`` on explicitly cast tensors), not
from the library's own formulas.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampinit as amp

LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]


def g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def linear_in(dtype: torch.dtype, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """What a lower-precision ``F.linear`` must give: inputs and the weights *as they are now*, cast to ``dtype``."""
    with torch.no_grad():
        return F.linear(x.to(dtype), layer.weight.to(dtype), layer.bias.to(dtype))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_weights_outside_the_model_are_not_read_stale_after_an_in_place_update(level: str, dtype: torch.dtype) -> None:
    """A module outside the initialized model (a loss head, a probe) used in the training loop, updated in place,
    then used again: the second call must see the new weights.

    docs/cast-policy.md ("Weight-cast cache") promises that weights changed outside the optimizer are never read
    stale, and tests/test_cast_models.py checks it outside the model only for an op of ampinit's own cache
    (``torch.mv``, which compares versions). The native autocast kernels (``linear``, ``mm``, ``matmul``...) go
    through torch's cache, which checks no version: ampinit keeps the initializing thread inside one autocast
    region for the whole session and clears that cache only at model-forward entry, ``scale_loss`` exit and
    ``step``, so outside the model the old cast came back (got: the output of the weights before ``mul_``).
    Native ``torch.autocast`` has the same cache, but its region is the user's ``with`` block.
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
    node), and the thread's cache flag is what it was once the forward and the session are over."""
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


def test_close_refused_in_another_thread_can_be_retried_from_the_initializing_thread() -> None:
    """``close()`` from a thread other than the one that called ``initialize`` raises, and its message says to
    close from the initializing thread. Doing so must then restore everything (docs/api.md: ``close()`` undoes
    everything, autocast state restored).

    Got: the refused ``close()`` had already marked the session closed and undone the rest (hooks, optimizer
    methods), so the retry was a no-op; the initializing thread stayed in autocast with the policy in force and
    the extra autocast kernels stayed registered in the process for good.
    """
    from ampinit._casting import kernels, scopes

    autocast_before = torch.is_autocast_enabled("cpu")
    kernels_before = kernels.KERNELS.registered()
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    session = amp.current_session()
    assert session is not None
    errors: list[BaseException] = []

    def close_elsewhere() -> None:
        try:
            session.close()
        except RuntimeError as err:
            errors.append(err)

    try:
        thread = threading.Thread(target=close_elsewhere)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "thread that called initialize()" in str(errors[0])
    finally:
        session.close()  # the retry the message asks for
    assert torch.is_autocast_enabled("cpu") == autocast_before
    assert not scopes.thread_scopes()
    assert kernels.KERNELS.registered() == kernels_before
    assert torch.mm(g(2, 2), g(2, 2)).dtype == torch.float32


@pytest.mark.parametrize("how", ["apex list edit", "register_float_function"])
def test_function_patches_survive_sessions_closing_out_of_order(how: str) -> None:
    """Two O1 sessions open at once (supported: "Sessions may close in any order", CastPolicy), both patching
    ``torch.sigmoid`` to fp32, through an edit of Apex's lists (read by every ``initialize``) or a
    ``register_float_function`` before each ``initialize``. Apex's rule for such a name: while casts are on, its
    floating inputs are cast to fp32 (docs/cast-policy.md, "Editing Apex's lists" / "User functions").

    Got: closing the first session put back the ``torch.sigmoid`` it had found, dropping the open second session's
    patch (``torch.sigmoid`` of a half tensor gave float16 under the open session); closing the second then
    reinstalled the first session's wrapper, which outlived every session (``torch.sigmoid`` not the original).
    """
    from ampinit.compat.apex.amp.lists import torch_overrides

    original = torch.sigmoid
    sessions = []
    if how == "apex list edit":
        torch_overrides.FP32_FUNCS.append("sigmoid")
    try:
        for index in range(2):
            if how == "register_float_function":
                if index == 0:
                    amp.register_float_function(torch, "sigmoid")
                else:  # registered while the first session is open: for the next initialize (a warning says so)
                    with pytest.warns(UserWarning, match="takes effect at the next"):
                        amp.register_float_function(torch, "sigmoid")
            model = nn.Linear(4, 4)
            amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
            sessions.append(amp.current_session())
        half = g(3).half()
        assert torch.sigmoid(half).dtype == torch.float32
        sessions[0].close()
        assert torch.sigmoid(half).dtype == torch.float32  # the second session is still open
        sessions[1].close()
        assert torch.sigmoid is original
    finally:
        for session in reversed(sessions):
            session.close()
        if how == "apex list edit":
            torch_overrides.FP32_FUNCS.remove("sigmoid")
        torch.sigmoid = original  # so that the leak check reports this test only


def _weight_casts(out: torch.Tensor) -> int:
    """How many distinct cast nodes (``ToCopyBackward``) of leaves feed ``out``'s graph.

    Every node reached is held until the count is done. torch 2.11 gives an autograd node a new Python object each
    time it is reached unless one is alive (2.13 keeps one per node), so ids of dropped objects are reused: one
    node could count twice, or two nodes once, depending on the allocator, i.e. on the tests run before.
    """
    seen: dict[int, object] = {}
    casts: set[int] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        feeds_leaf = any("AccumulateGrad" in type(f).__name__ for f, _ in node.next_functions)
        if "ToCopy" in type(node).__name__ and feeds_leaf:
            casts.add(id(node))
        stack.extend(f for f, _ in node.next_functions)
    return len(casts)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_old_api_init_caches_weight_casts_as_apex_did(enable_caching: bool) -> None:
    """Apex's old ``amp.init(enable_caching=True)`` cast a weight once until the next ``scale_loss`` exit (an
    unrolled RNN cell keeps one fp16 copy of its weights, not one per step); ``enable_caching=False`` cast per use.
    Its sessions have no model forward, where ampinit caches, so the compat ``init`` keeps the cache on."""
    from ampinit.compat.apex import amp as apex_amp

    handle = apex_amp.init(enable_caching=enable_caching)
    try:
        layer = nn.Linear(4, 4)
        x = g(2, 4)
        out = layer(layer(x))
        assert _weight_casts(out) == (2 if enable_caching else 4)  # weight and bias, once or twice each
    finally:
        handle._deactivate()


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_registering_a_listed_torch_function_gives_it_the_registered_cast(level: str, dtype: torch.dtype) -> None:
    """Apex applied the user's ``register_*_function`` patches first, innermost, around the original function
    (shared/reference/apex-amp.md §3.2 step 0, before the lists in step 1): the original C function then ran on
    the arguments as the registration cast them, whatever list the name was also on. So after
    ``register_float_function(torch, "matmul")`` (forcing fp32 attention scores, say) ``torch.matmul`` is fp32,
    and after ``register_half_function(torch, "exp")`` ``torch.exp`` is half.

    Got: the registration cast the arguments, then torch's autocast cast them back by the list (``torch.mm``,
    ``torch.matmul``, ``F.linear`` half; ``torch.exp`` fp32): registering a listed function had no effect. The
    same reaches a pybind11 extension decorated with ``half_function`` (Apex's documented use): autocast cast
    the ATen calls it makes inside, which Apex never did.
    """
    amp.register_float_function(torch, "mm")
    amp.register_float_function(torch, "matmul")
    amp.register_float_function(F, "linear")
    amp.register_half_function(torch, "exp")
    amp.register_float_function(torch.Tensor, "bmm")
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    a, b = g(4, 4), g(4, 4, seed=1)
    try:
        torch.testing.assert_close(torch.mm(a, b), torch.mm(a.double(), b.double()).float())
        assert torch.matmul(a.to(dtype), b).dtype == torch.float32
        assert F.linear(a, b).dtype == torch.float32
        assert a[None].bmm(b[None]).dtype == torch.float32
        assert torch.equal(torch.exp(a), torch.exp(a.to(dtype)))
        # a Python function keeps the policy inside (Apex's patched functions applied inside it)
        helper = amp.float_function(lambda x, y: torch.bmm(x[None], y[None]))
        assert helper(a.to(dtype), b).dtype == dtype
    finally:
        amp.deinitialize()


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
