"""Every private torch kernel ampinit calls, checked against what CUDA accepts, on any device.

CPU kernels take dtypes that CUDA's refuse (``_amp_foreach_non_finite_check_and_unscale_`` runs bf16 on CPU and
raises on CUDA: issue 21, O5 dead at its first GPU step), so a CPU run proves nothing by passing. Here a
``TorchDispatchMode`` records every private kernel call (``_amp_*``, ``_fused_*``, ``_foreach_*``) of real
training steps and of every ``amp_C`` op, and fails on one that ATen's CUDA kernel would refuse, per
``ampinit._torch_kernels.KERNEL_DTYPES``: the table the library routes by, whose rows cite ATen's dispatch macros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit
from ampinit import _torch_kernels, amp
from ampinit._scaler import LossScaler
from ampinit.compat.apex import amp_C
from tests.conftest import SmallNet

PRIVATE = ("_amp_", "_fused_", "_foreach_")
HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _arguments(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    named = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            named[argument.name] = args[i]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
    return named


def cuda_refusal(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why CUDA would refuse this call, or None where its kernel takes it."""
    name = func._schema.name.split("::")[-1]
    rule = _torch_kernels.KERNEL_DTYPES.get((name, "cuda"))
    if rule is None:
        return f"{name}: no CUDA row in _torch_kernels.KERNEL_DTYPES, so nobody has read what its CUDA kernel accepts"
    named = _arguments(func, args, kwargs)
    listed = [t for arg in rule.lists for t in (named.get(arg) or ()) if isinstance(t, torch.Tensor)]
    dtypes = {t.dtype for t in listed}
    if rule.dtypes is not None and not dtypes <= rule.dtypes:
        return f"{name}: CUDA refuses {sorted(map(str, dtypes - rule.dtypes))} ({rule.source})"
    if rule.one_dtype and len(dtypes) > 1:
        return f"{name}: CUDA wants one dtype across {rule.lists}, got {sorted(map(str, dtypes))} ({rule.source})"
    for arg, dtype in rule.fixed.items():
        value = named.get(arg)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor) and t.dtype != dtype:
                return f"{name}: CUDA reads {arg} as {dtype}, got {t.dtype} ({rule.source})"
    return None


class CudaKernelCheck(TorchDispatchMode):
    """Records each private kernel call and what CUDA would say to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: set[str] = set()
        self.refused: list[str] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name.startswith(PRIVATE):
            self.calls.add(name)
            reason = cuda_refusal(func, args, kwargs)
            if reason is not None and reason not in self.refused:
                self.refused.append(reason)
        return func(*args, **kwargs)


@pytest.fixture
def routes_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library routes CPU tensors as it would CUDA ones: every CPU row of the table becomes its CUDA row,
    and the master step's one device-type choice (unscale bf16 grads before widening them, off CPU) takes its
    CUDA branch.

    Without this, a CPU run takes the CPU kernels (the unscale kernel does take bf16 there) and checks nothing
    about the CUDA route.
    """
    before_widening = LossScaler.unscales_before_widening

    def as_on_cuda(self: LossScaler, dtype: torch.dtype, device_type: str) -> bool:
        return before_widening(self, dtype, "cuda" if device_type == "cpu" else device_type)

    monkeypatch.setattr(LossScaler, "unscales_before_widening", as_on_cuda)
    table = dict(_torch_kernels.KERNEL_DTYPES)
    for kernel, device in list(table):
        if device == "cpu":
            del table[(kernel, device)]
    table.update({(kernel, "cpu"): rule for (kernel, device), rule in table.items() if device == "cuda"})
    monkeypatch.setattr(_torch_kernels, "KERNEL_DTYPES", table)


@contextmanager
def checked() -> Iterator[CudaKernelCheck]:
    mode = CudaKernelCheck()
    with mode:
        yield mode
    assert not mode.refused, "calls that CUDA would refuse:\n" + "\n".join(mode.refused)


