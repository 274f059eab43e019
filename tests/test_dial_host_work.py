"""The host work of the precision dial's kernel step, pinned without a clock: the aten ops one ``optimizer.step()``
runs through ``triton_dial`` do not grow with the number of parameter tensors (on a GPU each is a kernel launch or
a dispatch the device waits on: the dial's step was host-bound on the H100, issue 24).

As tests/test_kernel_step_host_work.py does for the fp32-master step: the path is taken for CPU tensors
(``kernels_on_cpu``) with every Triton launch a no-op, and the ops are counted by torch's profiler, which also sees
the ops an op runs inside itself (a foreach op over 0-d tensors, ``stack``'s ``unsqueeze`` per tensor)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from tests._host_work import NoLaunch, aten_ops, third_step

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")

MASTERS: list[Any] = [True, "remainder", "remainder8", "stochastic"]
STATES = ["fp32", "bf16", "8bit"]
#: The dial's settings (fp32 masters with fp32 moments is plain O5, pinned by test_kernel_step_host_work.py).
SETTINGS = [(m, s) for m in MASTERS for s in STATES if (m, s) != (True, "fp32")]
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


@pytest.fixture
def no_launches(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> NoLaunch:
    """Every master-step kernel (fp32-master and dial) replaced by one counting stand-in."""
    from ampinit._masters import triton_dial

    stand_in = NoLaunch()
    for name in ("_adam_kernel", "_sgd_kernel"):
        monkeypatch.setattr(kernels_on_cpu, name, stand_in)
    monkeypatch.setattr(kernels_on_cpu, "_step_scalars_kernel", NoLaunch())  # the scalars' launch, not the step's
    for name in ("_adam_dial_kernel", "_sgd_dial_kernel"):
        monkeypatch.setattr(triton_dial, name, stand_in)
    return stand_in


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(("masters", "state"), SETTINGS)
def test_the_dial_step_runs_the_same_aten_ops_for_any_number_of_tensors(
    masters: Any, state: str, name: str, no_launches: NoLaunch
) -> None:
    few = third_step("O5", 8, aten_ops, OPTIMIZERS[name], master_weights=masters, optimizer_state=state)
    launches = no_launches.launches
    many = third_step("O5", 32, aten_ops, OPTIMIZERS[name], master_weights=masters, optimizer_state=state)
    # Three steps each, all through the kernels: a chunked step (per-tensor torch ops by design) is not measured.
    assert launches == 3 and no_launches.launches == 6
    assert few == many
