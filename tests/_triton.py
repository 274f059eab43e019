"""``ampinit._masters.triton_kernels`` (and ``triton_dial`` and ``ampinit._casting.triton_gelu``, built on its
helpers) built for Triton's interpreter, and built back: for the tests that run their kernels on CPU tensors
(``TRITON_INTERPRET=1`` is read when a kernel is decorated, so the modules are reloaded both ways)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

FLAG = "TRITON_INTERPRET"


def interpreted(module: ModuleType) -> bool:
    """Whether ``module``'s kernels were built for the interpreter (Triton's ``InterpretedFunction``)."""
    return type(module._round_to_bf16).__name__ == "InterpretedFunction"


@contextlib.contextmanager
def interpreted_kernels() -> Iterator[ModuleType]:
    """Inside, ``ampinit._masters.triton_kernels`` runs on Triton's interpreter; on the way out (also on an error)
    the flag is as it was and the module is rebuilt under it."""
    import ampinit._casting.triton_gelu as gelu
    import ampinit._masters.triton_dial as dial
    import ampinit._masters.triton_kernels as module

    previous = os.environ.get(FLAG)
    os.environ[FLAG] = "1"
    try:
        # triton_dial and triton_gelu take jit helpers from triton_kernels when imported: rebuilt after it, both ways.
        interpreted_module = importlib.reload(module)
        importlib.reload(dial)
        importlib.reload(gelu)
        yield interpreted_module
    finally:
        if previous is None:
            del os.environ[FLAG]
        else:
            os.environ[FLAG] = previous
        importlib.reload(module)
        importlib.reload(dial)
        importlib.reload(gelu)


def compiled_kernels() -> ModuleType:
    """``ampinit._masters.triton_kernels`` as built for the compiler, asserted so: a CUDA test given the interpreter's
    kernels (a module-scoped fixture of its module had built them) would compare the interpreter with itself."""
    from ampinit._masters import triton_kernels

    assert not interpreted(triton_kernels), "the kernels are built for the interpreter: the test would not test"
    return triton_kernels
