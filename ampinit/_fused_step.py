"""The master-weight optimizer step in one kernel per list: when it is taken, and how the optimizer's state is kept.

``optimizer.step()`` of a master-weight optimizer normally runs the optimizer on the fp32 masters and then copies
the masters into the half model weights. For ``torch.optim.Adam``, ``AdamW`` and ``SGD`` created with
``fused=True`` (the user asked for a fused kernel's numerics), on CUDA with Triton importable, the step is instead
one Triton launch per (weight dtype) list (``ampinit._triton_master``): it reads each master grad, updates the
master and the optimizer state, and writes the half weight, so no copy-back pass follows. The optimizer's
``state`` keeps torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``), so checkpoints
move freely between this path and torch's.

Anything else takes torch's own step: other optimizers, subclasses, options the kernels do not cover (amsgrad,
tensor lr, differentiable, sparse or non-contiguous grads), step hooks, or an optimizer whose ``step`` someone
other than an lr scheduler has wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.optim.optimizer as optim_module

from ampinit import _fused_master
from ampinit import _kernels as engine_kernels
from ampinit._fused_master import AdamSettings, Masters, SgdSettings

# Tests set this to run the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).
_TRITON_ON_CPU = False


def _kernels(device: torch.device) -> ModuleType | None:
    if device.type != "cuda" and not (device.type == "cpu" and _TRITON_ON_CPU):
        return None
    if not _fused_master.triton_available():
        return None
    from ampinit import _triton_master

    return _triton_master


def _plain_step(opt: torch.optim.Optimizer, original: Callable[..., Any]) -> bool:
    """Whether ``original`` is the class's own step (possibly behind an lr scheduler's counter) and no hook is set."""
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks:
        return False
    if getattr(original, "_wrapped_by_lr_sched", False):
        return True
    return getattr(original, "__func__", None) is type(opt).step


def _kind(opt: torch.optim.Optimizer) -> str | None:
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        ok = all(
            group.get("fused")
            and not group["amsgrad"]
            and not group.get("differentiable")
            and isinstance(group["lr"], float)
            and all(isinstance(b, float) for b in group["betas"])
            for group in opt.param_groups
        )
        return "adam" if ok else None
    if type(opt) is torch.optim.SGD:
        ok = all(
            group.get("fused") and not group.get("differentiable") and isinstance(group["lr"], float)
            for group in opt.param_groups
        )
        return "sgd" if ok else None
    return None


def try_step(
    opt: torch.optim.Optimizer,
    model_of: dict[int, torch.Tensor],
    original: Callable[..., Any],
    found_inf: torch.Tensor | None,
) -> bool:
    """Take ``opt``'s step through the fused kernels, writing the half weights; False (nothing done) if it can't.

    ``model_of`` maps id(master) -> half model parameter. ``found_inf`` is the device flag of a step that skips
    by itself (sync-free mode), or None for a step decided on the host.
    """
    kind = _kind(opt)
    if kind is None or not _plain_step(opt, original):
        return False
    planned = _plan(opt, kind, model_of, found_inf)
    if planned is None:
        return False
    kernels, plan = planned
    opt._opt_called = True  # type: ignore[attr-defined]  # what an lr scheduler's step wrapper records
    for group, params in plan:
        # One launch per weight dtype; masters without a model weight (None) write nothing back.
        dtype_of = {id(p): model_of[id(p)].dtype if id(p) in model_of else None for p in params}
        for weight_dtype in set(dtype_of.values()):
            chosen = [p for p in params if dtype_of[id(p)] == weight_dtype]
            weights = [model_of[id(p)] for p in chosen] if weight_dtype is not None else []
            kernel_step(kind, kernels, opt, group, chosen, Masters.fp32(chosen, weights), found_inf)
    return True


def _plan(
    opt: torch.optim.Optimizer, kind: str, model_of: dict[int, torch.Tensor], found_inf: torch.Tensor | None
) -> tuple[ModuleType, list[tuple[dict[str, Any], list[torch.Tensor]]]] | None:
    """The kernels and each group's parameters with a grad, or None when any of them is beyond the kernels."""
    plan: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
    kernels: ModuleType | None = None
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            device_kernels = _kernels(p.device) if _fits(p, model_of.get(id(p))) else None
            if device_kernels is None or (kernels is not None and device_kernels is not kernels):
                return None
            kernels = device_kernels
        first_momentum = any("momentum_buffer" not in opt.state.get(p, {}) for p in params)
        if kind == "sgd" and group["momentum"] != 0 and found_inf is not None and first_momentum:
            return None  # a first step that may be skipped on the device: torch's path handles it
        plan.append((group, params))
    if kernels is None:
        return None
    if found_inf is not None and any(p.device != found_inf.device for _, params in plan for p in params):
        return None
    return kernels, plan


