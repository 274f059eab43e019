"""Models that arrive already in fp16, bf16 or mixed precision, at every level (Apex's
``allow_incoming_model_not_fp32``, ampinit's ``allow_half_model``).

Levels that cast the model (O0, O2, O3, O5) must train such a model exactly as they train an fp32 model holding
the same values. Levels that leave the model as it is (O1, O4, ``cast_model_type=False``) are compared with plain
re-implementations written here: autocast around the forward, the loss scaled, the grads unscaled in their own
dtype (Apex's rule for direct params), fp32 masters for half params with master weights.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit.compat import apex as compat

KINDS = ["fp16", "bf16", "mixed"]
HALF_DTYPES = (torch.float16, torch.bfloat16)


class MixedNet(nn.Module):
    """Each layer takes its input in its own weight's dtype, so any mix of dtypes runs without amp's casts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in (self.fc1, self.bn, self.fc2, self.head):
            h = layer(h.to(layer.weight.dtype))
            if layer is not self.head:
                h = torch.tanh(h)
        return h


def make(kind: str) -> tuple[MixedNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MixedNet()
    if kind == "fp16":
        model.half()
    elif kind == "bf16":
        model.bfloat16()
    else:
        model.fc1.half()
        model.bn.bfloat16()
        model.head.bfloat16()  # fc2 stays fp32
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)


def upcast_twin(model: nn.Module, level: str = "O0") -> nn.Module:
    """The fp32 model holding exactly the half model's values.

    At O2/O5 (keep_batchnorm_fp32) affine BatchNorm layers are left as they come, in Apex (``convert_network``
    skips them) as in ampinit: the twin keeps them in their incoming dtype too.
    """
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if not (level in ("O2", "O5") and isinstance(module, nn.BatchNorm1d)):
            for p in module.parameters(recurse=False):
                p.data = p.data.float()
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(module, name, b.float())
    return twin


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean() * 1e-3  # small: no fp16 overflow at a scale of 2**16


def train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 4, **options: object
) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    amp.initialize(model, opt, verbosity=0, **options)
    for _ in range(steps):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, x, y), opt) as scaled:
            scaled.backward()
        opt.step()
    assert amp.stats().skipped_steps == 0
    state = collect(model, opt)
    amp.deinitialize()
    return state


def collect(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's tensors and the optimizer's own (fp32 masters with master weights), with their momentum."""
    state = raw_state(model)
    for i, master in enumerate(amp.master_params(opt)):
        state[f"master{i}"] = master.detach().clone()
        state[f"momentum{i}"] = opt.state[master]["momentum_buffer"].clone()
    return state


def raw_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the model computes with (``state_dict()`` reports them in their dtype before ``initialize``)."""
    return {k: v.detach().clone() for k, v in (*model.named_parameters(), *model.named_buffers())}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


# -- levels that cast the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5"])
def test_casting_levels_train_a_half_model_as_its_fp32_twin(level: str, kind: str) -> None:
    model, x, y = make(kind)
    twin = upcast_twin(model, level)
    assert_same(
        train(model, x, y, opt_level=level, allow_half_model=True),
        train(twin, x, y, opt_level=level, allow_half_model=level in ("O2", "O5")),
    )
    # Closing the session gives the model back its own dtypes.
    assert [p.dtype for p in model.parameters()] == [p.dtype for p in make(kind)[0].parameters()]


# -- levels that leave the model as it is ---------------------------------------------------------------------
def reference_function_cast(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, scale: float, steps: int = 4
) -> dict[str, torch.Tensor]:
    """O1/O4 written out: autocast forward, scaled loss, grads unscaled in place in their own dtype."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, x, y)
        (loss.float() * scale).backward()
        for p in model.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()
            p.grad.mul_(torch.tensor(1.0 / scale))
        opt.step()
    state = raw_state(model)
    for i, p in enumerate(opt.param_groups[0]["params"]):
        state[f"master{i}"] = p.detach().clone()
        state[f"momentum{i}"] = opt.state[p]["momentum_buffer"].clone()
    return state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("level", "dtype", "scale"), [("O1", torch.float16, 2.0**16), ("O4", torch.bfloat16, 1.0)])
def test_function_cast_levels_train_a_half_model_in_place(
    level: str, dtype: torch.dtype, scale: float, kind: str
) -> None:
    model, x, y = make(kind)
    expected = reference_function_cast(model, x, y, dtype, scale)
    got = train(model, x, y, opt_level=level, allow_half_model=True, cast_policy="native")
    assert_same(got, expected)


def reference_masters_without_model_cast(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float, steps: int = 4
) -> dict[str, torch.Tensor]:
    """Master weights with ``cast_model_type=False``: fp32 masters for the half params, the model as it is."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() if p.dtype in HALF_DTYPES else p for p in params]
    opt = torch.optim.SGD(masters, lr=0.5, momentum=0.9)
    for _ in range(steps):
        for p in params:
            p.grad = None
        (loss_of(model, x, y).float() * scale).backward()
        for p, m in zip(params, masters):
            assert p.grad is not None
            if m is p:
                p.grad.mul_(torch.tensor(1.0 / scale))
            else:
                m.grad = p.grad.float() * (1.0 / scale)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                if m is not p:
                    p.copy_(m)
    state = raw_state(model)
    for i, p in enumerate(opt.param_groups[0]["params"]):
        state[f"master{i}"] = p.detach().clone()
        state[f"momentum{i}"] = opt.state[p]["momentum_buffer"].clone()
    return state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("level", "scale"), [("O2", 2.0**16), ("O5", 1.0)])
