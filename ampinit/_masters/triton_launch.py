"""A Triton kernel launched again without Triton's per-call binding: :func:`launch`.

``kernel[grid](*args, **constants)`` binds every argument to the kernel's signature, computes a specialisation
of each (a tensor's dtype and whether it starts on 16 bytes, an integer's range, whether it is 1 or a multiple of
16), turns them into a cache key with the constants and options, looks the compiled kernel up, checks the globals
it read, and only then calls the launcher. The master step alone is host-bound on the GPU checks' hosts
(docs/gpu.md), and each step makes two or three launches. ``benchmarks/triton_launch_host.py`` runs both paths to
a stand-in CUDA launcher on any machine: per call of the master step's Adam launch over 150 tensors, 12.6 us
through Triton and 7.2 us through :func:`launch` on the development CPU (Triton 3.9; the finite check's 7.6 and
5.1), where the compiled kernel called bare takes about 2 us.

:func:`launch` keeps the compiled kernel Triton returned from its first launch of each specialisation, under a key
that separates at least what Triton's does (:func:`_arguments_key`, checked against Triton's own
``native_specialize_impl`` in the tests), and calls it directly from then on. What it does not re-check per call,
by design: Triton's pre-run hooks (a kernel that has any is always launched through Triton), the values of the
globals a kernel read when compiled (the master step's kernels read none that change), and Triton's debug and
instrumentation settings taken from the environment when a specialisation was first compiled. Kernels that are
not ``JITFunction``s (Triton's interpreter, the tests' stand-ins) are launched as ``kernel[grid](...)`` always.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
from triton.runtime.driver import driver

try:  # the class of what ``JITFunction.run`` returns; its module moved before (triton.compiler.compiler since 3.0)
    from triton.compiler.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # pragma: no cover - an older or newer layout: every launch goes through Triton
    _CompiledKernel = None

#: Compiled kernels by (id of the kernel, device, argument key, constants, options), each with its kernel (which
#: keeps the id from being reused while the entry lives: a ``JITFunction`` hashes its source's digest, a Python call
#: per lookup) and the constants' values in the kernel's parameter order. A few per kernel (the launches' dtypes,
#: flags and alignments), emptied past ``_MAX_COMPILED`` (each entry holds a loaded module, not device memory).
_compiled: dict[tuple[Any, ...], tuple[Any, Any, tuple[Any, ...]]] = {}
_MAX_COMPILED = 256

_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)

_TYPE_ONLY = frozenset((float, bool, type(None)))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # plain tensors: a subclass may have no data pointer
_KEYED = _TYPE_ONLY | _TENSORS | {int}


def _int_key(value: int) -> tuple[bool, bool, bool, bool]:
    return value == 1, value % 16 == 0, value in _INT32, value in _INT64


#: Per tuple of argument types: the positions of the tensors and of the integers (the only arguments whose values
#: matter), or None where a type has no rule.
_layouts: dict[tuple[type, ...], tuple[list[int], list[int]] | None] = {}


def _arguments_key(args: Sequence[object]) -> tuple[object, ...] | None:
    """What Triton's specialisation of ``args`` (a launch's non-constexpr arguments) depends on, by its
    ``native_specialize_impl``'s rules: the types; a tensor's dtype and whether its data starts on 16 bytes; an
    integer's range (i32, i64, u64), whether it is 1 (then a compile-time constant) and whether it is a multiple of
    16; nothing more for a float, a bool or None. None where an argument is of another type (a tensor subclass, a
    NumPy scalar): that launch goes through Triton. One pass over the types, then only the tensors and integers are
    read (a Python call per argument was most of a launch's own time)."""
    types = tuple(map(type, args))
    layout = _layouts.get(types)
    if layout is None:
        if types in _layouts:
            return None
        if len(_layouts) >= _MAX_COMPILED:
            _layouts.clear()
        if not _KEYED.issuperset(types):
            _layouts[types] = None
            return None
        layout = [i for i, t in enumerate(types) if t in _TENSORS], [i for i, t in enumerate(types) if t is int]
        _layouts[types] = layout
    tensors, ints = layout
    return (
        types,
        tuple([(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in tensors]),  # type: ignore[attr-defined]
        tuple([_int_key(args[i]) for i in ints]),  # type: ignore[arg-type]
    )


def launch(
    kernel: Any,
    programs: int,
    args: Sequence[object],
    constants: Mapping[str, object],
    options: Mapping[str, object],
    device: torch.device | None = None,
) -> None:
    """``kernel[(programs,)](*args, **constants, **options)``: ``args`` are the kernel's leading parameters in
    order, ``constants`` its remaining (``tl.constexpr``) ones by name, ``options`` Triton's launch options
    (``enable_fp_fusion``...). The first launch of a specialisation goes through Triton (which compiles it); later
    ones call the kernel it compiled, on the current stream, as Triton would have.

    ``device``: the tensors' device. Triton launches on the current CUDA device whatever the tensors' (a model on
    ``cuda:1`` in a process whose current device is 0 would have its kernels run on device 0, reading device 1's
    memory: an illegal address without peer access), so a launch for another CUDA device is made with that device
    current, as torch's own fused optimizers guard theirs."""
    current = None
    if device is not None and device.type == "cuda":
        current = driver.active.get_current_device()
        if device.index != current:
            with _device_guard(device):
                launch(kernel, programs, args, constants, options, device)
            return
    if _CompiledKernel is None or not isinstance(kernel, triton.runtime.jit.JITFunction) or kernel.pre_run_hooks:
        kernel[(programs,)](*args, **constants, **options)
        return
    arguments = _arguments_key(args)
    if arguments is None:
        kernel[(programs,)](*args, **constants, **options)
        return
    if current is None:
        current = driver.active.get_current_device()
    key = (id(kernel), current, arguments, tuple(constants.items()), tuple(options.items()))
    found = _compiled.get(key)
    if found is not None:
        _, compiled, trailing = found
        compiled[(programs, 1, 1)](*args, *trailing)
        return
    compiled = kernel[(programs,)](*args, **constants, **options)
    names = kernel.arg_names[len(args) :]
    if isinstance(compiled, _CompiledKernel) and set(names) == set(constants):
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        _compiled[key] = kernel, compiled, tuple(constants[name] for name in names)


#: Makes a CUDA device current for a block (a name of this module's, for the tests' stand-in driver).
_device_guard = torch.cuda.device


def forget() -> None:
    """Drop the kept compiled kernels (a test that replaces Triton's driver, or a kernel rebuilt for the
    interpreter)."""
    _compiled.clear()
