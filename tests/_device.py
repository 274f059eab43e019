"""Which device the suite runs on: ``pytest --device cuda`` (or ``AMPINIT_TEST_DEVICE=cuda``); CPU by default.

Tests that mean something on any device take the ``device`` fixture (or, in a module with many tensors, call
:func:`device_under_test` / :func:`on_device`). Tests that only mean something on CUDA are marked with
:data:`cuda_only`, which skips them elsewhere with a reason naming the option that runs them.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPTION = "--device"
ENV_VAR = "AMPINIT_TEST_DEVICE"
_ALLOWED = ("cpu", "cuda")

_T = TypeVar("_T")
_chosen: torch.device | None = None


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        default=None,
        choices=_ALLOWED,
        help=f"device the device-sensitive tests run on (default: ${ENV_VAR} or cpu)",
    )


def configure(config: pytest.Config) -> None:
    """Resolve the device once per session; an unusable choice is an error, never a silent fallback to CPU."""
    global _chosen
    name = config.getoption(OPTION) or os.environ.get(ENV_VAR) or "cpu"
    if name not in _ALLOWED:
        raise pytest.UsageError(f"{ENV_VAR}={name!r} is not a device the suite runs on; allowed: {', '.join(_ALLOWED)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"{OPTION} cuda was asked for, but torch.cuda.is_available() is False")
    _chosen = torch.device(name)


def device_under_test() -> torch.device:
    """The device chosen for this run (``cpu`` outside a configured pytest session)."""
    return _chosen if _chosen is not None else torch.device("cpu")


def on_device(value: _T) -> _T:
    """``value`` moved to the test device: a tensor, a module, or a list/tuple of them."""
    device = device_under_test()
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return value.to(device)  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    return value


def subprocess_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child process that must run on the device under test: on a CPU run, CUDA is hidden from it
    (``CUDA_VISIBLE_DEVICES=""``), so a script that picks CUDA whenever it exists runs on the CPU its reference
    was computed on, also on a GPU machine."""
    if device_under_test().type == "cpu":
        return {**env, "CUDA_VISIBLE_DEVICES": ""}
    return dict(env)


def autocast_device_types() -> tuple[str, ...]:
    """Device types whose autocast state the leak check compares: always CPU, and the test device's own."""
    kind = device_under_test().type
    return ("cpu",) if kind == "cpu" else ("cpu", kind)


def requires_cuda(reason: str) -> Any:
    """A skip marker for a test that only means something on CUDA."""
    return pytest.mark.skipif(
        device_under_test().type != "cuda",
        reason=f"CUDA only ({reason}): run with `pytest {OPTION} cuda` or {ENV_VAR}=cuda on a GPU machine",
    )


class HostSyncCounter(TorchDispatchMode):
    """Counts what makes the host wait for a device: scalar reads (``item``, ``bool``, ``float`` of a tensor all
    reach ``aten._local_scalar_dense``), copies from a non-CPU tensor into a CPU one, and blocking copies from a CPU
    tensor into a non-CPU one (torch waits for the stream after those; ``non_blocking=True`` ones it does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name == "aten._local_scalar_dense":
            self.syncs.append(name)
        elif name in ("aten._to_copy", "aten.copy_"):
            src, dst = _copy_devices(name, args, kwargs)
            if src.type != "cpu" and dst.type == "cpu":
                self.syncs.append(f"{name} device->host")
            elif src.type == "cpu" and dst.type != "cpu" and not _non_blocking(name, args, kwargs):
                self.syncs.append(f"{name} host->device, blocking")
        return func(*args, **kwargs)


def _copy_devices(name: str, args: Any, kwargs: Any) -> tuple[torch.device, torch.device]:
    """(source, destination) devices of a copy op."""
    if name == "aten.copy_":
        return args[1].device, args[0].device
    target = kwargs.get("device")
    return args[0].device, args[0].device if target is None else torch.device(target)


def _non_blocking(name: str, args: Any, kwargs: Any) -> bool:
    if name == "aten.copy_" and len(args) > 2:
        return bool(args[2])
    return bool(kwargs.get("non_blocking", False))
