"""Host syncs per training step (issue 24): none with ``sync_free=True``, at most one (the overflow read that
decides the step on the host) otherwise: a dynamic fp16 loss scale, and O4/O5's default skip of non-finite steps.
Counted with ``tests._device.HostSyncCounter``: on CPU it sees the scalar reads; on CUDA (``pytest --device cuda``)
also the copies that make the host wait for the GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._types import OptLevel
from tests._device import HostSyncCounter, on_device
from tests.conftest import make_problem


def test_the_counter_sees_every_kind_of_host_wait() -> None:
    x = torch.ones(3)
    on_meta = torch.empty(3, device="meta")  # stands in for a GPU: any device that is not the host
    with HostSyncCounter() as counter:
        x.sum().item()
        x.to("meta")
        on_meta.copy_(x)
        x.to("meta", non_blocking=True)  # no wait: not counted
        on_meta.copy_(x, non_blocking=True)
        x.to("cpu")  # host to host: not counted
    assert counter.syncs == [
        "aten._local_scalar_dense",
        "aten._to_copy host->device, blocking",
        "aten.copy_ host->device, blocking",
    ]


def syncs_per_step(level: OptLevel, steps: int = 3, **options: Any) -> list[list[str]]:
    """The host syncs of each step after the first (which sets up state) of a small model at ``level``."""
    model, x, y = on_device(make_problem())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    counts = []
    try:
        for step in range(steps + 1):
            with HostSyncCounter() as counter:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x).float(), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
            if step > 0:
                counts.append(counter.syncs)
    finally:
        amp.deinitialize()
    return counts


@pytest.mark.parametrize(
    ("level", "options"),
    [(level, {"sync_free": True}) for level in ("O1", "O2", "O4", "O5")],
)
def test_sync_free_steps_make_no_host_sync(level: OptLevel, options: dict[str, Any]) -> None:
    assert syncs_per_step(level, **options) == [[], [], []]


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_step_decided_on_the_host_reads_it_at_most_once(level: OptLevel) -> None:
    for syncs in syncs_per_step(level):
        assert len(syncs) <= 1, syncs
