"""Masters follow the model weights until the first backward: a custom init or a load written into the model
after ``initialize`` is what trains, a checkpoint loaded before the first backward stays exact, and from the first
backward on the masters are the truth.

What this is for, DDP ranks seeded differently that must all train rank 0's broadcast weights, is tested with
real processes in tests/test_distributed.py (the ``seeded`` scenarios of tests/_dist_worker.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


MASTER_CASES = {"O2": ("O2", True), "O5": ("O5", True), "remainder": ("O5", "remainder")}


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    yield
    while ampinit.current_session() is not None:
        ampinit.deinitialize()


def build(case: str, seed: int = 0, initial: list[torch.Tensor] | None = None) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    if initial is not None:
        with torch.no_grad():
            for param, value in zip(model.parameters(), initial):
                param.copy_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    level, master_weights = MASTER_CASES[case]
    amp.initialize(model, opt, opt_level=level, master_weights=master_weights, loss_scale=128.0, verbosity=0)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
        opt.zero_grad()
        with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def masters(model: nn.Module) -> list[torch.Tensor]:
    return [value.clone() for value in model.state_dict().values()]


def custom_init(model: nn.Module) -> None:
    """An init written into the half model after ``initialize`` (values exact in fp16 and bf16)."""
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.arange(param.numel()).reshape(param.shape) % 5 * 0.125 - 0.25 + index / 16)


def custom_init_before(case: str) -> list[torch.Tensor]:
    """The same init on an fp32 model, before ``initialize``: the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    custom_init(model)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_weights_written_after_initialize_are_what_trains(case: str) -> None:
    """Apex built its masters at the first backward, so an init written into the model after ``initialize``
    trained; masters built at ``initialize`` must follow it rather than copy stale values over it."""
    model, opt = build(case)
    custom_init(model)
    train(model, opt, 2)
    expected_model, expected_opt = build(case, initial=custom_init_before(case))
    train(expected_model, expected_opt, 2)
    assert_bitwise(masters(model), masters(expected_model))
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in expected_model.parameters()])


def write_without_a_version_bump(model: nn.Module, how: str) -> None:
    """``custom_init`` written as Apex-era code writes weights (``p.data.copy_``) or as a collective writes its
    tensor (here NumPy, which writes memory without telling torch): neither bumps the parameter's version."""
    reference = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    custom_init(reference)
    for param, value in zip(model.parameters(), reference.parameters()):
        before = param._version
        if how == ".data":
            param.data.copy_(value.detach())
        else:
            bits = value.detach().to(param.dtype).view(torch.int16).numpy()
            param.detach().view(torch.int16).numpy()[...] = bits
        assert param._version == before


@pytest.mark.parametrize("how", [".data", "numpy"])
@pytest.mark.parametrize("case", ["O2", "O5"])
def test_weights_written_without_a_version_bump_are_what_trains(case: str, how: str) -> None:
    """The masters followed a weight only when its version counter moved, so an init or a rank-0 broadcast
    written through ``.data`` or by a collective (``dist.broadcast(p, 0)``, Horovod's) was silently replaced by
    the stale masters at the first step: each DDP rank went on training its own seed's model. A weight that no
    longer holds its master's rounding was written. (Remainder masters cannot tell: their weight is the
    master's upper half, docs/distributed.md.)"""
    model, opt = build(case)
    write_without_a_version_bump(model, how)
    train(model, opt, 2)
    expected_model, expected_opt = build(case, initial=custom_init_before(case))
    train(expected_model, expected_opt, 2)
    assert_bitwise(masters(model), masters(expected_model))
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in expected_model.parameters()])


@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_a_checkpoint_or_close_before_the_first_step_keeps_an_init_written_after_initialize(case: str) -> None:
    model, _ = build(case)
    custom_init(model)
    assert_bitwise(masters(model), custom_init_before(case))
    ampinit.deinitialize()
    assert_bitwise([p.detach() for p in model.parameters()], custom_init_before(case))


@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_a_load_then_a_rewrite_of_the_same_weights_keeps_the_exact_masters(case: str) -> None:
    """Every rank loads the checkpoint, then DDP broadcasts rank 0's weights: the same values written again. The
    loaded fp32 masters (not their rounding) must go on training, also when a checkpoint was saved in between."""
    model, opt = build(case)
    train(model, opt, 2)
    # A deep copy, as torch.save makes: state_dict() returns the live masters and optimizer state.
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()})
    train(model, opt, 2)
    uninterrupted = masters(model)
    ampinit.deinitialize()

    model, opt = build(case, seed=1)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    model.state_dict()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.clone())
    train(model, opt, 2)
    assert_bitwise(masters(model), uninterrupted)


@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_a_write_after_a_load_is_followed(case: str) -> None:
    model, _ = build(case)
    torch.manual_seed(3)
    model.load_state_dict(nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2)).state_dict())
    custom_init(model)
    assert_bitwise(masters(model), custom_init_before(case))


@pytest.mark.parametrize("case", ["O2", "O5"])
def test_fp32_masters_stop_following_at_the_first_backward(case: str) -> None:
    """From the first backward on the masters are the truth, as in Apex: a weight written behind the optimizer's
    back is not taken (the next step overwrites it), and following costs the steps nothing."""
    model, opt = build(case)
    train(model, opt, 1)
    trained = masters(model)
    custom_init(model)
    assert_bitwise(masters(model), trained)


@pytest.mark.parametrize("case", ["O2", "O5"])
def test_a_write_to_the_last_slice_of_a_weight_is_seen(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rounding is compared slice by slice (a rounded copy of a whole large weight would add to the first
    # step's peak): a weight written only past the first slice is still followed.
    from ampinit._masters import grads

    monkeypatch.setattr(grads, "_ROUNDING_SLICE", 5)
    model, _ = build(case)
    weight = model[0].weight  # 48 elements: ten slices
    weight.data.view(-1)[-1] = 0.5  # no version bump
    assert masters(model)[0].view(-1)[-1].item() == 0.5  # the state_dict's master, brought up to date
