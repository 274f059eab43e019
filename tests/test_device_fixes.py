"""Breakages a GPU (or an older torch) would expose, each shown where a CPU can show it: torch 2.4's hook and
DTensor spellings, a model moved after initialize(), host syncs, amp.init()'s devices, RNN teardown and the
torchrun example's device mapping."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampinit import _distributed, amp
from ampinit.compat.apex.amp import amp as apex_amp_module
from ampinit.compat.apex.fp16_utils import DynamicLossScaler
from tests._device import HostSyncCounter, on_device
from tests.conftest import make_problem

ROOT = Path(__file__).resolve().parent.parent


def test_master_weights_load_without_the_public_pre_hook_api(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch < 2.5 has only Module._register_load_state_dict_pre_hook.
    monkeypatch.delattr(nn.Module, "register_load_state_dict_pre_hook", raising=False)
    model, _, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = {k: v + 1e-4 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    try:
        model.load_state_dict(checkpoint)
        masters = dict(zip((n for n, _ in model.named_parameters()), amp.master_params(opt)))
        for name, master in masters.items():
            assert torch.equal(master, checkpoint[name])  # the fp32 value, not the fp16 rounding of it
    finally:
        amp.deinitialize()


@pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")
def test_dtensor_is_found_under_either_spelling() -> None:
    from torch.distributed._tensor import DTensor  # the one spelling torch 2.4 to 2.14 all have

    # Looked up lazily (importing it eagerly costs `import ampinit` half a second): once any code has imported
    # DTensor, the FSDP2 refusal sees it.
    assert _distributed._dtensor_type() is DTensor


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_model_moved_after_initialize_is_refused(level: str) -> None:
    model, x, _ = make_problem()
    model = on_device(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        model.to("meta")  # stands in for cuda -> cpu or cpu -> cuda: the weights leave their device
        with pytest.raises(RuntimeError, match=r"moved from \w+(:\d+)? to meta after amp.initialize\(\)"):
            model(on_device(x))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_moving_a_model_without_masters_or_cast_policy_is_allowed(level: str) -> None:
    model, x, _ = make_problem()
    amp.initialize(model, opt_level=level, verbosity=0)
    try:
        model.to("meta")
        assert model(x.to("meta")).device.type == "meta"  # no masters, no cast policy: nothing stays behind
    finally:
        amp.deinitialize()


def make_grads(n: int, bad: float | None) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(5, dtype=torch.float16)) for _ in range(n)]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    if bad is not None:
        assert params[-1].grad is not None
        params[-1].grad[2] = bad
    return params


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan"), 65504.0])
def test_fp16_utils_overflow_check_reads_the_host_once(bad: float | None) -> None:
    params = make_grads(20, bad)
    expected = any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)
    with HostSyncCounter() as counter:
        found = DynamicLossScaler().has_overflow(params)
    assert found == expected
    assert len(counter.syncs) == 1, counter.syncs  # Apex's loop: one per grad tensor (20)


def test_sync_free_step_makes_no_host_sync(device: torch.device) -> None:
    model, x, y = make_problem()
    model, x, y = on_device((model, x, y))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, sync_free=True)
    try:
        for step in range(3):
            with HostSyncCounter() as counter:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x).float(), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
            assert counter.syncs == [], f"step {step}: {counter.syncs}"
    finally:
        amp.deinitialize()


def test_amp_init_casts_cuda_only_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apex_amp_module.cast_devices() == ["cuda"]  # Apex never cast CPU tensors
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert apex_amp_module.cast_devices() == ["cpu"]


def test_rnn_weights_are_regrouped_after_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = nn.RNNBase.flatten_parameters

    def spy(self: nn.RNNBase) -> None:
        calls.append(type(self).__name__)
        original(self)

    model = nn.LSTM(4, 8)
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", spy)
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert calls == ["LSTM"]
    amp.deinitialize()
    # cuDNN needs its flat weight buffer rebuilt after the weights got fp32 storage back.
    assert calls == ["LSTM", "LSTM"]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "distributed" / "train_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("gpus", "local_rank", "ranks", "expected"),
    [(1, 1, 2, ("cuda:0", "gloo")), (2, 1, 2, ("cuda:1", "nccl")), (1, 0, 1, ("cuda:0", "nccl"))],
)
def test_ddp_example_maps_ranks_onto_the_gpus_there_are(
    monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, ranks: int, expected: tuple[str, str]
) -> None:
    example = load_example()
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    device, backend = example.pick_device()
    assert (str(device), backend) == expected
    assert chosen == [device]
    sys.modules.pop("train_ddp", None)
