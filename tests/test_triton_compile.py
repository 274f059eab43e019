"""The Triton master-step kernels compiled for NVIDIA GPUs (sm_80, sm_90) on a machine without one.

``test_master_kernels.py`` and ``test_remainder_masters.py`` check the kernels' arithmetic bit for bit on CPU,
through Triton's interpreter. The interpreter compiles nothing, so a kernel it runs may still fail to build for
a GPU, or build with different rounding. Triton's ahead-of-time compiler needs no GPU: it lowers a kernel to PTX
and assembles it with the ``ptxas`` its wheel ships. Here every specialisation the launch code produces (the
launches are captured from ``ampinit._masters.triton_kernels``'s own functions, not restated) is compiled for an A100
(sm_80) and an H100 (sm_90), and its PTX is checked for what the bitwise agreement with the reference rests on:

- no fused multiply-add, and every fp32 add, subtract and multiply carries an explicit rounding mode (``.rn``):
  the PTX ISA lets ``ptxas`` contract only the instructions without one into an FMA;
- division and square root are the correctly rounded ``div.rn.f32``/``sqrt.rn.f32``, not approximations;
- fp32 -> fp16 rounds to nearest even (``cvt.rn.f16.f32``); fp32 -> bf16 is the kernels' own integer rounding,
  so no float conversion to bf16 appears at all.

The compiled code is not run: that needs a GPU (``scripts/gpu_check.sh``, docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit._masters.reference import AdamSettings, Masters, SgdSettings

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

TARGETS = [80, 90]  # compute capabilities: A100, H100
LAUNCH_OPTIONS = ("enable_fp_fusion", "num_warps", "num_stages")
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
}


@dataclass
class Launch:
    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def signature(self) -> tuple[dict[str, str], dict[str, Any]]:
        """Triton's (signature, constexprs) for this launch's arguments, typed as the runtime types them."""
        values = dict(zip(self.kernel.arg_names, self.args))
        values.update({k: v for k, v in self.kwargs.items() if k not in LAUNCH_OPTIONS})
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for param in self.kernel.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                assert isinstance(value, float), (param.name, value)
                signature[param.name] = "fp32"
        return signature, constexprs

    def key(self) -> str:
        signature, constexprs = self.signature()
        constants = sorted((k, str(v)) for k, v in constexprs.items())
        return f"{self.kernel.__name__} {sorted(signature.items())} {constants}"


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch instead of running it."""

    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return launch


@pytest.fixture(scope="module")
def compiled_module() -> ModuleType:
    """A private copy of ``ampinit._masters.triton_kernels`` decorated for the compiler, whatever TRITON_INTERPRET says.

    The interpreter tests reload the package's module with the interpreter on; a copy of our own leaves theirs be.
    """
    import ampinit._masters.triton_kernels as shared

    previous = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location("_ampinit_triton_master_compiled", Path(shared.__file__))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in (3, 2048)]


def _masters(storage: str) -> Masters:
    if storage == "fp32":
        return Masters.fp32(_tensors(torch.float32))
    if storage == "remainder":
        return Masters.remainder(_tensors(torch.bfloat16), _tensors(torch.int16))
    weight_dtype = {"fp32+fp16": torch.float16, "fp32+bf16": torch.bfloat16}[storage]
    return Masters.fp32(_tensors(torch.float32), _tensors(weight_dtype))


STORAGES = ["fp32", "fp32+fp16", "fp32+bf16", "remainder"]
GRADS = [torch.float32, torch.float16, torch.bfloat16]


