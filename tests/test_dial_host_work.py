"""The host work of the precision dial's kernel step, pinned without a clock: the aten ops one ``optimizer.step()``
runs through ``triton_dial`` do not grow with the number of parameter tensors (on a GPU each is a kernel launch or
a dispatch the device waits on: the dial's step was host-bound on the H100, issue 24).

As tests/test_kernel_step_host_work.py does for the fp32-master step: the path is taken for CPU tensors
(``kernels_on_cpu``) with every Triton launch a no-op, and the ops are counted by torch's profiler, which also sees
the ops an op runs inside itself (a foreach op over 0-d tensors, ``stack``'s ``unsqueeze`` per tensor)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ampinit import amp

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


class _NoLaunch:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](...)`` is accepted, counted and does nothing."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1

        return launch


@pytest.fixture
def no_launches(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> _NoLaunch:
    """Every master-step kernel (fp32-master and dial) replaced by one counting stand-in."""
    from ampinit._masters import triton_dial

    stand_in = _NoLaunch()
    for name in ("_adam_kernel", "_sgd_kernel"):
        monkeypatch.setattr(kernels_on_cpu, name, stand_in)
    for name in ("_adam_dial_kernel", "_sgd_dial_kernel"):
        monkeypatch.setattr(triton_dial, name, stand_in)
    return stand_in


def _aten_ops(step: Callable[[], None]) -> Counter[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


def dial_step_ops(
    masters: Any, state: str, make_opt: Callable[[Any], torch.optim.Optimizer], tensors: int
) -> Counter[str]:
    """The aten ops of the third ``optimizer.step()`` of an O5 session with the dial over ``tensors`` parameters."""
    gen = torch.Generator().manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(tensors)])
    opt = make_opt(params.parameters())
    amp.initialize(params, opt, opt_level="O5", verbosity=0, master_weights=masters, optimizer_state=state)  # type: ignore[arg-type]
    session = amp.current_session()
    assert session is not None
    anchor = torch.zeros((), requires_grad=True)
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for p in params:
                    p.grad = torch.full_like(p, 0.01)
            if step < 2:
                opt.step()
        ops = _aten_ops(opt.step)
    finally:
        session.close()
    return ops


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(("masters", "state"), SETTINGS)
def test_the_dial_step_runs_the_same_aten_ops_for_any_number_of_tensors(
    masters: Any, state: str, name: str, no_launches: _NoLaunch
) -> None:
    few = dial_step_ops(masters, state, OPTIMIZERS[name], 8)
    launches = no_launches.launches
    many = dial_step_ops(masters, state, OPTIMIZERS[name], 32)
    # Three steps each, all through the kernels: a chunked step (per-tensor torch ops by design) is not measured.
    assert launches == 3 and no_launches.launches == 6
    assert few == many
