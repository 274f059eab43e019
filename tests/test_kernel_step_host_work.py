"""The host work of amp's kernel master step (O2/O5 on CUDA), pinned without a clock: the aten ops one
``optimizer.step()`` runs through the kernel path, and the calls (Python functions and C functions called from
Python) of a whole steady-state iteration (``zero_grad``, a ``scale_loss`` block, ``step``), do not grow with the
number of parameter tensors.

The path is taken for CPU tensors (``kernels_on_cpu``) with every Triton launch a no-op, so what runs is exactly
the host side of a CUDA step (benchmarks/kernel_step_host.py times it). Ops are counted by torch's profiler, which
also sees the ops an op runs inside itself: a foreach op over 0-d CPU step counts (one dispatch seen by a
``TorchDispatchMode``) runs one ``add_`` per tensor, and ``stack`` one ``unsqueeze`` per tensor. Calls are counted
by ``sys.setprofile``, which sees every Python frame (a generator's resumption, ``Tensor.__hash__`` behind a dict
lookup) and every C function Python calls; a loop in C (``map``) is one call, as torch's own fused step is."""

from __future__ import annotations

import functools
import gc
import operator
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, GetSetDescriptorType, ModuleType
from typing import Any, TypeVar

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit
from ampinit import _overflow, amp
from ampinit._masters import kernel_step, reference
from benchmarks.kernel_step_host import cuda_unscale_rule
from tests._device import device_under_test
from tests._host_work import NoLaunch, aten_ops, third_step

_M = TypeVar("_M")

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")


