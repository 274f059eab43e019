"""Checkpoints across ``ampinit migrate --to torch``: a script's checkpoints saved before the migration (FusedAdam
state, Apex's amp state) resume in the migrated script as if the original had gone on.

The original runs under ampinit's Apex aliases (``ampinit run``), whose FusedAdam keeps Apex's layout: one step
count per parameter group (Apex's ``apex/optimizers/fused_adam.py``: ``group['step'] += 1``), per-parameter
``exp_avg``/``exp_avg_sq``. torch's Adam/AdamW count steps per parameter (``state[i]['step']``)."""

from __future__ import annotations

import io
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ampinit.migrate import convert_apex_checkpoint, migrate_source, torch_optimizer_state
from ampinit.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad
from tests._scripts import as_apex_code, exec_source

SCRIPT = textwrap.dedent(
    """
    import torch
    from apex import amp
    from apex.optimizers import FusedAdam


    def train(resume, data, out):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        if resume is not None:
            checkpoint = torch.load(resume)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
        losses = []
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, out)
        return losses
    """
)


def _train(source: str, aliases: bool, resume: Path | None, data: list[Any], out: Path) -> list[float]:
    with as_apex_code(aliases):
        losses = exec_source(source, "train.py")["train"](resume, data, out)  # type: ignore[operator]
    assert isinstance(losses, list)
    return losses


def test_a_checkpoint_saved_before_the_migration_resumes_in_the_migrated_script(tmp_path: Path) -> None:
    """Train 4 steps under `ampinit run` and save; go on 6 steps under `ampinit run` (the reference) and, from the
    same checkpoint, 6 steps in the `--to torch` script: the same losses step for step and the same weights. The
    migrated AdamW runs torch's per-tensor update where ampinit's FusedAdam runs torch's fused kernel, which round
    differently in the last bit (see the bitwise test below for the same kernel), hence float32 tolerances; a step
    count lost in the conversion changes the first resumed update by ~1e-3."""
    torch.manual_seed(1)
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(10)]
    migrated = migrate_source(SCRIPT, "torch")
    assert not migrated.refused and not migrated.needs_human, [s.render() for s in migrated.sites]
    assert "optimizer.load_state_dict(torch_adam_state(checkpoint[" in migrated.migrated
    saved = tmp_path / "step4.pt"
    _train(SCRIPT, True, None, data[:4], saved)
    reference = _train(SCRIPT, True, saved, data[4:], tmp_path / "reference.pt")
    resumed = _train(migrated.migrated, False, saved, data[4:], tmp_path / "resumed.pt")
    torch.testing.assert_close(resumed, reference, rtol=1e-5, atol=0.0)
    want = torch.load(tmp_path / "reference.pt")
    got = torch.load(tmp_path / "resumed.pt")
    torch.testing.assert_close(got["model"], want["model"], rtol=1e-5, atol=1e-7)
    assert got["amp"]["scale"] == want["amp"]["loss_scaler0"]["loss_scale"]
    steps = [float(state["step"]) for state in got["optimizer"]["state"].values()]
    assert steps == [float(want["optimizer"]["param_groups"][0]["step"])] * 4 == [10.0] * 4


def _fused_adam_run(steps: int, adam_w_mode: bool, seed: int = 0) -> tuple[torch.nn.Module, FusedAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    optimizer = FusedAdam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
        lr=1e-2,
        weight_decay=0.05,
        adam_w_mode=adam_w_mode,
    )
    _steps(model, optimizer, range(steps))
    return model, optimizer


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a checkpoint file gives it back: its own tensors, not the live optimizer's."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer)
    return loaded


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> list[torch.Tensor]:
    out = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 5, generator=generator), torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


@pytest.mark.parametrize(("adam_w_mode", "kind"), [(True, "AdamW"), (False, "Adam")])
def test_converted_fused_adam_state_continues_bitwise_on_the_same_kernel(adam_w_mode: bool, kind: str) -> None:
    """Where the math is the same (torch's fused Adam/AdamW kernel, which ampinit's FusedAdam runs), the torch
    optimizer resumed from the converted state takes the steps FusedAdam would have taken, bit for bit, in two
    parameter groups with their own learning rates."""
    model, optimizer = _fused_adam_run(3, adam_w_mode)
    converted = torch_optimizer_state(_saved(optimizer.state_dict()))
    clone = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    clone.load_state_dict(model.state_dict())
    native = getattr(torch.optim, kind)([{"params": clone[0].parameters()}, {"params": clone[2].parameters()}], lr=0.5)
    # saved groups replace the optimizer's own: fused=True comes with them, as from an AdamW(fused=True) checkpoint
    native.load_state_dict({**converted, "param_groups": [{**g, "fused": True} for g in converted["param_groups"]]})
    assert [g["lr"] for g in native.param_groups] == [1e-2, 3e-3] and native.param_groups[0]["fused"]
    want = _steps(model, optimizer, range(3, 8))
    got = _steps(clone, native, range(3, 8))
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step + 4} differs"


