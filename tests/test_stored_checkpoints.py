"""Checkpoints that an earlier ampinit wrote still load, and training resumes from them exactly.

``tests/data/master_checkpoints.pt`` was written by ampinit at commit 93ab7cc (before the master-weight step
moved into ``ampinit/_masters/``) with :func:`write_checkpoints`: for each case below, the state dicts of the
model, the optimizer and amp after :data:`STEPS_BEFORE` steps of :func:`train`. It is never rewritten by the
tests. The reference is a fresh run from the same state, reached by another road: the checkpoint's values go
into a plain fp32 model and a plain optimizer with torch's own ``load_state_dict`` *before* ``initialize``,
and only amp's loss-scale state goes through amp. Loading after ``initialize`` (Apex's recipe) must land on
the same masters and optimizer state, and the next steps must give the same bits.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit.optimizers import FusedAdam, FusedSGD

DATA = Path(__file__).parent / "data" / "master_checkpoints.pt"
STEPS_BEFORE = 3
STEPS_AFTER = 3

#: case -> (initialize's keyword arguments, the optimizer)
CASES: dict[str, tuple[dict[str, Any], Callable[[Any], torch.optim.Optimizer]]] = {
    "O2-adamw": ({"opt_level": "O2"}, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "O5-fused_sgd": ({"opt_level": "O5"}, lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4)),
    "remainder-adamw": (
        {"opt_level": "O5", "master_weights": "remainder"},
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
    "remainder-fused_adam": (
        {"opt_level": "O5", "master_weights": "remainder"},
        lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    ),
}


def fresh_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batches(count: int, offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of steps ``offset`` to ``offset + count`` (each step's batch is its own, by seed)."""
    out = []
    for step in range(offset, offset + count):
        gen = torch.Generator().manual_seed(1000 + step)
        out.append((torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)))
    return out


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}


def write_checkpoints(path: Path) -> None:
    """How ``tests/data/master_checkpoints.pt`` was made (kept to document it; the tests only read the file)."""
    saved = {}
    for case, (kwargs, make_optimizer) in CASES.items():
        model = fresh_model(seed=7)
        model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), verbosity=0, **kwargs)
        try:
            train(model, optimizer, batches(STEPS_BEFORE, offset=0))
            saved[case] = state_of(model, optimizer)
        finally:
            ampinit.deinitialize()
    torch.save(saved, path, _use_new_zipfile_serialization=False)  # the legacy format: half the bytes


def same_bits(a: object, b: object) -> bool:
    """Equal nested state, tensors compared bit for bit (dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
            return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``state`` through torch's own serialisation."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stored() -> dict[str, Any]:
    return torch.load(DATA, weights_only=True)  # type: ignore[no-any-return]


def resume_after_initialize(case: str, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apex's recipe: initialize, then load all three state dicts. (State on loading, state after training.)"""
    kwargs, make_optimizer = CASES[case]
    checkpoint = snapshot(checkpoint)  # torch's optimizer loads state tensors by reference: train on a copy
    model = fresh_model(seed=99)  # other initial weights: everything must come from the checkpoint
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), verbosity=0, **kwargs)
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        loaded = snapshot(state_of(model, optimizer))
        train(model, optimizer, batches(STEPS_AFTER, offset=STEPS_BEFORE))
        return loaded, snapshot(state_of(model, optimizer))
    finally:
        ampinit.deinitialize()


def resume_from_plain_torch(case: str, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference: the values loaded by torch into fp32 objects before initialize, then the same steps."""
    kwargs, make_optimizer = CASES[case]
    checkpoint = snapshot(checkpoint)
    model = fresh_model(seed=123)
    model.load_state_dict(checkpoint["model"])
    optimizer = make_optimizer(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    model, optimizer = amp.initialize(model, optimizer, verbosity=0, **kwargs)
    try:
        amp.load_state_dict(checkpoint["amp"])
        loaded = snapshot(state_of(model, optimizer))
        train(model, optimizer, batches(STEPS_AFTER, offset=STEPS_BEFORE))
        return loaded, snapshot(state_of(model, optimizer))
    finally:
        ampinit.deinitialize()


@pytest.mark.parametrize("case", list(CASES))
def test_a_stored_checkpoint_loads_with_its_exact_masters_and_state(stored: dict[str, Any], case: str) -> None:
    checkpoint = stored[case]
    loaded, _ = resume_after_initialize(case, checkpoint)
    assert same_bits(loaded["model"], checkpoint["model"])  # fp32 masters, exact
    assert same_bits(loaded["optimizer"], checkpoint["optimizer"])
    assert loaded["amp"] == checkpoint["amp"]


@pytest.mark.parametrize("case", list(CASES))
def test_training_resumes_from_a_stored_checkpoint_as_a_fresh_run_from_the_same_state(
    stored: dict[str, Any], case: str
) -> None:
    checkpoint = stored[case]
    loaded, resumed = resume_after_initialize(case, checkpoint)
    reference_loaded, reference = resume_from_plain_torch(case, checkpoint)
    assert same_bits(loaded, reference_loaded)
    assert not same_bits(resumed["model"], checkpoint["model"])  # the steps after loading did train
    assert same_bits(resumed, reference)
