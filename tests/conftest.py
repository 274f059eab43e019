"""Shared fixtures. Every test runs under a leak check: amp sessions and every piece of process state listed
in ``tests/_leaks.py`` (torch's thread state, function registrations, autocast kernels, the Apex import alias,
``sys.meta_path``) must be as the test found them, so a test that forgets ``close()`` (or code that fails to
restore state on an error) fails loudly instead of contaminating the next test."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from types import ModuleType
from typing import cast

import pytest
import torch
from torch import nn

from ampinit import _registry
from tests import _device, _leaks, _triton


def pytest_addoption(parser: pytest.Parser) -> None:
    _device.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    _device.configure(config)


@pytest.fixture
def device() -> torch.device:
    """The device the suite runs on (``--device``, default cpu)."""
    return _device.device_under_test()


class _NotCapturing:
    """The current stream of a pretended GPU: no graph is ever being captured on it."""

    def is_capturing(self) -> bool:
        return False


@pytest.fixture
def pretend_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine as code that asks ``torch.cuda.is_available()`` sees it, on any machine: CUDA is reported
    available (one device) while every tensor stays where the test puts it. Code that picks its device from that
    question rather than from its tensors or model goes wrong here as it would on a real GPU machine."""
    really = torch.cuda.is_available()
    count = max(1, torch.cuda.device_count() if really else 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if not really:
        # torch.optim asks whether a CUDA graph is being captured once CUDA says it is available (2.11 through
        # torch.cuda, 2.14 through torch.accelerator's current stream); a CUDA build of torch without a driver (the
        # 2.11/2.14 wheels on a CPU machine) would then raise instead of saying no.
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_stream"):
            monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _NotCapturing())


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[ModuleType]:
    """``ampinit._masters.triton_kernels`` with its kernels built for Triton's interpreter (the flag is read when a
    kernel is decorated), for CPU tensors. On the way out the module is built again without the flag, so a later CUDA
    step in this process runs compiled kernels, not the interpreter on GPU tensors."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels need it")
    with _triton.interpreted_kernels() as module:
        yield module


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = _leaks.snapshot()
    sessions_before = _registry.live_sessions()
    yield
    leaked = [s for s in _registry.live_sessions() if s not in sessions_before]
    for session in reversed(leaked):
        session.close()
    changed = _leaks.differences(before, _leaks.snapshot())
    assert not leaked, f"test left amp sessions open: {leaked}"
    assert not changed, "test leaked process state:\n" + "\n".join(changed)


@pytest.fixture(scope="module")
def device_kernels(request: pytest.FixtureRequest) -> ModuleType:
    """The master kernels for the device under test: on CPU the interpreter's (asked for at the module's scope, so
    that the kernels are built for it before any test's leak check looks); on CUDA the compiled ones, asserted so
    (a module that also asks for ``triton_interpreter`` would have them built for the interpreter, and a CUDA test
    would then test nothing: tests/test_step_scalars_on_device.py's docstring)."""
    if _device.device_under_test().type == "cpu":
        return cast(ModuleType, request.getfixturevalue("triton_interpreter"))
    return _triton.compiled_kernels()


@pytest.fixture
def kernels_on_cpu(triton_interpreter: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The interpreted kernels, and amp's master step taking them for CPU tensors (the one switch,
    ``kernel_step.TRITON_ON_CPU``)."""
    from ampinit._masters import kernel_step

    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", True)
    return triton_interpreter


class SmallNet(nn.Module):
    """Linear -> BatchNorm -> GELU -> Linear -> LayerNorm -> Linear: one of each kind of layer amp treats."""

    def __init__(self, d_in: int = 8, width: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.bn(self.fc1(x)))
        return self.head(self.ln(self.fc2(h)))


def make_problem(
    seed: int = 0, n: int = 64, d_in: int = 8, d_out: int = 4
) -> tuple[SmallNet, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SmallNet(d_in, 16, d_out)
    x = torch.randn(n, d_in, generator=gen)
    y = torch.randn(n, d_out, generator=gen)
    return model, x, y


@pytest.fixture
def session_cleanup() -> Iterator[None]:
    """For tests that expect sessions to be left open on purpose and close them through the module API."""
    yield
    while _registry.current() is not None:
        current = _registry.current()
        assert current is not None
        current.close()


@pytest.fixture
def gloo_group(tmp_path: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo process group for the test, torn down only once nothing of the test still uses it.

    A fresh-clone CI run of 2026-11-27 aborted in this teardown (a gloo thread, ``Resource deadlock avoided``:
    a thread joining itself, as when the group's last reference is dropped on one of its own worker threads). So the
    teardown waits for the group's earlier work (gloo's barrier waits for it), collects the test's DDP modules,
    which sit in reference cycles and hold the group through their reducers, on this thread, and only then
    destroys the group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)  # type: ignore[operator]
    try:
        yield
    finally:
        try:
            dist.barrier()
        finally:
            gc.collect()
            dist.destroy_process_group()
