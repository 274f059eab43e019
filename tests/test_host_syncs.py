"""Host syncs per training step (issue 24): none at O4/O5 with their default options (a static scale of 1: the
skip is decided on the device) and none with ``sync_free=True``; at most one (the overflow read that decides the
step on the host) with a dynamic fp16 loss scale. Counted with ``tests._device.HostSyncCounter``: on CPU it sees
the scalar reads, and under ``pretend_gpu`` with ``cpu_as_device=True`` also host data put on the device, while
the step takes the CUDA path (amp's Triton master kernels, through the interpreter); on CUDA (``pytest --device
cuda``) also the copies that make the host wait for the GPU, and ``torch.cuda.set_sync_debug_mode("error")``
proves the zero."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._types import OptLevel
from tests import _triton
from tests._amp_loop import overflowing_iteration, plant_inf_in_fc1
from tests._device import HostSyncCounter, on_device, requires_cuda
from tests.conftest import SmallNet, make_problem

OVERFLOWING_STEP = 2  # of STEPS: one step of every run plants an inf in a gradient
STEPS = 4


def test_the_counter_sees_every_kind_of_host_wait() -> None:
    x = torch.ones(3)
    on_meta = torch.empty(3, device="meta")  # stands in for a GPU: any device that is not the host
    with HostSyncCounter() as counter:
        x.sum().item()
        bool(x.sum())
        x.tolist()
        x.nonzero()
        x.to("meta")
        on_meta.copy_(x)
        torch.tensor([1.0, 2.0], device="meta")
        torch.as_tensor([1.0], device="meta")
        x.to("meta", non_blocking=True)  # no wait: not counted
        on_meta.copy_(x, non_blocking=True)
        x.to("cpu")  # host to host: not counted
        torch.tensor(1.0)  # a host tensor: not counted
        torch.as_tensor(x, device="meta")  # no host data: the copy is counted by the dispatcher
    assert counter.syncs == [
        "aten._local_scalar_dense",
        "aten._local_scalar_dense",
        "Tensor.tolist",
        "aten.nonzero",
        "aten._to_copy host->device, blocking",
        "aten.copy_ host->device, blocking",
        "torch.tensor(..., device=) host->device, blocking",
        "torch.as_tensor(..., device=) host->device, blocking",
        "aten._to_copy host->device, blocking",
    ]


def test_the_counter_takes_the_cpu_for_a_device_when_told() -> None:
    """Under ``pretend_gpu`` the CPU stands for the GPU: host data put on "the device" is seen."""
    param = torch.zeros(2)
    with HostSyncCounter(cpu_as_device=True) as counter:
        host = torch.tensor([1.0, 2.0])
        host.to(param.device)
        host.to(device=param.device)
        host.to(param)
        param.copy_(host)
        host.to(param.device, non_blocking=True)  # no wait: not counted
        param.copy_(host, non_blocking=True)
        host.to(torch.float64)  # no device named: not counted
        param.to(param.device)  # not host data: not counted
        torch.tensor(3.0, device=param.device)
    assert counter.syncs == [
        "Tensor.to host->device, blocking",
        "Tensor.to host->device, blocking",
        "Tensor.to host->device, blocking",
        "Tensor.copy_ host->device, blocking",
        "torch.tensor(..., device=) host->device, blocking",
    ]
    with HostSyncCounter() as counter:
        torch.tensor([1.0]).to(param.device)
        torch.tensor(3.0, device=param.device)
    assert counter.syncs == []


@pytest.fixture
def cuda_path(pretend_gpu: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """On CPU, the step's CUDA path (a GPU machine as code sees it, amp's Triton kernels interpreted), counted
    with the CPU taken for the device; on CUDA, the real one. Whether the CPU stands for the device.

    The interpreted kernels are built for this test alone (conftest's ``kernels_on_cpu`` rests on a module-scoped
    fixture, which a function-scoped fixture asking for it would leave standing past this test's leak check)."""
    on_cpu = on_device(torch.zeros(())).device.type == "cpu"
    if not on_cpu:
        yield False
        return
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels need it")
    from ampinit import _overflow
    from ampinit._masters import kernel_step

    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", True)
    monkeypatch.setattr(_overflow, "DEVICE_DECIDES_ON_CPU", True)  # a dynamic scale's default, as on a GPU
    with _triton.interpreted_kernels():
        yield True


def syncs_per_step(
    level: OptLevel, cpu_as_device: bool, steps: int = STEPS, fused: bool = True, **options: Any
) -> list[list[str]]:
    """The host syncs of each step after the first (which sets up state) of a small model at ``level``, with
    fused AdamW (or torch's default, ``fused=False``); step ``OVERFLOWING_STEP`` overflows, and is checked to have
    been skipped."""
    model: SmallNet
    model, x, y = on_device(make_problem())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused else torch.optim.AdamW(model.parameters())
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    counts = []
    try:
        for step in range(steps + 1):
            with HostSyncCounter(cpu_as_device=cpu_as_device) as counter:
                overflowing_iteration(model, opt, x, y, overflow=step == OVERFLOWING_STEP)
            if step > 0:
                counts.append(counter.syncs)
        stats = amp.stats()
        assert (stats.steps, stats.skipped_steps) == (steps + 1, 1)
    finally:
        amp.deinitialize()
    return counts


DEVICE_DECIDED: list[tuple[OptLevel, dict[str, Any]]] = [
    ("O1", {}),  # a dynamic scale: decided on the device by default where a read would wait (a GPU)
    ("O2", {}),
    ("O4", {}),
    ("O5", {}),
    ("O5", {"master_weights": "remainder"}),
    ("O3", {}),
    ("O2", {"loss_scale": 128.0}),
    *((level, {"sync_free": True}) for level in ("O1", "O2", "O4", "O5")),
]


# O3 steps AdamW in fp16, whose eps=1e-8 initialize warns of (tests/test_vanishing_eps.py); the syncs are the point.
@pytest.mark.filterwarnings("ignore:.*which is 0 in float16:UserWarning")
@pytest.mark.parametrize(("level", "options"), DEVICE_DECIDED, ids=[f"{lv}-{o}" for lv, o in DEVICE_DECIDED])
def test_steps_decided_on_the_device_make_no_host_sync(
    level: OptLevel, options: dict[str, Any], cuda_path: bool
) -> None:
    """A static scale (O3/O4/O5's 1.0, or a number) and ``sync_free=True``: no step waits, the overflowing one
    included. Before the skip was decided on the device at a static scale, every O4/O5 step read the flag."""
    assert syncs_per_step(level, cuda_path, **options) == [[]] * STEPS


@pytest.mark.parametrize(("level", "options"), [("O5", {}), ("O2", {"loss_scale": 128.0})], ids=["O5", "O2-static"])
def test_masters_with_torchs_default_adamw_make_no_host_sync(
    level: OptLevel, options: dict[str, Any], cuda_path: bool
) -> None:
    """``torch.optim.AdamW(params)`` (foreach: it cannot take a device flag itself) at O2/O5: amp's kernel step
    takes it and skips on the device, so the flag is never read on the host."""
    assert syncs_per_step(level, cuda_path, fused=False, **options) == [[]] * STEPS


WITHOUT_MASTERS: list[tuple[OptLevel, dict[str, Any]]] = [
    ("O1", {}),
    ("O4", {}),
    ("O0", {}),
    ("O1", {"sync_free": True}),
    ("O1", {"loss_scale": 128.0}),
]


@pytest.mark.parametrize(("level", "options"), WITHOUT_MASTERS, ids=[f"{lv}-{o}" for lv, o in WITHOUT_MASTERS])
def test_levels_without_masters_with_torchs_default_adamw_make_no_host_sync(
    level: OptLevel, options: dict[str, Any], cuda_path: bool
) -> None:
    """``torch.optim.AdamW(params)`` (foreach) at a level without masters whose skip is decided on the device:
    amp's kernel step stands in for the optimizer, which cannot take the flag. Before, each step read the flag on
    the host (one ``aten._local_scalar_dense`` per step), O4's default included."""
    assert syncs_per_step(level, cuda_path, fused=False, **options) == [[]] * STEPS


def test_a_step_the_kernels_decline_reads_the_flag_then(cuda_path: bool) -> None:
    """O5 with torch's default SGD(momentum): its first step, which may be skipped, is one the kernels decline
    (no momentum buffer yet), and the optimizer cannot take a device flag; the flag left for the kernels is read at
    that step (one sync), so an overflowing first step is skipped for real: weights unchanged, no buffer made."""
    model: SmallNet
    model, x, y = on_device(make_problem())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level="O5", verbosity=0)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        with HostSyncCounter(cpu_as_device=cuda_path) as counter:
            loss = nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                plant_inf_in_fc1(model)
            opt.step()
        # One read of the flag (the first step's set-up copies aside, as syncs_per_step leaves out its first step).
        assert counter.syncs.count("aten._local_scalar_dense") == 1
        assert amp.step_was_skipped(opt)
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        assert not any("momentum_buffer" in entry for entry in opt.state.values())
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_dynamic_scale_decided_on_the_host_reads_the_flag_once_per_step(level: OptLevel, cuda_path: bool) -> None:
    """``sync_free=False``, Apex's way: the overflowing step too reads only the flag; the scale is read only for a
    log line that is written (none at verbosity 0)."""
    assert syncs_per_step(level, cuda_path, sync_free=False) == [["aten._local_scalar_dense"]] * STEPS


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_raise_at_min_keeps_a_dynamic_scale_on_the_host(level: OptLevel, cuda_path: bool) -> None:
    """``DynamicLossScale(raise_at_min=True)`` must look at the flag on the host to raise, so by default it keeps the
    host decision (and its one read per step) on a GPU too; the overflowing step also reads the scale, to compare
    it with the floor."""
    scale = ampinit.DynamicLossScale(min_scale=1.0, raise_at_min=True)
    expected = [["aten._local_scalar_dense"]] * STEPS
    expected[OVERFLOWING_STEP - 1] = ["aten._local_scalar_dense"] * 2  # syncs_per_step leaves the first step out
    assert syncs_per_step(level, cuda_path, loss_scale=scale) == expected


