"""torch's optimizer step hooks run around every O5 step, also the steps amp takes without calling the optimizer's
own ``step`` (``master_weights="remainder"``, ``"remainder8"``, ``"stochastic"``, compressed moments): torch runs
them inside ``Optimizer.step``, which those steps never call, so they were skipped silently."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._masters import kernel_step

SETTINGS = [
    {},
    {"master_weights": "remainder"},
    {"master_weights": "remainder8"},
    {"master_weights": "stochastic"},
    {"optimizer_state": "bf16"},
]


def _train(
    options: dict[str, Any], edit: bool, steps: int = 3
) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **options)
    session = amp.current_session()
    assert session is not None
    start = [p.detach().clone() for p in model.parameters()]
    calls: list[str] = []

    def pre(o: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert o is opt and args == (opt,) and kwargs == {}
        calls.append("pre")
        if edit:  # a pre-hook that drops every grad: the step then moves nothing
            for group in o.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.zero_()

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        for step in range(steps):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        return calls, start, [p.detach().clone() for p in model.parameters()]
    finally:
        session.close()


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: str(o) or "fp32-masters")
def test_step_hooks_run_once_per_step_at_every_master_setting(options: dict[str, Any]) -> None:
    calls, _, _ = _train(options, edit=False)
    assert calls == ["pre", "post"] * 3


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: str(o) or "fp32-masters")
def test_a_pre_hooks_grad_edit_is_what_the_step_reads(options: dict[str, Any]) -> None:
    _, start, weights = _train(options, edit=True)
    for got, before in zip(weights, start):
        assert torch.equal(got, before)


@pytest.mark.parametrize("options", SETTINGS[1:3], ids=str)
def test_step_hooks_run_around_the_kernel_step(
    kernels_on_cpu: ModuleType, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kernel_step.TRITON_ON_CPU
    calls, _, _ = _train(options, edit=False, steps=1)
    assert calls == ["pre", "post"]


def _clip_then_accumulate(options: dict[str, Any], clip: str) -> list[torch.Tensor]:
    """Two micro-batches, the first clipped to a tiny norm before the second, then one SGD step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **options)
    session = amp.current_session()
    assert session is not None
    try:
        for k in range(2):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(k)).bfloat16()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            if k == 0:
                if clip == "fold":
                    amp.clip_grad_norm_(opt, 1e-6)
                else:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-6)
        opt.step()
        return [p.detach().float().clone() for p in model.parameters()]
    finally:
        session.close()


@pytest.mark.parametrize("clip", ["fold", "apex-pattern"])
@pytest.mark.parametrize("setting", ["remainder", "remainder8"])
def test_a_clip_before_another_micro_batch_is_kept_with_masters_in_the_weights(setting: str, clip: str) -> None:
    """fp32 masters keep the first micro-batch clipped (the clip wrote the master grads the next backward adds to, as
    in Apex); masters kept in the bf16 weights forgot the clip at the next ``scale_loss`` and stepped unclipped."""
    reference = _clip_then_accumulate({}, clip)
    got = _clip_then_accumulate({"master_weights": setting}, clip)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=2**-7)  # a bf16 ulp of weights below 1: not the clip