def test_the_check_fails_on_what_cuda_refuses() -> None:
    mode = CudaKernelCheck()
    with mode:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(3, dtype=torch.bfloat16)], torch.zeros(1), torch.ones(1)
        )
        torch._foreach_mul_([torch.ones(3, dtype=torch.bfloat16)], torch.ones(()))
    assert mode.calls == {"_amp_foreach_non_finite_check_and_unscale_", "_foreach_mul_"}
    assert len(mode.refused) == 1
    assert "refuses ['torch.bfloat16']" in mode.refused[0] and "AT_DISPATCH_FLOATING_TYPES_AND_HALF" in mode.refused[0]
    # CPU's own fused SGD refuses mixed dtypes too, so this one is judged without running it.
    sgd = torch.ops.aten._fused_sgd_.default
    lists = ([torch.zeros(2)], [torch.zeros(2, dtype=torch.float16)], [])
    settings = {"weight_decay": 0.0, "momentum": 0.0, "lr": 0.1, "dampening": 0.0, "nesterov": False}
    reason = cuda_refusal(sgd, lists, {**settings, "maximize": False, "is_first_step": False})
    assert reason is not None and "one dtype" in reason
    step = (
        [torch.zeros(2)],
        [torch.zeros(2)],
        [torch.zeros(2)],
        [torch.zeros(2)],
        [],
        [torch.zeros((), dtype=torch.int64)],
    )
    adam = {
        "lr": 0.1,
        "beta1": 0.9,
        "beta2": 0.99,
        "weight_decay": 0.0,
        "eps": 1e-8,
        "amsgrad": False,
        "maximize": False,
    }
    reason = cuda_refusal(torch.ops.aten._fused_adam_.default, step, adam)
    assert reason is not None and "state_steps as torch.float32" in reason
    assert cuda_refusal(torch.ops.aten._foreach_abs_.default, ([torch.zeros(1)],), {}) is not None  # no row: unread


# -- training steps: O0-O5 x {fp16, bf16 model} x {static scale 1 and 128, dynamic, delay_unscale, sync_free} ----
def _initialize_kwargs(level: str, half: torch.dtype, scaling: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"opt_level": level, "verbosity": 0}
    if level in ("O1", "O4"):
        kwargs["patch_torch_functions_type"] = half
    elif level != "O0":
        kwargs["cast_model_type"] = half
    kwargs["loss_scale"] = {"unit": 1.0, "static": 128.0}.get(scaling, "dynamic")
    kwargs["sync_free"] = scaling == "sync_free"
    return kwargs


def _optimizer(scaling: str, params: Any) -> torch.optim.Optimizer:
    if scaling in ("unit", "static"):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if scaling == "dynamic":
        return ampinit.optimizers.FusedAdam(params, lr=1e-3)
    if scaling == "sync_free":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.AdamW(params, lr=1e-3)