# torch says once per process that the mode is a prototype; under filterwarnings=error that notice would raise with
# the mode already switched on.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@pytest.mark.filterwarnings("ignore:.*which is 0 in float16:UserWarning")  # O3's AdamW eps, as above
@requires_cuda("torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize(
    ("level", "options", "fused"),
    [(lv, o, True) for lv, o in DEVICE_DECIDED] + [(lv, o, False) for lv, o in (*WITHOUT_MASTERS, ("O5", {}))],
    ids=[f"{lv}-{o}-fused" for lv, o in DEVICE_DECIDED]
    + [f"{lv}-{o}-foreach" for lv, o in (*WITHOUT_MASTERS, ("O5", {}))],
)
def test_steps_decided_on_the_device_never_synchronise_on_cuda(
    level: OptLevel, options: dict[str, Any], fused: bool
) -> None:
    """CUDA's own verdict: any host sync in these steps (the overflowing one included) raises; with fused AdamW,
    and with torch's default (foreach) AdamW, whose step amp's kernels take."""
    model: SmallNet
    model, x, y = (t.cuda() for t in make_problem())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {}))
    amp.initialize(model, opt, opt_level=level, verbosity=0, **options)

    def iteration(overflow: bool) -> None:
        opt.zero_grad()
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            if overflow:
                plant_inf_in_fc1(model)
        opt.step()

    try:
        for _ in range(2):  # the first steps create optimizer state, buffers and compiled kernels: warm up
            iteration(overflow=False)
        previous = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for step in range(STEPS):
                iteration(overflow=step == OVERFLOWING_STEP)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        assert amp.stats().skipped_steps == 1
    finally:
        amp.deinitialize()
