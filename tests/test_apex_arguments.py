"""The values Apex *accepted* for ``initialize``, ``scale_loss`` and its optimizers, converted once at the Apex
border (``ampinit.compat.apex``), and the arguments Apex itself dropped in 2019 (decided from Apex's history).

The audit table: each row is an argument, a value real code passed and Apex accepted (read from Apex's
``frontend.py``/``_amp_state.py``/``handle.py``: it stored the value and compared it or tested it for truth), and
the value that behaves the same in ampinit's strict core. ampinit's own API stays strict.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampinit
from ampinit.compat import apex as compat
from ampinit.optimizers import FusedAdam

INITIALIZE_AUDIT: list[tuple[str, Any, Any]] = [
    ("verbosity", True, 1),  # verbosity=is_master; Apex compared `verbosity > 0` and `== 2`
    ("verbosity", False, 0),
    ("verbosity", np.int64(2), 2),
    ("verbosity", 0.0, 0),
    ("enabled", None, False),  # Apex: `if not enabled`
    ("enabled", 1, True),
    ("enabled", 0, False),
    ("num_losses", np.int32(2), 2),  # range(num_losses)
    ("num_losses", True, 1),
    ("master_weights", 1, True),  # `if properties.master_weights:`
    ("patch_torch_functions", 0, False),
    ("min_loss_scale", np.float32(1.0), 1.0),  # arithmetic; np.float32 is no Python float
    ("max_loss_scale", 65536, 65536.0),
    ("keep_batchnorm_fp32", "True", "True"),  # already read as its word by the core
]
SCALE_LOSS_AUDIT: list[tuple[str, Any, Any]] = [
    ("loss_id", np.int64(0), 0),  # a list index
    ("delay_unscale", 1, True),  # `if not delay_unscale`
    ("delay_unscale", None, False),
    ("delay_overflow_check", 0, False),
]


@pytest.mark.parametrize(("argument", "apex_value", "converted"), INITIALIZE_AUDIT)
def test_initialize_converts_what_apex_accepted(
    monkeypatch: pytest.MonkeyPatch, argument: str, apex_value: Any, converted: Any
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(ampinit, "initialize", lambda models, optimizers, **kw: seen.update(kw) or (models, optimizers))
    compat.amp.initialize(nn.Linear(2, 2), None, **{argument: apex_value})
    assert seen[argument] == converted and type(seen[argument]) is type(converted)


@pytest.mark.parametrize(("argument", "apex_value", "converted"), SCALE_LOSS_AUDIT)
def test_scale_loss_converts_what_apex_accepted(
    monkeypatch: pytest.MonkeyPatch, argument: str, apex_value: Any, converted: Any
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(ampinit, "scale_loss", lambda *args: seen.extend(args))
    compat.amp.scale_loss(torch.ones(()), None, **{argument: apex_value})
    names = ["loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check"]
    value = dict(zip(names, seen))[argument]
    assert value == converted and type(value) is type(converted)


def test_a_bool_verbosity_trains_through_the_apex_api() -> None:
    """``verbosity=args.local_rank == 0`` (ValueError before); the same steps as with ``verbosity=1``."""
    results = []
    for verbosity in (True, 1):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = compat.amp.initialize(model, optimizer, opt_level="O1", verbosity=verbosity)
        loss = model(torch.ones(3, 4)).float().pow(2).mean()
        with compat.amp.scale_loss(loss, optimizer, delay_unscale=0) as scaled:
            scaled.backward()
        optimizer.step()
        results.append(model.weight.detach().clone())
        ampinit.deinitialize()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_the_native_api_stays_strict() -> None:
    with pytest.raises(ValueError, match=re.escape("verbosity must be an int >= 0, got True")):
        ampinit.initialize(nn.Linear(2, 2), opt_level="O0", verbosity=True)


def test_what_apex_also_refused_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=re.escape("verbosity must be a whole number, got 0.5")):
        compat.amp.initialize(nn.Linear(2, 2), opt_level="O0", verbosity=0.5)


def _grads(model: nn.Module, scale: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)


def test_fused_adam_max_grad_norm_clips_each_group_as_apex_2019_did() -> None:
    """Apex before 690b1f71 (2019-08-08): each group's gradients divided by (norm + 1e-6) / max_grad_norm when
    that exceeds 1. Reference: torch.optim.Adam after clip_grad_norm_ per group (which uses the same 1e-6)."""
    torch.manual_seed(0)
    ours, reference = nn.Linear(3, 3), nn.Linear(3, 3)
    reference.load_state_dict(ours.state_dict())
    with pytest.warns(FutureWarning, match=re.escape("removed by Apex commit 690b1f71 (2019-08-08")):
        optimizer = FusedAdam(ours.parameters(), lr=0.1, adam_w_mode=False, max_grad_norm=1.0)
    plain = torch.optim.Adam(reference.parameters(), lr=0.1)
    for _ in range(2):
        _grads(ours, 5.0)
        _grads(reference, 5.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        plain.step()
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)
    assert optimizer.param_groups[0]["max_grad_norm"] == 1.0


def test_fused_adam_eps_inside_sqrt() -> None:
    with pytest.warns(FutureWarning, match=re.escape("Apex commit 18062b69")):
        FusedAdam(nn.Linear(2, 2).parameters(), eps_inside_sqrt=False)
    with pytest.raises(ValueError, match=re.escape("sqrt(v_hat + eps)")):
        FusedAdam(nn.Linear(2, 2).parameters(), eps_inside_sqrt=True)
    with pytest.raises(ValueError, match=re.escape("max_grad_norm must be a number >= 0 (0: no clipping), got -1")):
        FusedAdam(nn.Linear(2, 2).parameters(), max_grad_norm=-1)


def test_apex_optimizers_fp16_optimizer_names_its_history() -> None:
    with pytest.warns(FutureWarning, match=re.escape("commits be42aad5 to 1904e48d")):
        cls = compat.optimizers.FP16_Optimizer
    assert cls is compat.fp16_utils.FP16_Optimizer
