"""amp's kernel step standing in for an optimizer that cannot take a device overflow flag, at levels without
master weights (O0/O1/O3/O4).

A static loss scale (O0/O3/O4's 1.0, or a number) and ``sync_free=True`` decide the skip on the device. torch's
fused optimizers take the flag into their kernel; its foreach and for-loop Adam/AdamW/SGD (``torch.optim.AdamW(params)``
is foreach on CUDA) cannot, so the flag used to be read on the host at every step. On CUDA amp's Triton kernels
now run such a step on the fp32 parameters with the flag (``OptimizerGrads.step_in_amp_kernels``): no host sync
(``tests/test_host_syncs.py``), torch's fused-kernel arithmetic, and a skipped step that changes nothing. Here the
kernels run on CPU through Triton's interpreter, against the same training through torch's own step.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit import amp
from ampinit._types import OptLevel
from tests._amp_loop import overflowing_iteration
from tests._kernels_vs_reference import count_launches
from tests.conftest import SmallNet, make_problem

STEPS = 6
OVERFLOWING_STEP = 3

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, foreach=False),
    "SGD-nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
LEVELS: list[tuple[OptLevel, dict[str, Any]]] = [("O4", {}), ("O0", {}), ("O1", {"sync_free": True})]


def train(
    level: OptLevel, options: dict[str, Any], make_opt: Callable[[Any], torch.optim.Optimizer]
) -> tuple[SmallNet, torch.optim.Optimizer, list[bool], list[list[torch.Tensor]]]:
    """``STEPS`` steps at ``level``, step ``OVERFLOWING_STEP`` overflowing: the model, the optimizer, each step's
    fate and the parameters after each step."""
    model, x, y = make_problem(seed=3)
    # fc1's bias feeds BatchNorm, so its gradient is zero up to rounding noise, which Adam scales into full-size
    # steps: there two correct implementations part ways after one step. Frozen, it is out of the comparison.
    model.fc1.bias.requires_grad_(False)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    skipped, after = [], []
    try:
        for step in range(STEPS):
            overflowing_iteration(model, opt, x, y, overflow=step == OVERFLOWING_STEP)
            skipped.append(amp.step_was_skipped(opt))
            after.append([p.detach().clone() for p in model.parameters()])
    finally:
        amp.deinitialize()
    return model, opt, skipped, after


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("level", "options"), LEVELS, ids=[f"{lv}-{o}" for lv, o in LEVELS])
def test_the_kernels_train_as_the_optimizers_own_step(
    level: OptLevel,
    options: dict[str, Any],
    optimizer: str,
    kernels_on_cpu: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same training, the kernels standing in against torch's own step (the flag then read on the host): the
    same steps skipped, the parameters within the last bits of the arithmetic, and the optimizer state in torch's
    layout with the same values (a checkpoint moves between the two)."""
    calls = count_launches(kernels_on_cpu, monkeypatch)
    _, opt, skipped, after = train(level, options, OPTIMIZERS[optimizer])
    assert sum(calls.values()) > 0, "the kernels never took a step"
    monkeypatch.setattr("ampinit._masters.kernel_step.TRITON_ON_CPU", False)
    _, ref_opt, ref_skipped, ref_after = train(level, options, OPTIMIZERS[optimizer])

    assert skipped == ref_skipped == [step == OVERFLOWING_STEP for step in range(STEPS)]
    # The two step paths differ in the last fp32 bits (docs/opt-levels.md); O1's fp16 activations round those
    # differences up to 2e-6 within six steps. A wrong update term would move a parameter by a share of the
    # learning rate, 1e-2: three orders of magnitude above the tolerance.
    for ours, theirs in zip(after, ref_after):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for index, entry in state.items():
        assert entry.keys() == ref_state[index].keys()
        for key, value in entry.items():
            # Moments follow the gradients, which O1's rounding moves by up to 1e-4 of their size; a wrong beta
            # or decay would move them by a tenth.
            torch.testing.assert_close(value.cpu(), ref_state[index][key].cpu(), rtol=1e-3, atol=1e-5)
    if "step" in state[0]:
        assert float(state[0]["step"]) == STEPS - 1  # the skipped step is not counted


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_skipped_step_changes_nothing(optimizer: str, kernels_on_cpu: ModuleType) -> None:
    """The overflowing step, decided on the device, leaves the parameters bit for bit as they were."""
    _, _, skipped, after = train("O4", {}, OPTIMIZERS[optimizer])
    assert skipped[OVERFLOWING_STEP]
    for before, same in zip(after[OVERFLOWING_STEP - 1], after[OVERFLOWING_STEP]):
        assert torch.equal(before, same)


@pytest.mark.parametrize(
    ("level", "options", "fused"),
    [("O4", {}, True), ("O1", {}, False), ("O1", {"sync_free": True}, True)],
    ids=["O4-fused", "O1-dynamic-default", "O1-sync_free-fused"],
)
def test_the_optimizers_own_step_runs_where_it_needs_no_stand_in(
    level: OptLevel, options: dict[str, Any], fused: bool, kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused optimizer takes the flag into its own kernel, and a skip decided on the host (a dynamic scale)
    needs no flag: in both the user's optimizer runs as written, and amp's kernels are never called."""
    calls = count_launches(kernels_on_cpu, monkeypatch)
    _, _, skipped, _ = train(
        level, options, lambda params: torch.optim.AdamW(params, lr=1e-2, **({"fused": True} if fused else {}))
    )
    assert skipped[OVERFLOWING_STEP]
    assert calls == {"adam_": 0, "sgd_": 0}