def _fits(master: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the kernels take ``master`` (fp32, with a dense contiguous fp32 grad) and its model ``weight``."""
    grad = master.grad
    assert grad is not None
    return (
        master.dtype == torch.float32
        and not grad.is_sparse
        and grad.dtype == torch.float32
        and master.is_contiguous()
        and grad.is_contiguous()
        and (weight is None or weight.is_contiguous())
    )


def kernel_step(
    kind: str,
    kernels: ModuleType,
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    masters: Masters,
    found_inf: torch.Tensor | None,
) -> None:
    """``kind`` ("adam" or "sgd") on ``masters`` through ``kernels``; ``params`` (the optimizer's own) hold the
    grads and key the optimizer's state. Adam is one launch; SGD two when some momentum buffers start."""
    if kind == "adam":
        inputs = adam_inputs(opt, group, params, found_inf)
        kernels.adam_([_grad(p) for p in params], masters, *inputs, found_inf=found_inf)
        return
    settings = SgdSettings.of(group)
    for first_step, chosen, buffers in sgd_batches(opt, group, params):
        grads = [_grad(params[i]) for i in chosen]
        kernels.sgd_(grads, masters.take(chosen), buffers, settings, first_step=first_step, found_inf=found_inf)


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


# -- torch's optimizer state for the kernels (also the remainder kernels' in ampinit._remainder_masters) ----------
def adam_state(opt: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """``param``'s state in torch's Adam layout (``Adam._init_group``), created on first use.

    The moments are fp32 (for a bf16 parameter, those of its fp32 master); the step count is on the parameter's
    device when the group is fused or capturable, as torch keeps it.
    """
    state: dict[str, Any] = opt.state[param]
    if not state:
        on_device = group["capturable"] or group["fused"]
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=param.device)
            if on_device
            else torch.tensor(0.0, dtype=torch.get_default_dtype())
        )
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
    return state


def adam_inputs(
    opt: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, AdamSettings]:
    """What an Adam kernel takes besides grads and masters: ``(exp_avgs, exp_avg_sqs, step_scalars, settings)``.

    The step counts advance here (on the device, not where ``found_inf`` is set).
    """
    states = [adam_state(opt, group, p) for p in params]
    steps = [s["step"] for s in states]
    engine_kernels.advance_steps_(steps, found_inf)
    settings = AdamSettings.of(opt, group)
    scalars = _fused_master.adam_step_scalars(steps, settings.beta1, settings.beta2, settings.lr)
    return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], scalars.to(params[0].device), settings


def sgd_batches(
    opt: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]
) -> Iterator[tuple[bool, list[int], list[torch.Tensor]]]:
    """``(first_step, indices into params, momentum buffers)`` per SGD kernel launch.

    With momentum, the parameters without a buffer get torch's ``momentum_buffer`` (fp32) and their own launch
    (the kernel sets a first step's buffer to the grad). Without momentum the buffer lists are empty.
    """
    momentum = group["momentum"]
    first = [momentum != 0 and "momentum_buffer" not in opt.state.get(p, {}) for p in params]
    for p, is_first in zip(params, first):
        if is_first:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
    for first_step in (True, False):
        chosen = [i for i, f in enumerate(first) if f == first_step]
        if chosen:
            buffers = [opt.state[params[i]]["momentum_buffer"] for i in chosen] if momentum != 0 else []
            yield first_step, chosen, buffers
