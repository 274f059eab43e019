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

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.optim.optimizer as optim_module

from ampinit import _fused_master
from ampinit import _kernels as engine_kernels

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
    plan: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
    kernels: ModuleType | None = None
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            grad = p.grad
            assert grad is not None
            weight = model_of.get(id(p))
            if (
                p.dtype != torch.float32
                or grad.is_sparse
                or grad.dtype != torch.float32
                or not (p.is_contiguous() and grad.is_contiguous())
                or (weight is not None and not weight.is_contiguous())
            ):
                return False
            device_kernels = _kernels(p.device)
            if device_kernels is None or (kernels is not None and device_kernels is not kernels):
                return False
            kernels = device_kernels
        first_momentum = any("momentum_buffer" not in opt.state.get(p, {}) for p in params)
        if kind == "sgd" and group["momentum"] != 0 and found_inf is not None and first_momentum:
            return False  # a first step that may be skipped on the device: torch's path handles it
        plan.append((group, params))
    if kernels is None:
        return False
    if found_inf is not None and any(p.device != found_inf.device for _, params in plan for p in params):
        return False
    opt._opt_called = True  # type: ignore[attr-defined]  # what an lr scheduler's step wrapper records
    for group, params in plan:
        for weight_dtype in {None if id(p) not in model_of else model_of[id(p)].dtype for p in params}:
            chosen = [p for p in params if (model_of[id(p)].dtype if id(p) in model_of else None) == weight_dtype]
            weights = [model_of[id(p)] for p in chosen] if weight_dtype is not None else []
            if kind == "adam":
                _adam(kernels, opt, group, chosen, weights, found_inf)
            else:
                _sgd(kernels, opt, group, chosen, weights, found_inf)
    return True


def _adam(
    kernels: ModuleType,
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    weights: list[torch.Tensor],
    found_inf: torch.Tensor | None,
) -> None:
    states = []
    for p in params:
        state = opt.state[p]
        if not state:
            # torch's layout for a fused Adam: the step count on the parameter's device.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states.append(state)
    steps = [s["step"] for s in states]
    engine_kernels.advance_steps_(steps, found_inf)
    beta1, beta2 = group["betas"]
    decoupled = type(opt) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
    kernels.adam_(
        weights,
        [p.grad for p in params],
        params,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        _fused_master.adam_step_scalars(steps, beta1, beta2, group["lr"]).to(params[0].device),
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=decoupled,
        maximize=group["maximize"],
        inv_scale=None,
        found_inf=found_inf,
    )


def _sgd(
    kernels: ModuleType,
    opt: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    weights: list[torch.Tensor],
    found_inf: torch.Tensor | None,
) -> None:
    momentum = group["momentum"]
    first = [momentum != 0 and "momentum_buffer" not in opt.state.get(p, {}) for p in params]
    for p, is_first in zip(params, first):
        if is_first:
            opt.state[p]["momentum_buffer"] = torch.empty_like(p)
    for first_step in (True, False):
        chosen = [i for i, f in enumerate(first) if f == first_step]
        if not chosen:
            continue
        kernels.sgd_(
            [weights[i] for i in chosen] if weights else [],
            [params[i].grad for i in chosen],
            [params[i] for i in chosen],
            [opt.state[params[i]]["momentum_buffer"] for i in chosen] if momentum != 0 else [],
            lr=group["lr"],
            momentum=momentum,
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
            first_step=first_step,
            inv_scale=None,
            found_inf=found_inf,
        )