# O3 steps Adam in fp16, whose eps=1e-8 initialize warns of (tests/test_vanishing_eps.py); the kernels are the point.
@pytest.mark.filterwarnings("ignore:.*which is 0 in float16:UserWarning")
@pytest.mark.parametrize("scaling", ["unit", "static", "dynamic", "delay_unscale", "sync_free"])
@pytest.mark.parametrize("half", list(HALVES))
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
@pytest.mark.usefixtures("routes_as_on_cuda")
def test_training_steps_call_no_kernel_that_cuda_refuses(level: str, half: str, scaling: str) -> None:
    torch.manual_seed(0)
    model = SmallNet(4, 8, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    optimizer = _optimizer(scaling, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, **_initialize_kwargs(level, HALVES[half], scaling))
    try:
        with checked() as mode:
            for blowup in (1.0, float("inf"), 1.0):  # a clean step, an overflowing one, a clean one
                optimizer.zero_grad()
                passes = 2 if scaling == "delay_unscale" else 1
                for i in range(passes):
                    loss = (model(x).float() - y).pow(2).mean() * blowup
                    with amp.scale_loss(loss, optimizer, delay_unscale=i < passes - 1) as scaled:
                        scaled.backward()
                optimizer.step()
    finally:
        amp.deinitialize()
    assert mode.calls  # the engine's kernels did run under the check


# -- every amp_C op ---------------------------------------------------------------------------------------------
def _amp_c_calls(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    def ts(*shapes: int, d: torch.dtype = dtype) -> list[torch.Tensor]:
        return [torch.randn(n, dtype=torch.float32).to(d) for n in shapes]

    def flag() -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32)

    def one(value: float = 1.0, d: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((1,), value, dtype=d)

    f32 = torch.float32
    return {
        "multi_tensor_scale": lambda: amp_C.multi_tensor_scale(0, flag(), [ts(5, 3), ts(5, 3)], 0.5),
        "multi_tensor_scale to fp32": lambda: amp_C.multi_tensor_scale(0, flag(), [ts(5, 3), ts(5, 3, d=f32)], 0.5),
        "multi_tensor_axpby": lambda: amp_C.multi_tensor_axpby(0, flag(), [ts(4), ts(4), ts(4)], 2.0, 0.5, -1),
        "multi_tensor_l2norm": lambda: amp_C.multi_tensor_l2norm(0, flag(), [ts(5, 3)], True),
        "multi_tensor_l2norm_scale": lambda: amp_C.multi_tensor_l2norm_scale(0, flag(), [ts(5), ts(5)], 0.25, True),
        "multi_tensor_unscale_l2norm": lambda: amp_C.multi_tensor_unscale_l2norm(0, flag(), [ts(5)], one(0.5), True),
        "multi_tensor_l2norm_mp": lambda: amp_C.multi_tensor_l2norm_mp(0, flag(), [ts(5, 3)], True),
        "multi_tensor_adam": lambda: amp_C.multi_tensor_adam(
            0, flag(), [ts(4), ts(4, d=f32), ts(4, d=f32), ts(4, d=f32)], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0
        ),
        "multi_tensor_sgd": lambda: amp_C.multi_tensor_sgd(
            0, flag(), [ts(4), ts(4, d=f32), ts(4, d=f32)], 0.0, 0.9, 0.0, 0.1, False, True, False, 0.5
        ),
        "multi_tensor_adagrad": lambda: amp_C.multi_tensor_adagrad(
            0, flag(), [ts(4, d=f32), ts(4, d=f32), [t.abs() for t in ts(4, d=f32)]], 0.1, 1e-10, 1, 0.01
        ),
        "multi_tensor_lamb": lambda: amp_C.multi_tensor_lamb(
            0,
            flag(),
            [ts(4), ts(4), ts(4), [t.abs() for t in ts(4)]],
            1e-2,
            0.9,
            0.999,
            1e-6,
            1,
            1,
            0.01,
            1,
            1,
            one(),
            1.0,
            False,
        ),
        "multi_tensor_novograd": lambda: amp_C.multi_tensor_novograd(
            0, flag(), [ts(4), ts(4), ts(4)], torch.ones(1), 1e-2, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2
        ),
        "multi_tensor_adam_capturable": lambda: amp_C.multi_tensor_adam_capturable(
            0,
            flag(),
            [ts(4), ts(4), ts(4), [t.abs() for t in ts(4)]],
            one(1e-3),
            0.9,
            0.999,
            1e-8,
            one(1, torch.int32),
            1,
            1,
            0.0,
            one(0.5),
        ),
        "multi_tensor_adam_capturable_master": lambda: amp_C.multi_tensor_adam_capturable_master(
            0,
            flag(),
            [ts(4), ts(4), ts(4, d=f32), [t.abs() for t in ts(4, d=f32)], ts(4, d=f32)],
            one(1e-3),
            0.9,
            0.999,
            1e-8,
            one(1, torch.int32),
            1,
            1,
            0.0,
            one(0.5),
        ),
        "multi_tensor_lamb_mp": lambda: amp_C.multi_tensor_lamb_mp(
            0,
            flag(),
            [ts(4), ts(4), ts(4, d=f32), [t.abs() for t in ts(4, d=f32)], ts(4, d=f32)],
            one(0.01),
            0.9,
            0.999,
            1e-6,
            one(1, torch.int32),
            1,
            0.01,
            1,
            1,
            one(),
            one(4.0),
            False,
            torch.zeros(1),
            one(0.5),
        ),
        "update_scale_hysteresis": lambda: amp_C.update_scale_hysteresis(
            one(128.0), one(0, torch.int32), one(2, torch.int32), torch.zeros(1), 2.0, 0.5, 2, 2
        ),
    }


def test_every_amp_c_op_is_called_here() -> None:
    public = {name for name in dir(amp_C) if name.startswith(("multi_tensor_", "update_scale"))}
    assert public == {name.split(" ")[0] for name in _amp_c_calls(torch.float32)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.usefixtures("routes_as_on_cuda")
def test_amp_c_ops_call_no_kernel_that_cuda_refuses(dtype: torch.dtype) -> None:
    refused = []
    for name, call in _amp_c_calls(dtype).items():
        mode = CudaKernelCheck()
        with mode:
            call()
        refused += [f"{name}: {reason}" for reason in mode.refused]
    assert not refused, "calls that CUDA would refuse:\n" + "\n".join(refused)
