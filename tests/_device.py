"""Which device the suite runs on: ``pytest --device cuda`` (or ``AMPINIT_TEST_DEVICE=cuda``); CPU by default.

Tests that mean something on any device take the ``device`` fixture (or, in a module with many tensors, call
:func:`device_under_test` / :func:`on_device`). Tests that only mean something on CUDA are marked with
:data:`cuda_only`, which skips them elsewhere with a reason naming the option that runs them.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, TypeVar

import pytest
import torch
from torch.overrides import TorchFunctionMode
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
    """Counts what makes the host wait for a device:

    - scalar reads: ``item``, ``bool``, ``float``, ``int`` of a tensor (all reach ``aten._local_scalar_dense``),
      ``tolist()``, and ``nonzero`` (whose output size the host must learn; boolean-mask indexing goes through it
      on CUDA);
    - copies from a non-CPU tensor into a CPU one;
    - blocking copies from a CPU tensor into a non-CPU one (torch waits for the stream after those;
      ``non_blocking=True`` ones it does not), ``torch.tensor(..., device=)``/``torch.as_tensor(..., device=)``
      onto a non-CPU device among them.

    With ``cpu_as_device=True`` (a CPU run standing in for a GPU, e.g. under ``pretend_gpu``) the CPU tensors are
    taken for device tensors, so that what would copy host data to the GPU is seen: ``torch.tensor``/``as_tensor``
    given a ``device``, and a tensor built from host data (``torch.tensor``/``as_tensor`` without a device) moved
    with ``.to(device)``/``.to(tensor)`` or copied into another tensor, without ``non_blocking``. Scalar reads
    are counted on any device.
    """

    def __init__(self, *, cpu_as_device: bool = False) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self._calls = _HostDataCalls(self.syncs, cpu_as_device)

    def __enter__(self) -> HostSyncCounter:
        self._calls.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self._calls.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._calls.__exit__(*exc_info)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ("aten._local_scalar_dense", "aten.nonzero"):
            self.syncs.append(name)
        elif name in ("aten._to_copy", "aten.copy_"):
            src, dst = _copy_devices(name, args, kwargs)
            if src.type != "cpu" and dst.type == "cpu":
                self.syncs.append(f"{name} device->host")
            elif src.type == "cpu" and dst.type != "cpu" and not _non_blocking(name, args, kwargs):
                self.syncs.append(f"{name} host->device, blocking")
        return func(*args, **kwargs)


class _HostDataCalls(TorchFunctionMode):
    """The half of :class:`HostSyncCounter` that sees Python-level calls no dispatch mode sees: ``tolist()``, and
    host data put on a device by ``torch.tensor``/``as_tensor`` (copied below the dispatcher)."""

    def __init__(self, syncs: list[str], cpu_as_device: bool) -> None:
        super().__init__()
        self._syncs = syncs
        self._cpu_as_device = cpu_as_device
        # id -> the tensor, weakly: a WeakSet would compare tensors with ==, which is elementwise.
        self._host_born: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            self._from_host_data(func.__name__, kwargs.get("device"), result)
            return result
        sync = self._sync_of(func, args, kwargs)
        if sync is not None:
            self._syncs.append(sync)
        return result

    def _sync_of(self, func: Any, args: Any, kwargs: Any) -> str | None:
        if func is torch.Tensor.tolist:
            return "Tensor.tolist"
        if not self._cpu_as_device:
            return None
        if func is torch.Tensor.to and args and self._is_host_born(args[0]):
            moved = _target_device(args[1:], kwargs) is not None
            return "Tensor.to host->device, blocking" if moved and not kwargs.get("non_blocking", False) else None
        if func is torch.Tensor.copy_ and len(args) > 1 and self._is_host_born(args[1]):
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return None if non_blocking else "Tensor.copy_ host->device, blocking"
        return None

    def _from_host_data(self, name: str, device: Any, result: torch.Tensor) -> None:
        if device is None:
            self._host_born[id(result)] = weakref.ref(result)
        elif torch.device(device).type != "cpu" or self._cpu_as_device:
            self._syncs.append(f"torch.{name}(..., device=) host->device, blocking")

    def _is_host_born(self, tensor: Any) -> bool:
        ref = self._host_born.get(id(tensor))
        return ref is not None and ref() is tensor


def _target_device(args: Any, kwargs: Any) -> torch.device | None:
    """The device a ``Tensor.to`` call names (positionally, by keyword, or as another tensor's), if any."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (str, torch.device)):
            return torch.device(arg)
    return None


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