@pytest.fixture(params=["cpu-rules", "cuda-rules"])
def no_launches(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[None]:
    """Every kernel launch a no-op; and under ``cuda-rules`` torch's unscale kernel refusing bf16 as CUDA's does and a
    dynamic scale decided on the device, so that the iteration takes the routes it takes on a GPU (on CPU the
    kernel takes bf16, and the host reads the flag)."""
    monkeypatch.setattr(kernels_on_cpu, "_adam_kernel", NoLaunch())
    monkeypatch.setattr(kernels_on_cpu, "_sgd_kernel", NoLaunch())
    monkeypatch.setattr(kernels_on_cpu, "_check_kernel", NoLaunch())
    monkeypatch.setattr(kernels_on_cpu, "_step_scalars_kernel", NoLaunch())
    monkeypatch.setattr(kernels_on_cpu, "_scale_update_kernel", NoLaunch())
    if request.param == "cpu-rules":
        yield
        return
    monkeypatch.setattr(_overflow, "DEVICE_DECIDES_ON_CPU", True)  # a dynamic scale decided as on a GPU
    with cuda_unscale_rule():
        yield


def _calls(step: Callable[[], None], within: str | None = None) -> int:
    """The calls (Python and C) made while ``step`` runs; ``within``: only the Python calls of functions of the files
    under that folder."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if within is None:
            count += event in ("call", "c_call")
        else:
            count += event == "call" and frame.f_code.co_filename.startswith(within)

    collecting = gc.isenabled()
    gc.disable()  # a collection's finalizers are calls of whatever it happens to free
    sys.setprofile(tracer)
    try:
        step()
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return count


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_kernel_step_runs_the_same_aten_ops_for_any_number_of_tensors(level: str, name: str) -> None:
    few, many = (third_step(level, n, aten_ops, OPTIMIZERS[name], loss_scale=1.0) for n in (8, 32))
    assert few == many


def steady_iterations(level: str, tensors: int, make_opt: Any, measure: Callable[[Callable[[], None]], _M]) -> list[_M]:
    """``measure`` of three steady-state iterations (the fourth to sixth) of an O2/O5 session over ``tensors`` half
    parameters, whose backward hands each parameter a grad (the same tensors every iteration, set by plain
    assignments)."""
    gen = torch.Generator().manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(tensors)])
    opt = make_opt(params.parameters())
    amp.initialize(params, opt, opt_level=level, verbosity=0)  # type: ignore[arg-type]
    session = amp.current_session()
    assert session is not None
    weights = list(params)
    grads = [torch.full_like(w, 0.01) for w in weights]
    anchor = torch.zeros((), requires_grad=True)

    def iteration() -> None:
        opt.zero_grad()
        with session.scale_loss(anchor * 1.0, opt) as scaled:
            scaled.backward()
            for w, g in zip(weights, grads):
                w.grad = g
        opt.step()

    try:
        for _ in range(3):
            iteration()
        return [measure(iteration) for _ in range(3)]
    finally:
        session.close()


def iteration_calls(level: str, tensors: int, make_opt: Any) -> int:
    # The least of three steady-state iterations: a one-time event of the process (a cache filled, a collection
    # of cycles running finalizers) lands in one of them, a per-tensor call in every one (seen once under torch
    # 2.14 in the full suite: 447 calls at 32 tensors against 443 at 8, equal when the test ran alone).
    return min(steady_iterations(level, tensors, make_opt, _calls))


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_steady_state_iteration_makes_the_same_calls_for_any_number_of_tensors(level: str, name: str) -> None:
    # torch's own zero_grad and the grads' hand-over loop are bytecode per tensor, no call: every call that grows
    # with the tensors would be amp's (on main: a genexpr per data pointer, Tensor.__hash__ per state lookup...).
    few, many = (iteration_calls(level, n, OPTIMIZERS[name]) for n in (8, 32))
    assert few == many


#: ampinit's own Python calls in one steady-state iteration (zero_grad, scale_loss's entry and exit, step) of 8
#: tensors, at the nineteenth session (Python 3.11, where a comprehension is a call of its own; 3.12 inlines list
#: comprehensions, so fewer there). About three fifths of amp's host time over torch's at GPT-2 small's 150 tensors
#: is paid once per iteration (docs/gpu.md, nineteenth session): this pins that part as the reads and launches
#: tests pin theirs. A change that adds calls raises the bound here, with its reason: +1 since the launch's tables
#: are made by a function of their own (``triton_kernels._prepare``), which a step of several launches calls for
#: every launch before the first, so that a refusal in a later one writes nothing (SGD +2: its kernel's list is found
#: by ``triton_kernels._sgd_lists``, which ``sgd_tables`` shares).
OWN_CALLS_PER_ITERATION = {
    ("O2", "adamw"): {"cpu-rules": 212, "cuda-rules": 231},
    ("O2", "adamw-fused"): {"cpu-rules": 212, "cuda-rules": 231},
    ("O2", "sgd"): {"cpu-rules": 213, "cuda-rules": 231},
    ("O5", "adamw"): {"cpu-rules": 211, "cuda-rules": 211},
    ("O5", "adamw-fused"): {"cpu-rules": 211, "cuda-rules": 211},
    ("O5", "sgd"): {"cpu-rules": 211, "cuda-rules": 211},
}


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_steady_state_iteration_makes_few_calls_of_amps_own(
    level: str, name: str, request: pytest.FixtureRequest
) -> None:
    own = functools.partial(_calls, within=os.path.dirname(ampinit.__file__))
    calls = min(steady_iterations(level, 8, OPTIMIZERS[name], own))
    assert calls <= OWN_CALLS_PER_ITERATION[level, name][request.node.callspec.params["no_launches"]]


class _TensorReads(TorchFunctionMode):
    """Counts, by name, the tensor properties read (``t.grad``, ``t.device``...) and the tensor methods called
    (``t.data_ptr()``...) while it is active: torch routes each through the active function mode."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        owner = getattr(func, "__self__", None)
        if isinstance(owner, GetSetDescriptorType):  # a property's __get__ or __set__
            self.reads[f"{owner.__name__}.{func.__name__}"] += 1
        else:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _tensor_reads(iteration: Callable[[], None]) -> Counter[str]:
    with _TensorReads() as mode:
        iteration()
    return mode.reads


#: What a steady-state iteration may read or set of each tensor (the half weights and their grads, the masters, the
#: optimizer state), every read or method that grows with the tensors; anything not listed may not grow at all.
#: grads: read by the scale_loss exit (the weight's and the master's, to tell a fresh backward, handed on to the
#: plan), by the step's check that the plan holds and by torch's zero_grad of a master; set by the loop handing them
#: over, amp's zero_grad and scale_loss entry of the weights, and the step's release of the masters'. Read once, by
#: the scale_loss exit: the grads' device, layout, contiguity and dtype (checked) and sizes (the finite check's
#: table, handed on to the step's); the masters' and weights' dtypes, devices, contiguity and sizes only when they
#: are not the tensors checked before at the same data pointers (kernel_step._checked). Data pointers: the exit
#: reads the masters', the weights' and the grads' (the memo, the finite check's table); the step reads them again
#: (a tensor given other memory in between must not be written through its old address) with the two moments'
#: (its table's key) and the step counts' (that they are still one tensor's). Until the seventeenth session: 27
#: reads and sets per tensor, now 22 (dtype 3 -> 1, device 2 -> 1, contiguity 3 -> 1, sizes 3 -> 1, data pointers
#: 7 -> 9; is_sparse became layout: strided, not only not sparse COO).
READS_PER_TENSOR = {
    "grad.__get__": 4,
    "grad.__set__": 4,
    "dtype.__get__": 1,
    "device.__get__": 1,
    "layout.__get__": 1,
    "is_contiguous": 1,
    "numel": 1,
    "data_ptr": 9,
}


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_steady_state_iteration_reads_each_tensor_a_few_times(level: str, name: str) -> None:
    # Deterministic (no clock): each read is a Python-visible step over every tensor, the unit of the iteration's
    # host time once every loop runs in C (benchmarks/kernel_step_host.py).
    _assert_few_reads(level, OPTIMIZERS[name])


def _two_groups(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    listed = list(params)
    half = len(listed) // 2
    return torch.optim.AdamW([{"params": listed[:half]}, {"params": listed[half:], "weight_decay": 0.0}], fused=True)


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_step_of_several_launches_reads_each_tensor_as_one_launch_does(level: str) -> None:
    # Two param groups, a launch each: their tables are made before the first launch (a refusal in the second
    # writes nothing) and handed to the launches, which read no tensor again.
    _assert_few_reads(level, _two_groups)


def _assert_few_reads(level: str, make_opt: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]) -> None:
    few, many = (functools.reduce(operator.and_, steady_iterations(level, n, make_opt, _tensor_reads)) for n in (8, 32))
    per_tensor = {key: (many[key] - few[key]) / 24 for key in many.keys() | few.keys() if many[key] != few[key]}
    assert all(per_tensor[key] <= READS_PER_TENSOR.get(key, 0) for key in per_tensor), per_tensor


_NO_LAUNCH = (torch.ops.aten.empty, torch.ops.aten.unbind)


class _Launches(TorchDispatchMode):
    """Counts the aten ops dispatched (outermost only) that would launch a kernel on a GPU: not views, not
    allocations (on a GPU host each launch costs ~5 us of host time, more than most of the step's Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func.namespace == "aten" and not func.is_view and func.overloadpacket not in _NO_LAUNCH:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _launching_ops(iteration: Callable[[], None]) -> Counter[str]:
    """The aten ops of ``iteration`` that launch a kernel, and its Triton launches (``"triton"``)."""
    before = NoLaunch.every
    with _Launches() as mode:
        iteration()
    mode.ops["triton"] = NoLaunch.every - before
    return mode.ops


#: Kernel launches of one steady-state iteration at the default dynamic scale: the aten ops that launch one (the few
#: of the test's loss and backward included; none grows with the tensors) and, since the sixteenth session, the
#: Triton launches (the finite check, the step; for Adam the step scalars). Adam's step scalars: torch's ``pow`` and
#: one Triton launch (``triton_kernels.step_scalars_``, which also takes the counts back by the flag), where the
#: fifteenth session's bound had five ops and the counts' ``sub_`` (ten ops before that). On CPU the host reads O2's
#: overflow flag (one ``_local_scalar_dense``, a sync on a GPU); under CUDA's rules the device decides instead (a
#: flag stays on the device for the skip). The grads' finite check is the Triton kernel at both levels, not an aten
#: op (one fewer than torch's unscale kernel by 1, which O2 took before the fourteenth session). Since the
#: eighteenth session no copy of O2's ``1/scale`` for the pending step (the update replaces the tensor instead of
#: writing it), no copy of the flag for the skip (the scaler lends it and writes a new one next), no ``add`` per
#: step for the skip count (``StepCounts`` sums its flags every ``FOLD`` steps: not among the iterations measured),
#: at O5's static scale no update kernel per exit (the clean-step count is folded every ``STATIC_FOLD``), and O2's
#: dynamic update, clamp and reciprocal in one Triton launch (``triton_kernels.update_scale_``). Since the
#: nineteenth session no fill for the new zero flag after a lent one (``LossScaler._zero_flag`` cuts them from a
#: buffer filled once per ``FLAG_POOL`` steps: not among the iterations measured); on CPU's rules O2's flag is not
#: lent (the host reads it) and is still cleared in place.
LAUNCHES_PER_ITERATION = {
    ("O2", "adamw"): {"cpu-rules": 14, "cuda-rules": 12},
    ("O2", "adamw-fused"): {"cpu-rules": 14, "cuda-rules": 12},
    ("O2", "sgd"): {"cpu-rules": 11, "cuda-rules": 9},
    ("O5", "adamw"): {"cpu-rules": 9, "cuda-rules": 9},
    ("O5", "adamw-fused"): {"cpu-rules": 9, "cuda-rules": 9},
    ("O5", "sgd"): {"cpu-rules": 6, "cuda-rules": 6},
}


@pytest.mark.usefixtures("no_launches")
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_steady_state_iteration_launches_few_kernels(level: str, name: str, request: pytest.FixtureRequest) -> None:
    launches = max(sum(ops.values()) for ops in steady_iterations(level, 8, OPTIMIZERS[name], _launching_ops))
    assert launches <= LAUNCHES_PER_ITERATION[level, name][request.node.callspec.params["no_launches"]]


@pytest.mark.parametrize(("beta1", "beta2", "lr"), [(0.9, 0.999, 1e-3), (0.8, 0.95, 3e-4), (0.0, 0.5, 1.0)])
def test_the_kernels_step_scalars_are_the_references_bits(beta1: float, beta2: float, lr: float) -> None:
    # The reference is the plain formula (float64 powers, lr / (1 - beta1**t) and sqrt(1 - beta2**t), each rounded
    # once to fp32); the kernel step computes it in fewer ops, which must not move a bit at any step count. On the
    # device under test: the GPU check runs it on CUDA, whose pow kernels for a tensor and a scalar base differ.
    gen = torch.Generator().manual_seed(0)
    steps = torch.cat([torch.arange(1, 20001, dtype=torch.float32), torch.randint(1, 10**7, (5000,), generator=gen)])
    steps = steps.to(device_under_test())
    got = kernel_step.step_scalars(steps, beta1, beta2, lr)
    want = reference.adam_step_scalars(steps, beta1, beta2, lr)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_advancing_step_scalars_launch_refuses_what_it_cannot_take(triton_interpreter: ModuleType) -> None:
    advance = triton_interpreter.advance_step_scalars_
    betas = torch.tensor([0.9, 0.999], dtype=torch.float64)
    counts = torch.ones(5)
    with pytest.raises(ValueError, match=r"1-D float32 or float64 counts, got torch.float16 of shape \(5,\)"):
        advance(counts.half(), betas, 1e-3)
    with pytest.raises(ValueError, match=r"1-D .* of shape \(5, 2\)"):
        advance(torch.ones(5, 2), betas, 1e-3)
    with pytest.raises(ValueError, match=r"of shape \(5,\) and strides \(0,\)"):
        advance(torch.ones(1).expand(5), betas, 1e-3)  # FusedAdam's counts: one count for every tensor
    with pytest.raises(ValueError, match=r"two betas as contiguous float64 on cpu, got torch.float32 of shape \(2,\)"):
        advance(counts, betas.float(), 1e-3)
    with pytest.raises(ValueError, match=r"got torch.float64 of shape \(3,\)"):
        advance(counts, torch.ones(3, dtype=torch.float64), 1e-3)
    with pytest.raises(ValueError, match=r"on CUDA only .* got counts on cpu: use step_scalars_"):
        advance(counts, betas, 1e-3)
    assert torch.equal(counts, torch.ones(5))  # nothing advanced


def test_the_step_scalars_launch_refuses_what_it_cannot_read(triton_interpreter: ModuleType) -> None:
    powers = torch.rand(2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"float64 powers of shape \(2, n\), got torch.float32"):
        triton_interpreter.step_scalars_(powers.float(), 1e-3)
    with pytest.raises(ValueError, match=r"of shape \(5, 2\)"):
        triton_interpreter.step_scalars_(powers.t(), 1e-3)
    short = torch.ones(4)
    with pytest.raises(ValueError, match="one per tensor"):
        triton_interpreter.step_scalars_(powers, 1e-3, short, torch.ones(1))
    assert torch.equal(short, torch.ones(4))  # nothing taken back
    with pytest.raises(ValueError, match="one per tensor"):
        triton_interpreter.step_scalars_(powers, 1e-3, None, torch.zeros(1))
