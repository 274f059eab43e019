"""Checkpoints written by Apex-style code resume under ampinit, and convert to native torch.amp.

Real Apex cannot run here, so the checkpoint is built as shared/reference/apex-amp.md §4.4 and §9 describe it:
``{'model': fp32 state dict (Apex's O2 hook), 'optimizer': torch format with indices over the fp32 masters in
param-group order and fp32 state, 'amp': {'loss_scaler0': {'loss_scale': float, 'unskipped': int}}}``."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit.compat.apex import amp
from ampinit.migrate import convert_apex_checkpoint, grad_scaler_state
from tests.conftest import make_problem


def apex_o2_checkpoint() -> dict[str, Any]:
    """What Apex O2 code saved after some training: fp32 weights, fp32 momentum keyed by master index."""
    model, x, y = make_problem(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17}},
        },
        buffer,
    )
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


def test_apex_o2_checkpoint_resumes_with_same_scale_masters_and_state() -> None:
    checkpoint = apex_o2_checkpoint()
    model, x, y = make_problem(seed=99)  # different initial weights: everything must come from the checkpoint
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # Apex's documented order
    try:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        assert amp._amp_state.loss_scalers[0].loss_scale() == 1024.0
        assert amp._amp_state.loss_scalers[0]._unskipped == 17
        masters = list(amp.master_params(opt))
        saved_weights = [checkpoint["model"][name] for name, _ in model.named_parameters()]
        assert len(masters) == len(saved_weights)
        for master, saved in zip(masters, saved_weights):
            assert master.dtype == torch.float32 and torch.equal(master, saved)
        saved_state = checkpoint["optimizer"]["state"]
        for index, master in enumerate(masters):
            assert torch.equal(opt.state[master]["momentum_buffer"], saved_state[index]["momentum_buffer"])
        assert model.fc1.weight.dtype == torch.float16
        assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())
        opt.zero_grad()
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 18}}
    finally:
        ampinit.deinitialize()


def test_amp_load_state_dict_follows_apex_rules() -> None:
    model, _, _ = make_problem()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", num_losses=2, verbosity=0)
    try:
        with pytest.warns(UserWarning, match=re.escape("state_dict contains 1 entries, while 2 loss_scalers are used")):
            amp.load_state_dict({"loss_scaler7": {"loss_scale": 8.0, "unskipped": 1}})  # position decides, not 7
        assert amp._amp_state.loss_scalers[0].loss_scale() == 8.0
        entry = {"loss_scale": 8.0, "unskipped": 1}
        with pytest.raises(RuntimeError, match=re.escape('Unexpected key(s) in state_dict: "bogus". ')):
            with pytest.warns(UserWarning, match=re.escape("state_dict contains 3 entries")):
                amp.load_state_dict({"loss_scaler0": entry, "loss_scaler1": entry, "bogus": 1})
    finally:
        ampinit.deinitialize()


def test_apex_checkpoint_converts_to_native_torch_amp() -> None:
    checkpoint = apex_o2_checkpoint()
    native = convert_apex_checkpoint(checkpoint)
    assert "amp" not in native
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(native["scaler"])
    assert scaler.get_scale() == 1024.0 and scaler._get_growth_tracker() == 17
    model, _, _ = make_problem(seed=99)
    model.load_state_dict(native["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(native["optimizer"])
    for index, param in enumerate(model.parameters()):
        assert torch.equal(
            opt.state[param]["momentum_buffer"], checkpoint["optimizer"]["state"][index]["momentum_buffer"]
        )
    half = {"model": {"w": torch.ones(2, dtype=torch.float16)}, "amp": checkpoint["amp"]}
    assert convert_apex_checkpoint(half)["model"]["w"].dtype == torch.float32


def test_grad_scaler_state_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=re.escape("loss_id=1 is out of range: the amp state has 1 loss scaler(s)")):
        grad_scaler_state({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}}, loss_id=1)
    with pytest.raises(KeyError, match=re.escape("The checkpoint has no 'amp' entry")):
        convert_apex_checkpoint({"model": {}})
