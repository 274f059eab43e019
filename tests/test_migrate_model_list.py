"""``--to torch`` for ``amp.initialize(models, optimizer)`` where ``models`` is a variable that holds a list of
models, as Apex accepts (one model, or a list). The GradScaler's device line must take the first model's device:
``next(models.parameters())`` raised ``AttributeError: 'list' object has no attribute 'parameters'`` at the first
line of the migrated file. The migrated script is run against the original under the Apex aliases (as ``ampinit
run`` runs it), loss by loss.
"""

from __future__ import annotations

import textwrap

import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

TWO_MODELS = textwrap.dedent(
    """
    import torch
    from apex import amp

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    models, optimizer = amp.initialize(models, optimizer, opt_level="O1")
    losses = []
    for step in range(4):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        optimizer.zero_grad()
        out = models[1](models[0](x))
        loss = torch.nn.functional.mse_loss(out, y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    """
)


def test_a_list_of_models_in_a_variable_gets_the_first_models_device() -> None:
    result = migrate_source(TWO_MODELS, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "amp_device = next(models[0].parameters()).device.type\n" in result.migrated


def test_the_migrated_list_of_models_trains_as_the_original(session_cleanup: None) -> None:
    migrated = migrate_source(TWO_MODELS, "torch").migrated
    native = exec_source(migrated, "two_models.py")["losses"]
    with as_apex_code(True):
        apex = exec_source(TWO_MODELS, "two_models.py")["losses"]
    torch.testing.assert_close(native, apex, rtol=1e-3, atol=1e-3)


def test_a_model_rebound_from_the_list_is_one_model_again() -> None:
    """Only the last binding before amp.initialize counts: a list wrapped into one module is a module."""
    source = TWO_MODELS.replace(
        "models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]\n",
        "models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]\nmodels = torch.nn.Sequential(*models)\n",
    ).replace("models[1](models[0](x))", "models(x)")
    migrated = migrate_source(source, "torch").migrated
    assert "amp_device = next(models.parameters()).device.type\n" in migrated
    assert len(exec_source(migrated, "one_model.py")["losses"]) == 4  # type: ignore[arg-type]
