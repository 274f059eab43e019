"""Edges of ``ampinit migrate`` (issue 22, point 10): what a migration keeps or rewrites around the amp loop."""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

SCALES = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        scales = []
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            scales.append(amp._amp_state.loss_scalers[0].loss_scale())
        return scales
    """
)


def _scales(source: str, aliases: bool) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(5)]
    data[2] = (data[2][0] * 1e5, data[2][1])  # an fp16 overflow: the scale halves, the step is skipped
    with warnings.catch_warnings(), as_apex_code(aliases):
        warnings.simplefilter("ignore")
        return exec_source(source, "scales.py")["train"](model, optimizer, data)  # type: ignore[operator]


def test_logging_apex_loss_scale_becomes_grad_scaler_get_scale() -> None:
    """`amp._amp_state.loss_scalers[0].loss_scale()` is GradScaler's `get_scale()`: `--to torch` refused the file
    for it. The migrated loop logs the scales the original logs under `ampinit run`, an overflow's halving
    included."""
    result = migrate_source(SCALES, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "scales.append(scaler.get_scale())" in result.migrated and "_amp_state" not in result.migrated
    want = _scales(SCALES, aliases=True)
    assert want == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    assert _scales(result.migrated, aliases=False) == want


def test_a_loss_scale_read_before_the_step_is_refused() -> None:
    """Between the scale_loss block and the step Apex has already updated its scale, GradScaler has not."""
    early = SCALES.replace(
        "        optimizer.step()\n        scales.append(amp._amp_state.loss_scalers[0].loss_scale())\n",
        "        scales.append(amp._amp_state.loss_scalers[0].loss_scale())\n        optimizer.step()\n",
    )
    assert early != SCALES
    result = migrate_source(early, "torch")
    assert result.refused and not result.changed
    assert any("read between the scale_loss block and optimizer.step()" in s.message for s in result.needs_human)
    other = migrate_source(SCALES.replace("loss_scalers[0].loss_scale()", "loss_scalers[0]._unskipped"), "torch")
    assert other.refused
    assert any("only amp._amp_state.loss_scalers[0].loss_scale() has" in s.message for s in other.needs_human)


GUARDED = textwrap.dedent(
    """
    import torch
    try:
        from apex import amp
        from apex.parallel import DistributedDataParallel as DDP
    except ImportError:
        raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example.")


    def train(model, optimizer, data):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        model = DDP(model)
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """
)


def test_a_guard_that_only_asks_to_install_apex_is_dropped_by_both_migrations() -> None:
    """After the migration the file imports ampinit or torch, never Apex: a guard whose handler only raises
    "Please install apex" would send users after a package the file no longer needs. `--to ampinit` kept it."""
    for to in ("ampinit", "torch"):
        result = migrate_source(GUARDED, to)  # type: ignore[arg-type]
        assert not result.refused and "Please install apex" not in result.migrated, result.migrated
        assert "try:" not in result.migrated
        assert any(s.line == 3 and "only raised: the guard is dropped" in s.message for s in result.sites)
    ampinit_result = migrate_source(GUARDED, "ampinit")
    assert "from ampinit import amp" in ampinit_result.migrated
    assert [s.line for s in ampinit_result.sites][:3] == [3, 4, 5]  # lines of the original file


def test_a_guard_is_kept_where_the_migrated_file_still_needs_apex() -> None:
    """`apex.contrib` has no ampinit counterpart: the import still needs Apex, and its guard stays true."""
    source = GUARDED.replace(
        "from apex.parallel import DistributedDataParallel as DDP", "from apex.contrib import xentropy as DDP"
    )
    result = migrate_source(source, "ampinit")
    assert "Please install apex" in result.migrated and "from apex.contrib import xentropy" in result.migrated
