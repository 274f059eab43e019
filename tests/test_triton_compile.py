"""The Triton master-step kernels compiled for NVIDIA GPUs (sm_80, sm_90) on a machine without one.

``test_master_kernels.py``, ``test_remainder_masters.py`` and ``test_dial_kernels.py`` check the kernels'
arithmetic bit for bit on CPU, through Triton's interpreter. The interpreter compiles nothing, so a kernel it runs
may still fail to build for a GPU, or build with different rounding. Triton's ahead-of-time compiler needs no GPU:
it lowers a kernel to PTX and assembles it with the ``ptxas`` its wheel ships. Here every specialisation the launch
code produces (the launches are captured from the public functions of ``ampinit._masters.triton_kernels`` and of
the precision dial's ``triton_dial``, not restated) is compiled for an A100 (sm_80) and an H100 (sm_90), and its
PTX is checked for what the bitwise agreement with the reference rests on. The rules cover the floating-point
instructions (``float_ops``), each for a reason:

- ``fma``/``mad``: none; every fp32 ``add``/``sub``/``mul`` carries an explicit rounding mode (``.rn``): the PTX
  ISA lets ``ptxas`` contract only the instructions without one into an FMA, and the reference rounds each product;
- ``div``/``sqrt`` (and ``rcp``/``rsqrt``): the correctly rounded ``.rn`` forms, not approximations;
- no ``.ftz`` on any of them: flushing subnormals to zero is not what torch does on CPU;
- ``max``/``min`` on floats: the ``.NaN`` forms. The dial's 8-bit absmax is a maximum, the reference's is torch's
  ``amax``, which returns NaN for a block that holds one (plain ``max.f32`` returns the other operand);
- ``cvt`` fp32 -> fp16 rounds to nearest even (``.rn``); fp32 -> bf16 is the kernels' own integer rounding
  (nearest even for the fp32 masters' half weights, stochastic for the dial's bf16 weights and moments), so no
  float conversion to bf16 appears at all.

What the dial adds beyond the fp32 arithmetic is integer and bit work: the random bits (``mix32``: ``xor``,
``shr``, ``mul.lo``), stochastic rounding and the remainders (``add``/``shr.s32`` on the fp32 pattern read as
int32), widening bf16 and 8-bit remainders back to fp32 (``shl``/bit casts: ``mov``), and the 8-bit code's search
(float ``setp`` compares, ``selp``, table loads). No rounding mode exists for those: integer instructions and float
comparisons are exact on every target, so what they give is fixed by their operand types, the same ones the
interpreter runs with; they need no rule here and are checked bit for bit by the interpreter tests.

Whole blocks of tensors that all start on 16 bytes must move in vector loads and stores, and a launch over a tensor
off that boundary must have none (a vector access there faults); for the dial the vector bytes are counted against
the bytes of the lists each launch was given.

The compiled code is not run: that needs a GPU (``scripts/gpu_check.sh``, docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit._masters import precision
from ampinit._masters.reference import AdamSettings, Masters, Moments, SgdSettings

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

TARGETS = [80, 90]  # compute capabilities: A100, H100
LAUNCH_OPTIONS = ("enable_fp_fusion", "enable_reflect_ftz", "num_warps", "num_stages")
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.float64: "*fp64",
}


@dataclass
class Launch:
    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: A dial launch's bytes per element read and written in its data lists, from the tensors it was given.
    moves: tuple[int, int] | None = None

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
            elif getattr(param, "annotation_type", ""):
                signature[param.name] = param.annotation_type  # a typed parameter: ``lr: tl.float64``
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


def _private_copy(module: ModuleType, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(str(module.__file__)))
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


@pytest.fixture(scope="module")
def compiled_modules() -> tuple[ModuleType, ModuleType]:
    """Private copies of ``ampinit._masters.triton_kernels`` and ``triton_dial`` decorated for the compiler, whatever
    TRITON_INTERPRET says; the dial's copy takes its jit helpers from the kernels' copy, not from the package.

    The interpreter tests reload the package's modules with the interpreter on; copies of our own leave theirs be.
    """
    import ampinit._masters.triton_dial as dial
    import ampinit._masters.triton_kernels as kernels

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        kernels_copy = _private_copy(kernels, "_ampinit_triton_master_compiled")
        monkeypatch.setitem(sys.modules, kernels.__name__, kernels_copy)
        dial_copy = _private_copy(dial, "_ampinit_triton_dial_compiled")
    return kernels_copy, dial_copy


SIZES = (3, 2048)
KEYS = torch.zeros(len(SIZES), dtype=torch.int64)


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in SIZES]


def _misaligned(dtype: torch.dtype) -> list[torch.Tensor]:
    """Contiguous tensors starting one element past a 16-byte boundary (views into a flat buffer can)."""
    return [torch.zeros(n + 1, dtype=dtype)[1:] for n in SIZES]


def _masters(storage: str) -> Masters:
    if storage == "fp32":
        return Masters.fp32(_tensors(torch.float32))
    if storage == "remainder":
        return Masters.remainder(_tensors(torch.bfloat16), _tensors(torch.int16))
    if storage == "remainder8":
        return Masters.remainder8(_tensors(torch.bfloat16), _tensors(torch.int8), KEYS)
    if storage == "stochastic":
        return Masters.stochastic(_tensors(torch.bfloat16), KEYS)
    weight_dtype = {"fp32+fp16": torch.float16, "fp32+bf16": torch.bfloat16}[storage]
    return Masters.fp32(_tensors(torch.float32), _tensors(weight_dtype))


def _moments(fmt: str, *, signed: bool) -> Moments:
    if fmt == "fp32":
        return Moments.fp32(_tensors(torch.float32))
    if fmt == "bf16":
        return Moments.bf16(_tensors(torch.bfloat16), KEYS)
    absmax = [torch.zeros(precision.absmax_blocks(n)) for n in SIZES]
    return Moments.eight_bit(_tensors(torch.uint8), absmax, precision.QuantMap.build(signed))


STORAGES = ["fp32", "fp32+fp16", "fp32+bf16", "remainder"]
DIAL_STORAGES = [*STORAGES, "remainder8", "stochastic"]
FORMATS = ["fp32", "bf16", "8bit"]
GRADS = [torch.float32, torch.float16, torch.bfloat16]
STEPS = torch.zeros(len(SIZES), 2)  # the step scalars, one row per tensor


def _record(module: ModuleType, kernels: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    launches: list[Launch] = []
    for name in kernels:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    return launches


def _master_launches(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every specialisation ``triton_kernels`` launches, captured from its public functions."""
    launches = _record(module, ("_adam_kernel", "_sgd_kernel", "_check_kernel"), monkeypatch)
    flag, inv_scale = torch.zeros(1), torch.ones(1)
    for grad in GRADS:
        module.check_finite_(_tensors(grad), flag)
        for storage in STORAGES:
            adamw = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
            moments = _tensors(torch.float32), _tensors(torch.float32)
            module.adam_(_tensors(grad), _masters(storage), *moments, STEPS, adamw, inv_scale=inv_scale, found_inf=flag)
            sgd = SgdSettings(0.1, 0.9, 0.0, False, 1e-4, False)
            buffers = _tensors(torch.float32)
            scaling = {"inv_scale": inv_scale, "found_inf": flag}
            module.sgd_(_tensors(grad), _masters(storage), buffers, sgd, first_step=False, **scaling)
    # The remaining constant branches, once each, on bf16 grads and bf16 weights (O5's case).
    for decay, decoupled in ((0.0, False), (0.01, False)):
        adam = AdamSettings(1e-3, 0.9, 0.999, 1e-8, decay, decoupled, True)
        moments = _tensors(torch.float32), _tensors(torch.float32)
        module.adam_(_tensors(torch.bfloat16), _masters("fp32+bf16"), *moments, STEPS, adam)
    for momentum, nesterov, first_step, decay in ((0.9, True, True, 0.0), (0.0, False, False, 0.0)):
        sgd = SgdSettings(0.1, momentum, 0.0, nesterov, decay, True)
        buffers = _tensors(torch.float32) if momentum else []
        module.sgd_(_tensors(torch.bfloat16), _masters("fp32+bf16"), buffers, sgd, first_step=first_step)
    # Tensors off a 16-byte boundary: the launches that must not claim alignment.
    module.check_finite_(_misaligned(torch.bfloat16), flag)
    adamw = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    moments = _tensors(torch.float32), _tensors(torch.float32)
    module.adam_(_misaligned(torch.bfloat16), _masters("fp32+bf16"), *moments, STEPS, adamw)
    weights = Masters.fp32(_misaligned(torch.float32), _tensors(torch.bfloat16))
    module.sgd_(
        _tensors(torch.bfloat16),
        weights,
        _tensors(torch.float32),
        SgdSettings(0.1, 0.9, 0.0, False, 0.0, False),
        first_step=False,
    )
    return launches