def test_the_file_helper_converts_as_the_library_does() -> None:
    """The function written into the migrated file and ampinit.migrate.torch_optimizer_state give the same state
    for FusedAdam state (fresh, and after steps); both pass torch's own state through and refuse LAMB's."""
    namespace = exec_source(migrate_source(SCRIPT, "torch").migrated, "train.py")
    helper = namespace["torch_adam_state"]
    states = [_fused_adam_run(0, True)[1].state_dict(), _fused_adam_run(2, False)[1].state_dict()]
    for state in states:
        assert helper(state) == torch_optimizer_state(state)  # type: ignore[operator]
    converted = torch_optimizer_state(states[1])
    assert all(set(group) == {"lr", "betas", "eps", "weight_decay", "params"} for group in converted["param_groups"])
    assert [s["step"] for s in converted["state"].values()] == [2.0] * 4
    assert "step" in states[1]["param_groups"][0] and "step" not in states[1]["state"][0]  # the input is unchanged
    model = torch.nn.Linear(2, 2)
    torch_state = torch.optim.AdamW(model.parameters()).state_dict()
    assert helper(torch_state) is torch_state  # type: ignore[operator]
    assert torch_optimizer_state(torch_state) == torch_state
    lamb = _lamb_state()
    with pytest.raises(ValueError, match=re.escape("see ampinit.migrate.convert_apex_checkpoint")):
        helper(lamb)  # type: ignore[operator]


def _lamb_state() -> dict[str, Any]:
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = FusedLAMB([parameter])
    parameter.grad = torch.ones(3)
    optimizer.step()
    return optimizer.state_dict()


def test_state_no_torch_optimizer_takes_is_refused_with_the_reason() -> None:
    lamb = _lamb_state()
    with pytest.raises(ValueError, match=re.escape("param_groups[0] is FusedLAMB state (it has ['max_grad_norm',")):
        torch_optimizer_state(lamb)
    parameter = torch.nn.Parameter(torch.ones(3))
    novograd = FusedNovoGrad([parameter])
    parameter.grad = torch.ones(3)
    novograd.step()
    with pytest.raises(ValueError, match=re.escape("param_groups[0] is FusedNovoGrad state")):
        torch_optimizer_state(novograd.state_dict())
    plain = _fused_adam_run(1, True)[1].state_dict()
    no_correction = {**plain, "param_groups": [{**g, "bias_correction": False} for g in plain["param_groups"]]}
    with pytest.raises(ValueError, match=re.escape("FusedAdam(bias_correction=False) state: torch's Adam")):
        torch_optimizer_state(no_correction)
    with_master = {**plain, "state": {**plain["state"], 0: {**plain["state"][0], "master_param": torch.ones(1)}}}
    with pytest.raises(ValueError, match=re.escape("parameter 0 has FusedAdam state ['master_param']")):
        torch_optimizer_state(with_master)


def test_convert_apex_checkpoint_converts_the_optimizer_entry() -> None:
    """The whole checkpoint: the FusedAdam entry loads into torch.optim.AdamW (raw FusedAdam state raises
    torch's KeyError: 'step'), other entries are kept, and the checkpoint passed in is left as it was."""
    model, optimizer = _fused_adam_run(2, True)
    checkpoint = _saved(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "amp": {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3}},
            "epoch": 7,
        }
    )
    native = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    with pytest.raises(KeyError, match="step"):
        native.load_state_dict(checkpoint["optimizer"])
    converted = convert_apex_checkpoint(checkpoint)
    assert converted["epoch"] == 7 and "step" in checkpoint["optimizer"]["param_groups"][0]
    native = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    native.load_state_dict(converted["optimizer"])
    for index, parameter in enumerate(model.parameters()):
        assert torch.equal(native.state[parameter]["exp_avg"], checkpoint["optimizer"]["state"][index]["exp_avg"])
        assert native.state[parameter]["step"].item() == 2.0
        assert native.state[parameter]["step"].dtype == torch.float32
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    assert convert_apex_checkpoint({**checkpoint, "optimizer": sgd})["optimizer"] == sgd


def test_a_migrated_file_that_loads_no_optimizer_state_names_the_converter() -> None:
    """Where the migrated file has no `<optimizer>.load_state_dict(...)` to route (the checkpoints are read
    elsewhere), the report says how to convert them."""
    source = "from apex.optimizers import FusedAdam\n\n\ndef make(params):\n    return FusedAdam(params, lr=0.01)\n"
    result = migrate_source(source, "torch")
    assert not result.refused
    assert any("ampinit.migrate.convert_apex_checkpoint" in site.message for site in result.sites)
    assert "torch_adam_state" not in result.migrated
