"""Edge cases of the fused optimizers and amp_C ops: empty and frozen groups, norms of very large tensors,
host syncs, and the FusedAdagrad fallback where torch has no fused kernel."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit.multi_tensor as mt
from ampinit import _torch_kernels
from ampinit.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from ampinit.optimizers.fused_lamb import global_grad_norm
from ampinit.optimizers.fused_novograd import layer_norms

OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (FusedAdam, {"weight_decay": 0.01}),
    (FusedAdam, {"bias_correction": False}),
    (FusedAdam, {"capturable": True, "master_weights": True}),
    (FusedLAMB, {}),
    (FusedNovoGrad, {}),
    (FusedSGD, {"lr": 0.1, "momentum": 0.9}),
    (FusedAdagrad, {"weight_decay": 0.01}),
]
IDS = ["adam", "adam-no-bias-correction", "adam-capturable-master", "lamb", "novograd", "sgd", "adagrad"]


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(6, 4, generator=gen)).square().mean().backward()
        optimizer.step()


# ---- empty and frozen param groups (Apex and torch.optim skip them) ------------------------------------


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_empty_and_frozen_groups_change_nothing_and_do_not_disturb_live_ones(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    frozen, live, reference = model(0), model(1), model(1)
    for p in frozen.parameters():
        p.requires_grad_(False)
    before = [p.clone() for p in frozen.parameters()]
    groups: list[dict[str, Any]] = [
        {"params": []},
        {"params": list(frozen.parameters())},
        {"params": list(live.parameters())},
    ]
    train(live, cls(groups, **kwargs))
    train(reference, cls(reference.parameters(), **kwargs))
    for p, b in zip(frozen.parameters(), before):
        assert torch.equal(p, b)
    for p, q in zip(live.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_all_frozen_or_empty_optimizer_steps_like_torch_optim(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    net = model(0)
    for p in net.parameters():
        p.requires_grad_(False)
    before = [p.clone() for p in net.parameters()]
    groups: list[dict[str, Any]] = [{"params": []}, {"params": list(net.parameters())}]
    fused = cls(groups, **kwargs)
    plain = torch.optim.SGD([dict(g) for g in groups], lr=0.1)
    for optimizer in (fused, plain):
        optimizer.zero_grad()
        optimizer.step()
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert not any(fused.state[p] for p in net.parameters())


def test_amp_c_ops_accept_empty_lists() -> None:
    flag = torch.zeros(1, dtype=torch.int32)
    lr, step, scale = torch.full((), 0.1), torch.ones((), dtype=torch.int32), torch.ones(1)
    mt.multi_tensor_scale(0, flag, [[], []], 2.0)
    mt.multi_tensor_axpby(0, flag, [[], [], []], 1.0, 1.0, -1)
    mt.multi_tensor_adam(0, flag, [[], [], [], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    mt.multi_tensor_adam_capturable(0, flag, [[], [], [], []], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, scale)
    mt.multi_tensor_adam_capturable_master(0, flag, [[]] * 5, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, scale)
    mt.multi_tensor_sgd(0, flag, [[], [], []], 0.0, 0.9, 0.0, 0.1, False, True, False)
    mt.multi_tensor_adagrad(0, flag, [[], [], []], 0.1, 1e-10, 0, 0.0)
    mt.multi_tensor_novograd(0, flag, [[], [], []], torch.zeros(0), 1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2)
    norm = torch.zeros(1)
    mt.multi_tensor_lamb(0, flag, [[]] * 4, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, norm, 1.0)
    mt.multi_tensor_lamb_mp(
        0, flag, [[]] * 4, lr, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, torch.ones(1), False, norm, scale
    )
    for op in (mt.multi_tensor_l2norm, mt.multi_tensor_l2norm_mp):
        total, per = op(0, flag, [[]], True)
        assert torch.equal(total, torch.zeros(1)) and per.numel() == 0
    total, _ = mt.multi_tensor_l2norm_scale(0, flag, [[], []], 2.0)
    assert torch.equal(total, torch.zeros(1))
    total, _ = mt.multi_tensor_unscale_l2norm(0, flag, [[]], torch.ones(1))
    assert torch.equal(total, torch.zeros(1))
    assert flag.item() == 0


# ---- norms of large tensors: fp32 accumulation per chunk, as Apex ------------------------------------


def test_norms_of_a_30m_element_tensor_match_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(30_000_000, generator=gen).mul_(3).add_(1)  # a mean offset is what defeats naive sums
    small = torch.randn(1000, generator=gen)
    expected = torch.tensor([big.double().norm().item(), small.double().norm().item()], dtype=torch.float64)
    total_expected = expected.square().sum().sqrt()

    def close(actual: Tensor, wanted: Tensor) -> None:
        torch.testing.assert_close(actual.double().reshape(wanted.shape), wanted, rtol=1e-6, atol=0)

    flag = torch.zeros(1, dtype=torch.int32)
    total, per = mt.multi_tensor_l2norm(0, flag, [[big, small]], True)
    close(total, total_expected)
    close(per, expected)
    total, per = mt.multi_tensor_l2norm_mp(0, flag, [[big, small]], True)
    close(total, total_expected)
    close(global_grad_norm([big, small], big.device), total_expected)
    close(layer_norms([big, small], 2), expected)


# ---- host syncs ---------------------------------------------------------------------------------------

# On CPU a sync cannot be seen directly; what would be one on CUDA can: reading a value on the host
# (`_local_scalar_dense`, behind .item()/bool()/float()) and building a tensor from host data
# (`lift_fresh`, behind torch.tensor(x, device=...), a blocking host-to-device copy on CUDA).
SYNC_OPS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.lift_fresh_copy", "aten.item")


class CountSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sync_counter() -> Iterator[CountSyncs]:
    counter = CountSyncs()
    yield counter


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad-scaler-protocol"])
@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_optimizer_steps_make_no_host_syncs(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], scaled: bool, sync_counter: CountSyncs
) -> None:
    net = model(0).half() if cls is FusedAdam else model(0)
    optimizer = cls(net.parameters(), **kwargs)
    if scaled:
        optimizer.grad_scale = torch.full((), 4.0)  # type: ignore[attr-defined]
        optimizer.found_inf = torch.zeros(())  # type: ignore[attr-defined]
    for _ in range(2):  # the first step creates state and step counters; the second is the steady state
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        with sync_counter:
            optimizer.step()
    assert sync_counter.seen == Counter()


@pytest.mark.parametrize("reduced", [None, torch.bfloat16])
def test_fused_mixed_precision_lamb_steps_make_no_host_syncs(
    reduced: torch.dtype | None, sync_counter: CountSyncs
) -> None:
    net = model(0).to(reduced or torch.float32)
    optimizer = FusedMixedPrecisionLamb(net.parameters(), reduced_precision_dtype=reduced)
    optimizer.grad_scale = torch.full((), 4.0)  # type: ignore[attr-defined]
    optimizer.found_inf = torch.zeros(())  # type: ignore[attr-defined]
    for _ in range(2):
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        with sync_counter:
            optimizer.step()
    assert sync_counter.seen == Counter()


def test_amp_c_optimizer_ops_make_no_host_syncs(sync_counter: CountSyncs) -> None:
    def lists(n: int, dtype: torch.dtype = torch.float32) -> list[list[Tensor]]:
        return [[torch.rand(5, dtype=dtype) + 0.5, torch.rand(3, dtype=dtype) + 0.5] for _ in range(n)]

    flag = torch.zeros(1, dtype=torch.int32)
    norm = torch.ones(1)
    with sync_counter:
        mt.multi_tensor_adam(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-8, 3, 1, 1, 0.01)
        mt.multi_tensor_adam(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-8, 3, 0, 0, 0.01)
        mt.multi_tensor_lamb(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1, norm, 1.0)
        mt.multi_tensor_novograd(0, flag, lists(3), torch.ones(2), 1e-3, 0.9, 0.999, 1e-8, 3, 1, 0.0, 1, 1, 2)
        lr, step, scale = torch.full((), 1e-3), torch.full((), 3, dtype=torch.int32), torch.ones(1)
        mt.multi_tensor_adam_capturable(0, flag, lists(4), lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, scale)
        mt.multi_tensor_lamb_mp(
            0, flag, lists(4), lr, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, torch.ones(1), False, norm, scale
        )
    assert sync_counter.seen == Counter()


def test_sync_counter_sees_what_it_must(sync_counter: CountSyncs) -> None:
    """The counter is not blind: a torch.tensor() constant and an .item() are both seen."""
    with sync_counter:
        torch.tensor(1.0).add(1).item()
    assert sync_counter.seen == Counter({"aten.lift_fresh": 1, "aten._local_scalar_dense": 1})


# ---- FusedAdagrad without a fused kernel (CUDA before torch 2.9) ---------------------------------------


@pytest.mark.parametrize(
    ("device", "version", "expected"),
    [("cuda", "2.8.1+cu128", False), ("cuda", "2.9.0", True), ("cuda", "2.10.0a0+git", True), ("cpu", "2.5.0", True)],
)
def test_fused_adagrad_kernel_availability(device: str, version: str, expected: bool) -> None:
    assert _torch_kernels.has_fused_adagrad(torch.device(device), version) is expected
    assert _torch_kernels.has_fused_adagrad(torch.device("mps"), version) is False


def test_fused_adagrad_unknown_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'nightly'"):
        _torch_kernels.has_fused_adagrad(torch.device("cuda"), "nightly")


@pytest.mark.parametrize("adagrad_w_mode", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adagrad_falls_back_to_foreach_without_a_kernel(
    monkeypatch: pytest.MonkeyPatch, adagrad_w_mode: bool, dtype: torch.dtype
) -> None:
    """With the version check answering 'no kernel' (as on CUDA before 2.9), the step must not call
    torch._fused_adagrad_ and must match the plain per-tensor reference, including a skipped step."""
    reference, fallback = model(0).to(dtype), model(0).to(dtype)
    ref_opt = FusedAdagrad(
        reference.parameters(), weight_decay=0.1, adagrad_w_mode=adagrad_w_mode, implementation="single_tensor"
    )
    new_opt = FusedAdagrad(fallback.parameters(), weight_decay=0.1, adagrad_w_mode=adagrad_w_mode)

    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch._fused_adagrad_ called although the version check said it has no kernel")

    monkeypatch.setattr(_torch_kernels, "has_fused_adagrad", lambda device, version=None: False)
    monkeypatch.setattr(torch, "_fused_adagrad_", no_kernel)
    for found in (0.0, 1.0, 0.0):
        for opt in (ref_opt, new_opt):
            opt.grad_scale = torch.full((), 8.0)  # type: ignore[attr-defined]
            opt.found_inf = torch.full((), found)  # type: ignore[attr-defined]
        for net in (reference, fallback):
            torch.manual_seed(3)
            net.zero_grad()
            (net(torch.randn(6, 4, dtype=dtype)).float().square().mean() * 8).backward()
        ref_opt.step()
        new_opt.step()
        rtol, atol = (2e-6, 1e-7) if dtype == torch.float32 else (1e-2, 1e-2)
        for p, q in zip(fallback.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
            # Like torch's fused kernels, the fallback leaves the gradients unscaled unless the step is skipped.
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad if found else q.grad / 8, rtol=rtol, atol=atol)
            torch.testing.assert_close(new_opt.state[p]["sum"], ref_opt.state[q]["sum"], rtol=rtol, atol=atol)


def test_capturable_fused_adam_keeps_lr_on_the_device_and_follows_a_scheduler() -> None:
    plain_net, graph_net = model(0), model(0)
    plain = FusedAdam(plain_net.parameters(), lr=0.01)
    capturable = FusedAdam(graph_net.parameters(), lr=0.01, capturable=True)
    assert isinstance(capturable.param_groups[0]["lr"], Tensor)
    lr_tensor = capturable.param_groups[0]["lr"]
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, capturable)]
    for optimizer, net in ((plain, plain_net), (capturable, graph_net)):
        train(net, optimizer, steps=1)
    for _ in range(2):
        for schedule in schedules:
            schedule.step()
        for optimizer, net in ((plain, plain_net), (capturable, graph_net)):
            train(net, optimizer, steps=1)
    # The scheduler filled the same tensor (what a replayed graph reads) rather than replacing it.
    assert capturable.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.0025)
    for p, q in zip(graph_net.parameters(), plain_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---- FusedAdam(capturable=True) under a CUDA graph ----------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_capturable_fused_adam_replays_in_a_cuda_graph() -> None:
    torch.manual_seed(0)
    eager_net = nn.Linear(16, 16).cuda().half()
    graph_net = copy.deepcopy(eager_net)
    eager = FusedAdam(eager_net.parameters(), capturable=True, master_weights=True, weight_decay=0.01)
    graphed = FusedAdam(graph_net.parameters(), capturable=True, master_weights=True, weight_decay=0.01)
    grads = [[torch.randn_like(p) for p in eager_net.parameters()] for _ in range(6)]
    static = [torch.zeros_like(p) for p in graph_net.parameters()]
    for p, g in zip(graph_net.parameters(), static):
        p.grad = g
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up creates the state outside the graph
        for g, new in zip(static, grads[0]):
            g.copy_(new)
        graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for p, g in zip(eager_net.parameters(), grads[0]):
        p.grad = g.clone()
    eager.step()
    for step_grads in grads[1:]:
        for g, new in zip(static, step_grads):
            g.copy_(new)
        graph.replay()
        for p, g in zip(eager_net.parameters(), step_grads):
            p.grad = g.clone()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(graph_net.parameters(), eager_net.parameters()):
        assert torch.equal(p, q)