def _dial_launches(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every specialisation ``triton_dial`` launches, captured from its public functions."""
    launches = _record(module, ("_adam_dial_kernel", "_sgd_dial_kernel"), monkeypatch)
    scaling = {"inv_scale": torch.ones(1), "found_inf": torch.zeros(1)}
    adamw = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    sgd = SgdSettings(0.1, 0.9, 0.0, False, 1e-4, False)

    def adam_(
        grad: torch.dtype,
        storage: str,
        fmt: str,
        settings: AdamSettings,
        grads: list[torch.Tensor] | None = None,
        **kwargs: torch.Tensor,
    ) -> None:
        grads = _tensors(grad) if grads is None else grads
        masters, moments = _masters(storage), [_moments(fmt, signed=True), _moments(fmt, signed=False)]
        module.adam_dial_(grads, masters, *moments, STEPS, settings, **kwargs)
        launches[-1].moves = _moves(grads, masters, moments, moments)

    def sgd_(
        grad: torch.dtype,
        storage: str,
        fmt: str,
        settings: SgdSettings,
        first_step: bool,
        buffers: Moments | None = None,
        **kwargs: torch.Tensor,
    ) -> None:
        if buffers is None:
            buffers = _moments(fmt, signed=True) if settings.momentum else Moments.fp32([])
        grads, masters = _tensors(grad), _masters(storage)
        module.sgd_dial_(grads, masters, buffers, settings, first_step=first_step, **kwargs)
        launches[-1].moves = _moves(grads, masters, [] if first_step else [buffers], [buffers])

    # Every storage with every moment format, as the interpreter tests run them (tests/test_dial_kernels.py).
    for storage in DIAL_STORAGES:
        for fmt in FORMATS:
            adam_(torch.bfloat16, storage, fmt, adamw, **scaling)
            sgd_(torch.bfloat16, storage, fmt, sgd, False, **scaling)
    # The grad's dtype is read by the grad's load alone, which is triton_kernels' own: each once, on the dial's
    # own storages.
    for grad in (torch.float32, torch.float16):
        adam_(grad, "remainder8", "8bit", adamw, **scaling)
        sgd_(grad, "stochastic", "bf16", sgd, False, **scaling)
    # The remaining constant branches, once each, unscaled and maximizing.
    for decay, decoupled in ((0.0, False), (0.01, False)):
        adam_(torch.bfloat16, "remainder8", "8bit", AdamSettings(1e-3, 0.9, 0.999, 1e-8, decay, decoupled, True))
    for momentum, nesterov, first_step, decay in ((0.9, True, True, 0.0), (0.0, False, False, 0.0)):
        sgd_(torch.bfloat16, "stochastic", "8bit", SgdSettings(0.1, momentum, 0.0, nesterov, decay, True), first_step)
    # Lists off a 16-byte boundary, the launches that must not claim it: the grads; the 8-bit codes, one byte off.
    adam_(torch.bfloat16, "remainder8", "8bit", adamw, _misaligned(torch.bfloat16), **scaling)
    absmax = [torch.zeros(precision.absmax_blocks(n)) for n in SIZES]
    codes = Moments.eight_bit(_misaligned(torch.uint8), absmax, precision.QuantMap.build(True))
    sgd_(torch.bfloat16, "stochastic", "8bit", sgd, False, codes, **scaling)
    return launches


def _element_size(tensors: list[torch.Tensor]) -> int:
    return tensors[0].element_size() if tensors else 0


def _moves(grads: list[torch.Tensor], masters: Masters, read: list[Moments], written: list[Moments]) -> tuple[int, int]:
    """Bytes per element a dial launch reads and writes in its data lists: the grad, the master's storage (fp32
    masters: read alone, written with the half weights) and the values of the moments ``read`` and ``written``
    (the 8-bit absmax, one fp32 per 256 elements, is not a data list)."""
    if masters.kind == "fp32":
        master_read = _element_size(masters.masters)
        master_written = master_read + _element_size(masters.weights)
    else:
        master_read = master_written = _element_size(masters.weights) + _element_size(masters.remainders)
    read_bytes = _element_size(grads) + master_read + sum(_element_size(m.values) for m in read)
    return read_bytes, master_written + sum(_element_size(m.values) for m in written)


def _unique(launches: list[Launch]) -> list[Launch]:
    unique: dict[str, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


@pytest.fixture(scope="module")
def launches(compiled_modules: tuple[ModuleType, ModuleType]) -> list[Launch]:
    kernels, _ = compiled_modules
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _unique(_master_launches(kernels, monkeypatch))


@pytest.fixture(scope="module")
def dial_launches(compiled_modules: tuple[ModuleType, ModuleType]) -> list[Launch]:
    _, dial = compiled_modules
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _unique(_dial_launches(dial, monkeypatch))


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


FLOAT_OPS = re.compile(r"\b((?:add|sub|mul|fma|mad|div|sqrt|rcp|rsqrt|cvt|max|min)(?:\.[A-Za-z0-9]+)*)\b")


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
        if name in ("fma", "mad"):
            problems.append(f"{op}: a fused multiply-add (the reference rounds the product)")
        elif "ftz" in modifiers:
            problems.append(f"{op}: flushes subnormals to zero (torch keeps them)")
        elif name in ("add", "sub", "mul") and "f32" in modifiers and "rn" not in modifiers:
            problems.append(f"{op}: no explicit rounding mode, so ptxas may contract it into an FMA")
        elif name in ("div", "sqrt", "rcp", "rsqrt") and "rn" not in modifiers:
            problems.append(f"{op}: not correctly rounded")
        elif name in ("max", "min") and "NaN" not in modifiers:
            problems.append(f"{op}: drops a NaN operand (torch's amax and maximum return NaN)")
        elif name == "cvt" and parts[-1] == "f32" and ({"f16", "bf16"} & modifiers) and "rn" not in modifiers:
            problems.append(f"{op}: a narrowing conversion that does not round to nearest even")
        elif name == "cvt" and "bf16" in modifiers and parts[-1] == "f32":
            problems.append(f"{op}: fp32 -> bf16 is the kernels' own integer rounding, not a float conversion")
    return problems


def _constants(launches: list[Launch], kernel: str) -> dict[str, set[Any]]:
    """Per constexpr of ``kernel``, the values its captured launches give it."""
    values: dict[str, set[Any]] = {}
    for launch in launches:
        if launch.kernel.__name__ == kernel:
            for name, value in launch.signature()[1].items():
                values.setdefault(name, set()).add(value)
    return values


def _assert_both_ways(launches: list[Launch], kernel: str) -> None:
    """Every boolean constexpr of ``kernel`` is captured true and false (a new flag is caught untoggled), those
    that only a momentum buffer reads among the launches that have one."""
    momentum = [launch for launch in launches if launch.kwargs.get("HAS_MOMENTUM")]
    for name, values in _constants(launches, kernel).items():
        if isinstance(next(iter(values)), bool):
            assert values == {False, True}, (kernel, name)
            if name in ("FIRST_STEP", "NESTEROV"):
                assert _constants(momentum, kernel)[name] == {False, True}, (kernel, name)
    assert all(launch.kwargs["enable_fp_fusion"] is False for launch in launches if launch.kernel.__name__ == kernel)


def test_every_kernel_and_branch_is_captured(launches: list[Launch]) -> None:
    names = {launch.kernel.__name__ for launch in launches}
    assert names == {"_adam_kernel", "_sgd_kernel", "_check_kernel"}
    storages = {launch.kwargs.get("STORAGE") for launch in launches if "STORAGE" in launch.kwargs}
    assert storages == {0, 1, 2}
    assert {launch.kwargs.get("DECAY") for launch in launches if "DECAY" in launch.kwargs} == {0, 1, 2}
    for kernel in ("_adam_kernel", "_sgd_kernel"):
        _assert_both_ways(launches, kernel)


def test_every_dial_kernel_and_branch_is_captured(
    dial_launches: list[Launch], compiled_modules: tuple[ModuleType, ModuleType]
) -> None:
    _, dial = compiled_modules
    kinds = {*dial._KINDS.values(), 1}  # 1: fp32 masters with half weights, the launch's own value
    storages = set(itertools.product(kinds, dial._FORMATS.values()))
    assert {launch.kernel.__name__ for launch in dial_launches} == {"_adam_dial_kernel", "_sgd_dial_kernel"}
    for kernel in ("_adam_dial_kernel", "_sgd_dial_kernel"):
        ours = [launch for launch in dial_launches if launch.kernel.__name__ == kernel]
        assert {(launch.kwargs["KIND"], launch.kwargs["FMT"]) for launch in ours} == storages, kernel
        assert {str(launch.kwargs["WEIGHT_T"]) for launch in ours if launch.kwargs["KIND"] == 1} == {"fp16", "bf16"}
        assert {str(dtype) for dtype in _constants(ours, kernel)["GRAD_T"]} == {"fp32", "fp16", "bf16"}
        _assert_both_ways(ours, kernel)
    assert _constants(dial_launches, "_adam_dial_kernel")["DECAY"] == {0, 1, 2}


def _assert_compiles_with_the_references_rounding(launch: Launch, capability: int, computes: bool = True) -> set[str]:
    kernel = _compile(launch, capability)
    assert kernel.asm.get("cubin"), f"ptxas produced no cubin for {launch.key()}"
    ops = float_ops(kernel.asm["ptx"])
    if computes:
        assert ops, "no floating-point instruction found: the PTX pattern no longer matches"
    assert bitwise_violations(ops) == [], launch.key()
    return ops


CAPABILITIES = [pytest.param(c, id=f"sm_{c}") for c in TARGETS]


@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_kernels_compile_for_the_gpu_with_the_references_rounding(launches: list[Launch], capability: int) -> None:
    for launch in launches:
        # The check compares; the optimizers compute.
        _assert_compiles_with_the_references_rounding(launch, capability, launch.kernel.__name__ != "_check_kernel")


VECTOR_ACCESS = re.compile(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*\.v[248]\.")


@pytest.mark.slow
def test_whole_blocks_of_aligned_tensors_move_16_bytes_per_access(launches: list[Launch]) -> None:
    """An update launch over tensors that all start on 16 bytes reads and writes whole blocks with vector accesses
    (as torch's fused optimizers do; one element per access wastes most of an instruction's reach), and the finite
    check reads them so (it stores only the flag); one over a tensor off that boundary has none, since a vector
    access there faults. Before, no launch had any; the check had none until the twelfth session."""
    for kernel in ("_adam_kernel", "_sgd_kernel", "_check_kernel"):
        assert {launch.kwargs["ALIGNED"] for launch in launches if launch.kernel.__name__ == kernel} == {False, True}
    for launch in launches:
        ptx = _compile(launch, 90).asm["ptx"]
        vectors = VECTOR_ACCESS.findall(ptx)
        if not launch.kwargs["ALIGNED"]:
            assert vectors == [], launch.key()
        elif launch.kernel.__name__ == "_check_kernel":
            assert any(v.startswith("ld") for v in vectors), launch.key()
        else:
            assert any(v.startswith("ld") for v in vectors) and any(v.startswith("st") for v in vectors), launch.key()


VECTOR_BYTES = re.compile(r"\b(ld|st)\.global(?:\.[A-Za-z0-9_:]+)*?\.v([248])\.[a-z]+(\d+)\b")


def vector_bytes(ptx: str) -> dict[str, int]:
    """The bytes one thread moves in the vector loads (``ld``) and stores (``st``) of ``ptx``."""
    moved = {"ld": 0, "st": 0}
    for op, lanes, bits in VECTOR_BYTES.findall(ptx):
        moved[op] += int(lanes) * int(bits) // 8
    return moved


@pytest.mark.slow
def test_whole_blocks_of_aligned_dial_lists_move_in_vector_accesses(dial_launches: list[Launch]) -> None:
    """A dial launch whose lists all start on 16 bytes moves every byte of a whole block's grads, master storage
    and moment values in vector accesses: per thread, its elements times the bytes per element of the lists the
    launch was given (16 bytes an access for 4- and 2-byte lists, 8 for the 1-byte codes and remainders, of which
    a thread holds 8). One over a list off that boundary has none (a vector access there faults). Before, no dial
    launch had any."""
    assert {launch.kwargs["ALIGNED"] for launch in dial_launches} == {False, True}
    for launch in dial_launches:
        kernel = _compile(launch, 90)
        moved = vector_bytes(kernel.asm["ptx"])
        if launch.kwargs["ALIGNED"]:
            assert launch.moves is not None
            per_thread = launch.kwargs["BLOCK"] // (32 * kernel.metadata.num_warps)
            read, written = launch.moves
            assert moved == {"ld": per_thread * read, "st": per_thread * written}, launch.key()
        else:
            assert moved == {"ld": 0, "st": 0}, launch.key()


def test_vector_bytes_reads_the_access_widths() -> None:
    ptx = [
        "@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];",
        "ld.global.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];",
        "ld.global.b32 %r7, [ %rd3 + 0 ];",
        "st.global.L1::evict_first.v4.b16 [ %rd4 + 0 ], { %rs1, %rs2, %rs3, %rs4 };",
        "ld.global.b64 %rd5, [ %rd6 + 0 ];",
    ]
    assert vector_bytes("\n\t".join(ptx)) == {"ld": 16 + 8, "st": 8}


DIAL_LISTS = ["grads", "weights", "remainders", "exp_avg", "exp_avg absmax", "exp_avg_sq", "exp_avg_sq absmax"]


@pytest.mark.parametrize("off_boundary", [None, *DIAL_LISTS])
def test_a_dial_launch_claims_alignment_only_when_every_list_has_it(
    compiled_modules: tuple[ModuleType, ModuleType], off_boundary: str | None
) -> None:
    """``ALIGNED`` (16-byte vector accesses) is claimed only when every list of the launch starts on 16 bytes: each
    list of an AdamW launch over 24-bit masters and 8-bit moments, one element off that boundary, withdraws it."""
    _, dial = compiled_modules

    def made(name: str, sizes: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return [
            torch.zeros(n + 1, dtype=dtype)[1:] if name == off_boundary else torch.zeros(n, dtype=dtype) for n in sizes
        ]

    def moment(name: str, signed: bool) -> Moments:
        absmax = made(f"{name} absmax", tuple(precision.absmax_blocks(n) for n in SIZES), torch.float32)
        return Moments.eight_bit(made(name, SIZES, torch.uint8), absmax, precision.QuantMap.build(signed))

    masters = Masters.remainder8(made("weights", SIZES, torch.bfloat16), made("remainders", SIZES, torch.int8), KEYS)
    adamw = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = _record(dial, ("_adam_dial_kernel",), monkeypatch)
        grads = made("grads", SIZES, torch.bfloat16)
        dial.adam_dial_(grads, masters, moment("exp_avg", True), moment("exp_avg_sq", False), STEPS, adamw)
    assert [launch.kwargs["ALIGNED"] for launch in launches] == [off_boundary is None]


@pytest.mark.slow
# The H100 (the GPU this project is checked on) only: the fp32 kernels' two targets lower these operations alike,
# and the dial's 44 specialisations for sm_80 too would add some 40 s to a cold run of the suite.
@pytest.mark.parametrize("capability", [pytest.param(90, id="sm_90")])
def test_dial_kernels_compile_for_the_gpu_with_the_references_rounding(
    dial_launches: list[Launch], capability: int
) -> None:
    for launch in dial_launches:
        ops = _assert_compiles_with_the_references_rounding(launch, capability)
        if launch.kwargs["FMT"] == 2 and launch.kwargs.get("HAS_MOMENTUM", True):
            # The 8-bit absmax is a float maximum: seen, so the NaN rule has something to check.
            assert any(op.startswith("max.") for op in ops), launch.key()


def test_the_rounding_check_rejects_what_breaks_bitwise_agreement() -> None:
    """The checker itself, on instructions written out by hand (each is one way the bits could change)."""
    good = {"add.rn.f32", "mul.rn.f32", "sub.rn.f32", "div.rn.f32", "sqrt.rn.f32", "cvt.rn.f16.f32", "cvt.f32.bf16"}
    assert bitwise_violations(good | {"max.NaN.f32", "abs.f32"}) == []
    bad = ["fma.rn.f32", "mad.rn.f32", "add.f32", "mul.ftz.f32", "mul.rn.ftz.f32", "div.full.f32", "sqrt.approx.f32"]
    for op in [*bad, "div.rn.ftz.f32", "cvt.rz.f16.f32", "cvt.rn.bf16.f32", "max.f32", "min.f32"]:
        assert bitwise_violations({op}), op
    # Integer work (the random bits, stochastic rounding, the 8-bit code search) is exact: not a float op.
    ptx = "mul.lo.s32 %r2, %r1, 2146121005;\n\tmax.s32 %r3, %r2, %r1;\n\tmad.wide.s32 %rd2, %r3, 4, %rd1;\n\t"
    assert float_ops(ptx + "max.NaN.f32 %f2, %f1, %f0;") == {"max.NaN.f32"}


@pytest.mark.parametrize("kernel", ["_adam_kernel", "_adam_dial_kernel"])
def test_compiling_with_fp_fusion_on_is_caught(
    launches: list[Launch], dial_launches: list[Launch], kernel: str
) -> None:
    """The check can fail: an Adam kernel built without ``enable_fp_fusion=False`` contracts into FMAs."""
    adam = next(launch for launch in [*launches, *dial_launches] if launch.kernel.__name__ == kernel)
    fused = Launch(adam.kernel, adam.args, {**adam.kwargs, "enable_fp_fusion": True})
    ops = float_ops(_compile(fused, 90).asm["ptx"])
    assert any(problem.startswith("fma.") for problem in bitwise_violations(ops))


# -- Apex's fp32 gelu on a half input (ampinit._casting.triton_gelu) -----------------------------------------------
@pytest.fixture(scope="module")
def gelu_launches(compiled_modules: tuple[ModuleType, ModuleType]) -> list[Launch]:
    """Every launch of ``triton_gelu``'s public functions, each variant and half dtype, in a private copy built for
    the compiler on the kernels' copy, with the libdevice functions a CUDA tensor gets."""
    import ampinit._casting.triton_gelu as gelu

    kernels, _ = compiled_modules
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setitem(sys.modules, "ampinit._masters.triton_kernels", kernels)
        module = _private_copy(gelu, "_ampinit_triton_gelu_compiled")
        monkeypatch.setattr(module, "_libdevice", lambda x: True)
        launches = _record(module, ("_forward_kernel", "_backward_kernel"), monkeypatch)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.zeros(2048, dtype=dtype)
            for variant in module.FORWARD_VARIANTS:
                module.forward(x, variant)
            for variant in module.BACKWARD_VARIANTS:
                module.backward(torch.zeros(2048), x, variant)
                module.backward(torch.zeros(2048), x, variant, torch.float32)  # the check's unrounded slope
    return launches


