"""The amp step on fused optimizers: sync-free skipping, its equivalence with the default mode, a constant number
of dispatched ops whatever the number of parameters, and no host sync in a sync-free step."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampinit import amp
from ampinit.optimizers import FusedAdam, FusedSGD
from tests._device import HostSyncCounter, on_device
from tests.conftest import make_problem


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "torch AdamW fused": lambda p: torch.optim.AdamW(p, 1e-2, fused=True),
    "torch SGD fused momentum": lambda p: torch.optim.SGD(p, 0.05, momentum=0.9, dampening=0.1, fused=True),
    "ampinit FusedAdam": lambda p: FusedAdam(p, 1e-2),
    "ampinit FusedSGD": lambda p: FusedSGD(p, 0.05, momentum=0.9),
    "torch SGD (no device skip)": lambda p: torch.optim.SGD(p, 0.05, momentum=0.9),
}


def train(level: str, make_opt: Callable[[Any], torch.optim.Optimizer], sync_free: bool, inject: set[int]) -> Any:
    model, x, y = make_problem(seed=7)
    opt = make_opt(model.parameters())
    amp.initialize(model, opt, opt_level=level, verbosity=0, sync_free=sync_free)
    for i in range(6):
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if i in inject:
                model.fc2.weight.grad[1, 1] = float("inf")
        opt.step()
    result = (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(opt.state_dict()["state"]),
        amp.stats(),
    )
    amp.deinitialize()
    return result


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_sync_free_equals_default_mode(level: str, name: str) -> None:
    # Overflows at the very first step (the fused-SGD empty_like trap) and in the middle.
    inject = {0, 3}
    params, state, stats = train(level, OPTIMIZERS[name], sync_free=True, inject=inject)
    ref_params, ref_state, ref_stats = train(level, OPTIMIZERS[name], sync_free=False, inject=inject)
    assert stats == ref_stats
    # Exactly the injected overflows are skipped: the dynamic scale (2**16 to start) halves at each, O5's static
    # scale stays 1, and the clean steps after the last one are counted.
    expected_scale = 1.0 if level == "O5" else 2.0**16 / 2 ** len(inject)
    assert stats == amp.AmpStats(
        steps=6,
        skipped_steps=len(inject),
        last_step_skipped=False,
        loss_scales=(expected_scale,),
        unskipped=(5 - max(inject),),
    )
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    for key in ref_state:
        for field, value in ref_state[key].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(state[key][field], value), (key, field)


def count_step_ops(n_tensors: int, level: str, sync_free: bool) -> tuple[Counter[str], Counter[str]]:
    """Ops dispatched by the amp machinery (scale_loss exit + step) and by a plain fused step, separately."""
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(n_tensors)])
    opt = torch.optim.AdamW(model.parameters(), 1e-3, fused=True)
    amp.initialize(model, opt, opt_level=level, verbosity=0, sync_free=sync_free)
    x = torch.randn(2, 4)
    for _ in range(2):  # the first step allocates optimizer state and master-grad buffers
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    opt.zero_grad()
    block = amp.scale_loss(model(x).float().sum(), opt)
    block.__enter__().backward()
    with OpCounter() as counter:
        block.__exit__(None, None, None)
        opt.step()
    amp.deinitialize()
    plain = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(n_tensors)])
    plain_opt = torch.optim.AdamW(plain.parameters(), 1e-3, fused=True)
    plain(x).sum().backward()
    plain_opt.step()
    with OpCounter() as plain_counter:
        plain_opt.step()
    return counter.ops, plain_counter.ops


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_amp_step_op_count_does_not_grow_with_tensors(level: str, sync_free: bool) -> None:
    few, few_plain = count_step_ops(10, level, sync_free)
    many, many_plain = count_step_ops(200, level, sync_free)  # benchmarks/master_step.py counts 1000
    assert few_plain == many_plain  # torch's own fused step is constant too: the comparison is fair
    assert sum(many.values()) == sum(few.values()), (few, many)
    # The host reads the overflow flag only to decide a dynamic scale's skip (O1/O2) without sync_free; O5's static
    # scale of 1 is decided on the device.
    assert ("aten._local_scalar_dense" in few) is (level != "O5" and not sync_free)


def test_sync_free_master_step_copies_masters_after_device_skip() -> None:
    model, x, y = make_problem()
    opt = torch.optim.AdamW(model.parameters(), 1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, sync_free=True)
    with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss((model(x).float() - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("nan")
    opt.step()
    assert amp.step_was_skipped(opt)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
    amp.deinitialize()


def test_sync_free_refuses_raise_at_min() -> None:
    import ampinit

    config = ampinit.DynamicLossScale(min_scale=1.0, raise_at_min=True)
    with pytest.raises(ValueError, match="cannot be sync_free"):
        amp.initialize(nn.Linear(2, 2), opt_level="O2", loss_scale=config, sync_free=True)


def test_sync_free_step_makes_no_host_sync(device: torch.device) -> None:
    """A sync-free O2 step (fused AdamW) makes no host sync.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    model, x, y = make_problem()
    model, x, y = on_device((model, x, y))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, sync_free=True)
    try:
        for step in range(3):
            # On CPU the CPU stands for the device too: host numbers put on it are counted (on CUDA, blocking
            # copies; the scaler's tensors were made by torch.tensor(value, device=...) at the first step).
            with HostSyncCounter(cpu_as_device=device.type == "cpu") as counter:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x).float(), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
            assert counter.syncs == [], f"step {step}: {counter.syncs}"
    finally:
        amp.deinitialize()