def test_master_weights_without_model_cast_keep_the_model_as_it_is(level: str, scale: float, kind: str) -> None:
    model, x, y = make(kind)
    expected = reference_masters_without_model_cast(model, x, y, scale)
    got = train(model, x, y, opt_level=level, cast_model_type=False, allow_half_model=True)
    assert_same(got, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_o3_without_model_cast_is_plain_training_of_the_model_as_it_is(kind: str) -> None:
    model, x, y = make(kind)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(4):
        opt.zero_grad()
        loss_of(ref, x, y).backward()
        opt.step()
    got = train(model, x, y, opt_level="O3", cast_model_type=False, allow_half_model=True)
    expected = raw_state(ref)
    for i, p in enumerate(ref.parameters()):
        expected[f"master{i}"] = p.detach()
        expected[f"momentum{i}"] = opt.state[p]["momentum_buffer"]
    assert_same(got, expected)


# -- what is refused, and the Apex switch ---------------------------------------------------------------------
def test_bf16_model_is_accepted_without_the_switch() -> None:
    # Apex's check looked for 'Half' in the tensor type: bf16 models went through.
    model, x, y = make("bf16")
    twin = upcast_twin(model)
    assert_same(train(model, x, y, opt_level="O3"), train(twin, x, y, opt_level="O3"))


def test_allow_half_model_must_be_a_bool() -> None:
    model, _, _ = make("fp16")
    with pytest.raises(TypeError, match=re.escape("allow_half_model must be True or False, got 'yes'")):
        ampinit.initialize(model, opt_level="O2", allow_half_model="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_apex_switch_accepts_a_half_model_at_every_level(level: str) -> None:
    model, x, y = make("mixed")
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(RuntimeError, match=re.escape("allow_half_model=True")):
        compat.amp.initialize(model, opt, opt_level=level, verbosity=0)
    compat.amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        compat.amp.initialize(model, opt, opt_level=level, verbosity=0)
    finally:
        compat.amp._amp_state.allow_incoming_model_not_fp32 = False
    for _ in range(4):
        opt.zero_grad()
        with compat.amp.scale_loss(loss_of(model, x, y), opt) as scaled:
            scaled.backward()
        opt.step()
    state = collect(model, opt)
    ampinit.deinitialize()
    # The same training through the core API (compared bitwise with its references above).
    cast_policy = {"cast_policy": "apex"} if level in ("O1", "O4") else {}
    assert_same(state, train(twin, x, y, opt_level=level, allow_half_model=True, **cast_policy))
