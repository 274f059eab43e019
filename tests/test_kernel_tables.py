"""The master-step kernels' pointer and block tables: built once for a set of tensors and reused step after step,
built again when any tensor the step touches is reallocated (a checkpoint load gives the optimizer new state
tensors), so a cached table never points at memory the step no longer owns."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def one_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x.to(torch.float16)).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.fixture
def builds(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every table the kernels build from now on (the cache starts empty)."""
    built: list[Any] = []
    build = kernels_on_cpu._build_tables
    monkeypatch.setattr(kernels_on_cpu, "_tables_by_storage", {})
    monkeypatch.setattr(kernels_on_cpu, "_build_tables", lambda *a: built.append(a) or build(*a))
    return built


def test_tables_are_reused_while_the_tensors_stay(builds: list[Any]) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
    try:
        one_step(model, opt, 0)
        assert len(builds) == 1  # one launch: one list of fp16 weights
        for seed in (1, 2):
            one_step(model, opt, seed)
        assert len(builds) == 1
    finally:
        amp.deinitialize()


def test_a_checkpoint_load_rebuilds_the_tables(builds: list[Any]) -> None:
    def train(reload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0)
        try:
            one_step(model, opt, 0)
            if reload:
                # A checkpoint read back holds new tensors; the old ones stay alive here (held by `saved`), so a
                # stale table would update them and leave the optimizer's own state behind, silently.
                saved = opt.state_dict()
                opt.load_state_dict(copy.deepcopy(saved))
            for seed in (1, 2):
                one_step(model, opt, seed)
            moments = [s["exp_avg"].clone() for s in opt.state.values()]
            return [p.detach().clone() for p in model.parameters()], moments
        finally:
            amp.deinitialize()

    weights, moments = train(reload=True)
    assert len(builds) == 2  # before the load, and after it
    ref_weights, ref_moments = train(reload=False)
    for got, want in zip([*weights, *moments], [*ref_weights, *ref_moments]):
        assert torch.equal(got, want)
