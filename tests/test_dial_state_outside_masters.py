"""The dial's bf16 and 8-bit moments where the optimizer steps on its own: after ``deinitialize()`` (the
optimizer's own ``step`` reads its state again) and in a session without masters loading a dial checkpoint
(O0/O1/O4, ``master_weights=False``). docs/precision.md: "Any setting's checkpoint ... loads into a session of any
other setting"; README/docs/api.md: ``close()`` undoes everything ``initialize`` did."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters.dial_grads import decode_moment


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(i))


def _session(optimizer_name: str = "adamw", model: nn.Module | None = None, **kw: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Linear(16, 16) if model is None else model
    if optimizer_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # O5 master_weights=False's eps warning is not this test's
        return amp.initialize(model, opt, verbosity=0, **kw)


def _amp_steps(model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
    for i in range(first, last):
        opt.zero_grad()
        with amp.scale_loss(model(_batch(i)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def _moment_keys(optimizer_name: str) -> tuple[str, ...]:
    return ("momentum_buffer",) if optimizer_name == "sgd" else ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_deinitialize_leaves_moments_the_optimizer_steps(optimizer_name: str, state: str) -> None:
    model, opt = _session(optimizer_name, opt_level="O5", optimizer_state=state)
    _amp_steps(model, opt, 0, 3)
    saved = opt.state_dict()
    meant = {k: decode_moment(k, saved["state"][0]) for k in _moment_keys(optimizer_name)}
    checkpoint = io.BytesIO()
    torch.save(saved, checkpoint)
    ampinit.deinitialize()

    held = opt.state[model.weight]
    for key, value in meant.items():
        assert held[key].dtype == torch.float32
        assert torch.equal(held[key], value)  # decoded exactly: what the stored moment meant
        assert key + "_absmax" not in held
    # A state_dict taken before the close still holds what it held.
    checkpoint.seek(0)
    reference = torch.load(checkpoint, weights_only=True)
    for key in meant:
        assert torch.equal(saved["state"][0][key], reference["state"][0][key])
        assert saved["state"][0][key].dtype == reference["state"][0][key].dtype
    # torch's own step takes it, as from a fp32 run of the decoded state.
    opt.zero_grad()
    model(_batch(3)).pow(2).mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_deinitialize_of_a_bf16_model_gives_moments_its_dtype() -> None:
    model, opt = _session(model=nn.Linear(16, 16).to(torch.bfloat16), opt_level="O5")
    _amp_steps(model, opt, 0, 2)
    ampinit.deinitialize()
    assert model.weight.dtype == torch.bfloat16
    assert opt.state[model.weight]["exp_avg"].dtype == torch.bfloat16
    opt.zero_grad()
    model(_batch(2).to(torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()  # torch's AdamW: moments of another dtype than their parameter raise


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize(
    "session",
    [dict(opt_level="O0"), dict(opt_level="O1"), dict(opt_level="O4"), dict(opt_level="O5", master_weights=False)],
    ids=["O0", "O1", "O4", "O5-no-masters"],
)
def test_an_8bit_checkpoint_loads_decoded_without_masters(optimizer_name: str, session: dict[str, Any]) -> None:
    model, opt = _session(optimizer_name, opt_level="O5", optimizer_state="8bit")
    _amp_steps(model, opt, 0, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    ampinit.deinitialize()
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    model, opt = _session(optimizer_name, **session)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    held = opt.state[model.weight]
    for key in _moment_keys(optimizer_name):
        meant = decode_moment(key, checkpoint["optimizer"]["state"][0])
        assert meant is not None
        assert key + "_absmax" not in held
        assert held[key].dtype == model.weight.dtype
        assert torch.equal(held[key], meant.to(model.weight.dtype))  # not the uint8 codes read as numbers
    _amp_steps(model, opt, 3, 4)
    ampinit.deinitialize()