def _launches(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every specialisation ampinit launches, captured from the module's public functions."""
    launches: list[Launch] = []
    for name in ("_adam_kernel", "_sgd_kernel", "_check_kernel"):
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    flag, inv_scale = torch.zeros(1), torch.ones(1)
    steps = torch.zeros(2, 2)
    for grad in GRADS:
        module.check_finite_(_tensors(grad), flag)
        for storage in STORAGES:
            adamw = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
            moments = _tensors(torch.float32), _tensors(torch.float32)
            module.adam_(_tensors(grad), _masters(storage), *moments, steps, adamw, inv_scale=inv_scale, found_inf=flag)
            sgd = SgdSettings(0.1, 0.9, 0.0, False, 1e-4, False)
            buffers = _tensors(torch.float32)
            scaling = {"inv_scale": inv_scale, "found_inf": flag}
            module.sgd_(_tensors(grad), _masters(storage), buffers, sgd, first_step=False, **scaling)
    # The remaining constant branches, once each, on bf16 grads and bf16 weights (O5's case).
    for decay, decoupled in ((0.0, False), (0.01, False)):
        adam = AdamSettings(1e-3, 0.9, 0.999, 1e-8, decay, decoupled, True)
        moments = _tensors(torch.float32), _tensors(torch.float32)
        module.adam_(_tensors(torch.bfloat16), _masters("fp32+bf16"), *moments, steps, adam)
    for momentum, nesterov, first_step, decay in ((0.9, True, True, 0.0), (0.0, False, False, 0.0)):
        sgd = SgdSettings(0.1, momentum, 0.0, nesterov, decay, True)
        buffers = _tensors(torch.float32) if momentum else []
        module.sgd_(_tensors(torch.bfloat16), _masters("fp32+bf16"), buffers, sgd, first_step=first_step)
    return launches


@pytest.fixture(scope="module")
def launches(compiled_module: ModuleType) -> list[Launch]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        captured = _launches(compiled_module, monkeypatch)
    unique: dict[str, Launch] = {}
    for launch in captured:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


def _compile(launch: Launch, capability: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = launch.signature()
    options = {k: v for k, v in launch.kwargs.items() if k in LAUNCH_OPTIONS}
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    except FileNotFoundError as error:  # pragma: no cover - a triton wheel without the NVIDIA toolchain
        pytest.skip(f"triton's NVIDIA backend has no ptxas here ({error}); the GPU compile check needs it")


FLOAT_OPS = re.compile(r"\b((?:add|sub|mul|fma|div|sqrt|rcp|rsqrt|cvt)(?:\.[a-z0-9]+)*)\b")


def float_ops(ptx: str) -> set[str]:
    """The floating-point arithmetic and conversion instructions of ``ptx`` (integer ones dropped)."""
    ops = set(FLOAT_OPS.findall(ptx))
    return {op for op in ops if re.search(r"\.(f16|bf16|f32|f64)\b", op)}


def bitwise_violations(ops: set[str]) -> list[str]:
    """The instructions in ``ops`` that would break bitwise agreement with the reference, with the reason."""
    problems = []
    for op in sorted(ops):
        parts = op.split(".")
        name, modifiers = parts[0], set(parts[1:])
        if name == "fma":
            problems.append(f"{op}: a fused multiply-add (the reference rounds the product)")
        elif name in ("add", "sub", "mul") and "f32" in modifiers and "rn" not in modifiers:
            problems.append(f"{op}: no explicit rounding mode, so ptxas may contract it into an FMA")
        elif name in ("div", "sqrt", "rcp", "rsqrt") and "rn" not in modifiers:
            problems.append(f"{op}: not correctly rounded")
        elif name == "cvt" and parts[-1] == "f32" and ({"f16", "bf16"} & modifiers) and "rn" not in modifiers:
            problems.append(f"{op}: a narrowing conversion that does not round to nearest even")
        elif name == "cvt" and "bf16" in modifiers and parts[-1] == "f32":
            problems.append(f"{op}: fp32 -> bf16 is the kernels' own integer rounding, not a float conversion")
    return problems


def test_every_kernel_and_branch_is_captured(launches: list[Launch]) -> None:
    names = {launch.kernel.__name__ for launch in launches}
    assert names == {"_adam_kernel", "_sgd_kernel", "_check_kernel"}
    storages = {launch.kwargs.get("STORAGE") for launch in launches if "STORAGE" in launch.kwargs}
    assert storages == {0, 1, 2}
    assert {launch.kwargs.get("DECAY") for launch in launches if "DECAY" in launch.kwargs} == {0, 1, 2}
    assert all(launch.kwargs.get("enable_fp_fusion") is False for launch in launches if "STORAGE" in launch.kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("capability", [pytest.param(c, id=f"sm_{c}") for c in TARGETS])
def test_kernels_compile_for_the_gpu_with_the_references_rounding(launches: list[Launch], capability: int) -> None:
    for launch in launches:
        kernel = _compile(launch, capability)
        assert kernel.asm.get("cubin"), f"ptxas produced no cubin for {launch.key()}"
        ops = float_ops(kernel.asm["ptx"])
        if launch.kernel.__name__ != "_check_kernel":  # the check compares; the optimizers compute
            assert ops, "no floating-point instruction found: the PTX pattern no longer matches"
        assert bitwise_violations(ops) == [], launch.key()


def test_the_rounding_check_rejects_what_breaks_bitwise_agreement() -> None:
    """The checker itself, on instructions written out by hand (each is one way the bits could change)."""
    good = {"add.rn.f32", "mul.rn.f32", "sub.rn.f32", "div.rn.f32", "sqrt.rn.f32", "cvt.rn.f16.f32", "cvt.f32.bf16"}
    assert bitwise_violations(good) == []
    for bad in ("fma.rn.f32", "add.f32", "mul.ftz.f32", "div.full.f32", "sqrt.approx.f32", "cvt.rz.f16.f32"):
        assert bitwise_violations({bad}), bad
    assert bitwise_violations({"cvt.rn.bf16.f32"})


def test_compiling_with_fp_fusion_on_is_caught(launches: list[Launch]) -> None:
    """The check can fail: the Adam kernel built without ``enable_fp_fusion=False`` contracts into FMAs."""
    adam = next(launch for launch in launches if launch.kernel.__name__ == "_adam_kernel")
    fused = Launch(adam.kernel, adam.args, {**adam.kwargs, "enable_fp_fusion": True})
    ops = float_ops(_compile(fused, 90).asm["ptx"])
    assert any(problem.startswith("fma.") for problem in bitwise_violations(ops))