def _compile_as_launched(launch: Launch, capability: int) -> Any:
    """As ``_compile``, with what Triton's launcher adds for these arguments: that each pointer starting on 16
    bytes, and each integer divisible by 16, is (the gelu kernels take their tensors directly, not by a table)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = launch.signature()
    params = launch.kernel.params
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, value in enumerate(launch.args)
        if not params[index].is_constexpr
        and (
            (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (type(value) is int and value % 16 == 0)
        )
    }
    options = {k: v for k, v in launch.kwargs.items() if k in LAUNCH_OPTIONS}
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


@pytest.mark.slow
def test_the_gelu_kernels_compile_for_the_gpu_with_cudas_math_functions(gelu_launches: list[Launch]) -> None:
    """Each variant builds for an H100 with libdevice's erff/expf linked in (the functions nvcc's ``::erf`` and
    ``expf`` are; their bits are checked on the GPU itself, fused_gelu's check), moves whole blocks in vector
    accesses, and rounds fp32 -> bf16 by the kernels' integer rounding, fp32 -> fp16 to nearest even."""
    assert len(gelu_launches) == 2 * (2 + 4 + 4)
    assert {launch.signature()[1]["LIBDEVICE"] for launch in gelu_launches} == {True}
    for launch in gelu_launches:
        kernel = _compile_as_launched(launch, 90)
        assert kernel.asm.get("cubin"), launch.key()
        ptx = kernel.asm["ptx"]
        assert "%__nv_erff" in ptx and not re.search(r"\bcall(\.uni)?\s", ptx), "libdevice's erff is not inlined"
        vectors = VECTOR_ACCESS.findall(ptx)
        assert any(v.startswith("ld") for v in vectors) and any(v.startswith("st") for v in vectors), launch.key()
        narrowing = {op for op in float_ops(ptx) if op.startswith("cvt") and op.endswith(".f32")}
        assert not any(".f16." in op for op in narrowing) or launch.args[2].dtype == torch.float16
        assert not any("bf16" in op for op in narrowing), narrowing
        assert all(".rn." in op for op in narrowing if ".f16." in op), narrowing
        # Subnormals kept, as torch's build keeps them: Triton's default (``enable_reflect_ftz``) has libdevice
        # take its flush-to-zero branches, where exp(-x*x/2) for |x| past about 13 is 0 instead of subnormal.
        assert launch.kwargs.get("enable_reflect_ftz") is False, launch.key()


