"""FusedLAMB: Apex's LAMB (per-layer trust ratio on Adam updates, global grad clipping) on foreach ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import (
    fp32_work,
    group_indices,
    l2_norms,
    pick,
    total_norm,
    write_back,
)
from ampinit.optimizers._adam_math import (
    adam_update_foreach,
    adam_update_single,
    bias_corrections,
    clip_divisor,
    trust_ratio,
)
from ampinit.optimizers._apex_ops import TensorLists, adam_arguments, check_lists, multi_tensor_l2norm
from ampinit.optimizers._base import FusedOptimizer, Implementation, ParamsT, adam_defaults
from ampinit.optimizers._update_io import reference_inputs, unscaled_copies


# The Adam-family update functions (FusedAdam's, FusedLAMB's, FusedNovoGrad's) take the same keyword arguments;
# FusedOptimizer._adam_step fills them in from a parameter group.
def lamb_multi_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    global_grad_norm: Tensor,
    max_grad_norm: float,
    use_nvlamb: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> list[Tensor]:
    """One LAMB update of every tensor (Apex's ``multi_tensor_lamb`` math) with foreach ops.

    Gradients are divided by ``grad_scale`` and then by ``global_grad_norm / max_grad_norm`` when the
    (unscaled) global norm exceeds ``max_grad_norm``. Each tensor moves by its Adam-style update times
    ``lr * ||p|| / ||update||`` when ``use_nvlamb`` or ``weight_decay != 0`` and both norms are nonzero, else
    by ``lr``. Gradients are not modified. Returns the float32 updates before the trust ratio, in input order
    (Apex's kernel leaves them in the gradients). When ``found_inf`` is given the math runs on private copies
    that are committed only if the step is not skipped.
    """
    updates: list[Tensor] = [torch.empty(0)] * len(params)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for (device, _), indices in group_indices([params, grads, exp_avgs, exp_avg_sqs]).items():
        p, m, v = pick(params, indices), pick(exp_avgs, indices), pick(exp_avg_sqs, indices)
        skip = None if found_inf is None else found_inf.to(device).bool()
        wp, wm, wv = (fp32_work(t, private=skip is not None) for t in (p, m, v))
        g = unscaled_copies(pick(grads, indices), grad_scale)
        norm = global_grad_norm.to(device=device, dtype=torch.float32).reshape(())
        _torch_kernels.foreach_div_(g, clip_divisor(norm, max_grad_norm))
        update = adam_update_foreach(
            wp,
            g,
            wm,
            wv,
            betas=(beta1, beta2, beta3),
            eps=eps,
            weight_decay=weight_decay,
            decoupled=adam_w_mode,
            corrections=bias_corrections(step.to(device), beta1, beta2, bias_correction),
        )
        if use_nvlamb or weight_decay != 0:
            ratio = trust_ratio(torch.stack(l2_norms(wp)), torch.stack(l2_norms(update)), lr)
            _torch_kernels.foreach_sub_(wp, _torch_kernels.foreach_mul(update, list(ratio.unbind())))
        else:
            _torch_kernels.foreach_add_(wp, update, alpha=-lr)
        write_back(p + m + v, wp + wm + wv, skip)
        for i, u in zip(indices, update):
            updates[i] = u
    return updates


# lamb_multi_tensor's signature, spelled out: the two are interchangeable (``implementation`` picks one).
def lamb_single_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    global_grad_norm: Tensor,
    max_grad_norm: float,
    use_nvlamb: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> list[Tensor]:
    """The same update as :func:`lamb_multi_tensor`, one tensor at a time in plain torch (the reference)."""
    updates = []
    betas = (beta1, beta2, 1 - beta1 if grad_averaging else 1.0)
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        device = param.device
        p, g = reference_inputs(param, grad, grad_scale)
        g = g / clip_divisor(global_grad_norm.to(device).reshape(()), max_grad_norm)
        if not adam_w_mode:
            g = g + weight_decay * p
        t = step.to(device)
        m, v, update = adam_update_single(
            g, exp_avg, exp_avg_sq, t, betas=betas, eps=eps, bias_correction=bias_correction
        )
        if adam_w_mode:
            update = update + weight_decay * p
        ratio: Tensor | float = lr
        if use_nvlamb or weight_decay != 0:
            p_norm, u_norm = l2_norms([p, update])
            ratio = trust_ratio(p_norm, u_norm, lr)
        skip = None if found_inf is None else found_inf.to(device).bool()
        write_back([param, exp_avg, exp_avg_sq], [p - ratio * update, m, v], skip)
        updates.append(update)
    return updates


def global_grad_norm(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """L2 norm (shape [1], float32, on ``device``) of all ``grads`` together."""
    return total_norm(l2_norms(grads), device)


def multi_tensor_lamb(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: float,
    use_nvlamb: bool | None = None,
) -> None:
    """LAMB on lists ``[g, p, m, v]``. As in Apex, ``g`` is overwritten with the update, and the flag is set
    when the parameter norms or the update norms are non-finite."""
    if not check_lists("multi_tensor_lamb", tensor_lists, (4,)):
        return
    g, p, m, v = tensor_lists
    multi_tensor_l2norm(chunk_size, noop_flag, [p])
    updates = lamb_multi_tensor(
        p,
        g,
        m,
        v,
        **adam_arguments(p[0].device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction),
        grad_averaging=grad_averaging == 1,
        adam_w_mode=mode != 0,
        global_grad_norm=global_grad_norm,
        max_grad_norm=max_grad_norm,
        use_nvlamb=bool(use_nvlamb),
    )
    _torch_kernels.copy_(list(g), updates)
    multi_tensor_l2norm(chunk_size, noop_flag, [g])


class FusedLAMB(FusedOptimizer):
    """LAMB with Apex's ``FusedLAMB`` signature and defaults.

    The gradients of all groups are clipped together against ``max_grad_norm`` (taken from the
    constructor's defaults, as Apex does). ``adam_w_mode`` decouples weight decay; ``grad_averaging`` scales
    the gradient by ``1 - beta1`` in the first moment; ``use_nvlamb`` applies the trust ratio to parameters
    without weight decay too. State per parameter: ``exp_avg``, ``exp_avg_sq`` (float32, where Apex keeps the
    parameter dtype); step counter per group in ``group['step']``. Unlike Apex, the gradients are left as
    they were (Apex overwrites them with the update).
    """

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        implementation: Implementation = "multi_tensor",
    ) -> None:
        defaults = adam_defaults("FusedLAMB", amsgrad, lr, bias_correction, betas, eps, weight_decay)
        defaults.update(grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        if not max_grad_norm >= 0.0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm!r}")
        super().__init__(params, defaults, set_grad_none=set_grad_none, implementation=implementation)
        self.multi_tensor_l2norm = multi_tensor_l2norm
        self.multi_tensor_lamb = multi_tensor_lamb
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step over every group."""
        loss = self._evaluate(closure)
        # Empty groups are skipped, as in Apex and torch.optim; a group of frozen parameters only counts a step.
        groups = [(group, self._params_with_grads(group)) for group in self.param_groups if group["params"]]
        if not groups:
            return loss
        device = groups[0][0]["params"][0].device
        grad_norm = global_grad_norm([p.grad for _, params in groups for p in params], device)  # type: ignore[misc]
        scale = self._amp_scaling(device).grad_scale
        if scale is not None:
            grad_norm = grad_norm / scale
        for group, params in groups:
            self._step_group(group, params, grad_norm)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[Tensor], grad_norm: Tensor) -> None:
        update = lamb_multi_tensor if self.implementation == "multi_tensor" else lamb_single_tensor
        with self._adam_step(group) as arguments:
            self._zero_state(params, "exp_avg", "exp_avg_sq")
            update(
                params,
                [p.grad for p in params],  # type: ignore[misc]
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                grad_averaging=bool(group["grad_averaging"]),
                adam_w_mode=bool(self.adam_w_mode),
                global_grad_norm=grad_norm,
                max_grad_norm=self.defaults["max_grad_norm"],
                use_nvlamb=self.use_nvlamb,
                **arguments,
            )
