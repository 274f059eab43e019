"""Triton's whole launch path on a machine without a GPU: a stand-in driver whose launcher records its calls.

``kernel[grid](...)`` then binds, specialises and compiles for an H100 (sm_90, with the ``ptxas`` Triton's wheel
ships, as tests/test_triton_compile.py does), and calls the launcher with exactly what it would hand the CUDA
driver; only the launcher itself, loading the module and the device's properties are stood in for. The kernel
modules are rebuilt on the way in and out: a ``JITFunction`` keeps its compiled kernels per device, with their
launchers, and neither a real GPU's nor this driver's may serve the other.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: A device number no real GPU has: a kernel's per-device caches made under this driver are never a real device's.
DEVICE = 100  # within torch.device's index range (an int8)
STREAM = 424242


@dataclass
class Call:
    """One call of a compiled kernel's launcher: the grid, the stream, the kernel's metadata hash, the arguments."""

    grid: tuple[int, int, int]
    stream: int
    kernel: str
    args: tuple[Any, ...]


@dataclass
class FakeDriver:
    """Enough of a Triton driver for ``JITFunction.run`` and ``CompiledKernel[grid]`` to run to the launcher."""

    calls: list[Call] = field(default_factory=list)
    device: int = DEVICE  # the current device (a test may make another current)

    def __post_init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.utils = _Utils()

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return STREAM

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launcher_cls(self, src: Any, metadata: Any) -> Any:
        calls = self.calls
        name = f"{metadata.name}:{metadata.hash}"

        def launch(g0: int, g1: int, g2: int, stream: int, function: Any, packed: Any, *rest: Any) -> None:
            # rest: launch metadata, enter hook, exit hook, then the kernel's arguments
            calls.append(Call((g0, g1, g2), stream, name, tuple(rest[3:])))

        return launch


#: The module handle of every kernel "loaded" by this driver. A compiled kernel with a module unloads it through the
#: driver active when it is freed (Triton 3.9's ``__del__``), maybe after this one is gone: :func:`fake_driver`
#: takes the handle back from each on the way out. (Without one, a kernel loads again, asking the driver for a new
#: launcher, at every ``CompiledKernel[grid]``: a cost a real launch does not have, which a benchmark would count.)
MODULE = object()


class _Utils:
    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[object, int, int, int, int]:
        return MODULE, 2, 0, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module: object) -> None:
        pass

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


def _rebuild() -> None:
    import ampinit._casting.triton_gelu as gelu
    import ampinit._masters.triton_dial as dial
    import ampinit._masters.triton_kernels as kernels
    from ampinit._masters import triton_launch

    # triton_dial and triton_gelu take jit helpers from triton_kernels when imported: rebuilt after it.
    for module in (kernels, dial, gelu):
        importlib.reload(module)
    triton_launch.forget()


@contextlib.contextmanager
def fake_driver() -> Iterator[FakeDriver]:
    """Inside, Triton launches through a :class:`FakeDriver` (returned), with the kernel modules freshly built."""
    from triton.runtime.driver import driver

    fake = FakeDriver()
    saved = driver._active
    driver.set_active(fake)
    try:
        _rebuild()
        yield fake
    finally:
        _rebuild()
        _unload()
        driver._active = saved


def _unload() -> None:
    """Take the stand-in module back from every compiled kernel that has it (see :data:`MODULE`)."""
    from triton.compiler.compiler import CompiledKernel

    gc.collect()
    for thing in gc.get_objects():
        if type(thing) is CompiledKernel and thing.module is MODULE:  # type(): no attribute read of any object
            thing.module = None