def _flushing_ops(ptx: str) -> list[str]:
    """The PTX instructions that flush subnormals to zero (``.ftz``)."""
    return re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*\b", ptx)


@pytest.mark.slow
def test_the_gelu_kernels_keep_subnormals_where_triton_would_flush_them(gelu_launches: list[Launch]) -> None:
    """What ``enable_reflect_ftz=False`` changes in the built code: libdevice's flushing branches (``fma.rn.ftz``,
    ``abs.ftz``...) are gone. libdevice's non-flushing erff/expf keep ``ex2.approx.ftz`` inside, in both modes;
    that one is allowed, and the launch built with Triton's default shows the flushing ones (the check can fail)."""
    for launch in gelu_launches:
        kept = _flushing_ops(_compile_as_launched(launch, 90).asm["ptx"])
        assert set(kept) <= {"ex2.approx.ftz.f32"}, (launch.key(), sorted(set(kept)))
        flushing = Launch(launch.kernel, launch.args, {**launch.kwargs, "enable_reflect_ftz": True})
        flushed = _flushing_ops(_compile_as_launched(flushing, 90).asm["ptx"])
        assert "fma.rn.ftz.f32" in flushed, (launch.key(), sorted(set(flushed)))


# -- Adam's step scalars (triton_kernels.step_scalars_) --------------------------------------------------------------
@pytest.fixture(scope="module")
def scalar_launches(compiled_modules: tuple[ModuleType, ModuleType]) -> list[Launch]:
    """The step-scalars launches, captured from ``step_scalars_``: without a flag (FusedAdam's counts), and with one
    over fp32 counts (torch's fused groups) and float64 ones (torch's other groups under a float64 default dtype)."""
    kernels, _ = compiled_modules
    powers = torch.rand(2, 40, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = _record(kernels, ("_step_scalars_kernel",), monkeypatch)
        kernels.step_scalars_(powers, 1e-3)
        for dtype in (torch.float32, torch.float64):
            kernels.step_scalars_(powers, 1e-3, torch.ones(40, dtype=dtype), torch.zeros(1))
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_step_scalars_compile_with_the_float64_rounding_of_torchs_ops(
    scalar_launches: list[Launch], capability: int
) -> None:
    """What the bits of ``step_scalars_`` against torch's ops (``rsub``, ``reciprocal``, ``mul`` by lr, ``sqrt``, each
    in float64, then rounded to fp32) rest on, where the interpreter's NumPy is IEEE by construction: the float64
    division and square root correctly rounded, every float64 add, subtract and multiply with an explicit rounding
    mode (no contraction), no fused multiply-add, round-to-nearest-even narrowing to fp32, and lr passed as a
    float64 (Triton passes an unannotated Python float as fp32, which would round lr first)."""
    assert {launch.signature()[1]["HAS_FLAG"] for launch in scalar_launches} == {False, True}
    for launch in scalar_launches:
        assert launch.signature()[0]["lr"] == "fp64"
        ops = _assert_compiles_with_the_references_rounding(launch, capability)
        assert {"div.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64"} <= ops, sorted(ops)
        unrounded = [op for op in ops if op.split(".")[0] in ("add", "sub", "mul") and ".rn." not in op]
        assert unrounded == [], unrounded
        assert re.search(r"\.param \.f64 \w+_param_5", _compile(launch, capability).asm["ptx"]), launch.key()


@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_advancing_step_scalars_compile_with_libdevices_pow(
    compiled_modules: tuple[ModuleType, ModuleType], capability: int
) -> None:
    """The CUDA launch of the counts' advance, their powers and the step scalars (``advance_step_scalars_``, which
    refuses CPU tensors: built here as it launches): the powers by libdevice's float64 ``pow`` inlined (``__nv_pow``,
    the function torch's CUDA ``pow`` calls, whose bits the GPU check compares), the rest with the rounding of
    torch's ops as in the launch after torch's ``pow``, and the counts advanced by a rounded add in their dtype."""
    kernels, _ = compiled_modules
    betas = torch.tensor([0.9, 0.999], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        for flag in (True, False):
            args = (betas, torch.ones(40, dtype=dtype), torch.zeros(1), torch.empty(40, 2), 40, 1e-3)
            constants = {"HAS_FLAG": flag, "POW": True, "BLOCK": kernels._SCALARS_BLOCK}
            launch = Launch(kernels._step_scalars_kernel, args, {**constants, **kernels._POW_OPTIONS})
            assert launch.signature()[0]["lr"] == "fp64"
            ptx = _compile(launch, capability).asm["ptx"]
            # __nv_pow inlined (its exit label), calling libdevice's own __internal_accurate_pow and nothing else.
            assert "%__nv_pow.exit" in ptx, "libdevice's pow is not in the kernel"
            called = set(re.findall(r"\bcall(?:\.uni)?\s+(?:\(\w+\),\s*)?(\w+)", ptx))
            assert called <= {"__internal_accurate_pow"}, called
            ops = float_ops(ptx)
            assert {"div.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64"} <= ops, sorted(ops)
            if dtype == torch.float32:  # the counts' advance: a rounded float32 add (float64 adds are the powers')
                assert "add.rn.f32" in ops, sorted(ops)


# -- A dynamic loss scale's update (triton_kernels.update_scale_) ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_scale_update_compiles_with_the_rounding_of_torchs_ops(
    compiled_modules: tuple[ModuleType, ModuleType], capability: int
) -> None:
    """What the scale update's bits against ``_amp_update_scale_``, ``clamp_`` and ``reciprocal`` rest on, where
    the interpreter's NumPy is IEEE by construction: the factors passed as float64 (torch's kernels multiply the
    fp32 scale by a double), the products rounded (``mul.rn.f64``) and narrowed to nearest (``cvt.rn.f32.f64``),
    the reciprocal a correctly rounded division (``div.rn.f32``), no fused multiply-add; with and without a
    floor, launched as ``update_scale_`` launches it."""
    kernels, _ = compiled_modules
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = _record(kernels, ("_scale_update_kernel",), monkeypatch)
        for floor in (None, 1.0):
            scale, tracker = torch.tensor(4.0), torch.tensor(0, dtype=torch.int32)
            kernels.update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 2000, floor, 2.0**24)
    assert [launch.signature()[1]["HAS_MIN"] for launch in launches] == [False, True]
    for launch in launches:
        signature = launch.signature()[0]
        assert (signature["growth"], signature["backoff"]) == ("fp64", "fp64")
        ops = _assert_compiles_with_the_references_rounding(launch, capability)
        assert {"mul.rn.f64", "cvt.rn.f32.f64", "div.rn.f32"} <= ops, sorted(ops)
