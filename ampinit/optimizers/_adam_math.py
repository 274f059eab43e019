"""The Adam moment update and LAMB's step size, written once for every optimizer and ``amp_C`` op built on them.

FusedAdam's reference, FusedLAMB (both forms), Apex's capturable Adam ops and mixed-precision LAMB op all
advance the same two moments and divide them the same way; only where the step number, bias corrections and
weight decay come from differs, so those are the callers' arguments. FusedNovoGrad shares the bias corrections.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ampinit import _torch_kernels


def bias_corrections(t: Tensor, beta1: float, beta2: float, enabled: bool) -> tuple[Tensor, Tensor]:
    """``(1 - beta1**t, 1 - beta2**t)`` as float32 0-d tensors on ``t``'s device, or exact ones when disabled.

    The powers are taken in ``t``'s dtype (float64 for Apex's capturable kernels) and then rounded to float32.
    """
    if not enabled:
        one = torch.ones((), dtype=torch.float32, device=t.device)
        return one, one
    return (1 - beta1**t).float(), (1 - beta2**t).float()


def adam_update_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    betas: tuple[float, float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    corrections: tuple[Tensor, Tensor],
) -> list[Tensor]:
    """Advance float32 moments in place and return each tensor's Adam update, with foreach ops.

    ``betas`` is ``(beta1, beta2, beta3)``; ``beta3`` weighs the gradient in the first moment (``1 - beta1``,
    or 1 where LAMB's ``grad_averaging`` is off). The update is ``(m / c1) / (sqrt(v / c2) + eps)`` for
    ``corrections`` ``(c1, c2)``. Weight decay is added to ``grads`` (in place) before the moments, or with
    ``decoupled`` to the update after them.
    """
    beta1, beta2, beta3 = betas
    if not decoupled and weight_decay != 0:
        _torch_kernels.foreach_add_(grads, params, alpha=weight_decay)
    _torch_kernels.foreach_mul_(exp_avgs, beta1)
    _torch_kernels.foreach_add_(exp_avgs, grads, alpha=beta3)
    _torch_kernels.foreach_mul_(exp_avg_sqs, beta2)
    _torch_kernels.foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = _torch_kernels.foreach_div(exp_avg_sqs, corrections[1])
    _torch_kernels.foreach_sqrt_(denom)
    _torch_kernels.foreach_add_(denom, eps)
    update = _torch_kernels.foreach_div(exp_avgs, corrections[0])
    _torch_kernels.foreach_div_(update, denom)
    if decoupled and weight_decay != 0:
        _torch_kernels.foreach_add_(update, params, alpha=weight_decay)
    return list(update)


def adam_update_single(
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    t: Tensor,
    *,
    betas: tuple[float, float, float],
    eps: float,
    bias_correction: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, v, update)`` of one tensor at step ``t`` in plain torch: the reference of :func:`adam_update_foreach`,
    without weight decay."""
    beta1, beta2, beta3 = betas
    m = beta1 * exp_avg + beta3 * grad
    v = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = m / (1 - beta1**t) if bias_correction else m
    v_hat = v / (1 - beta2**t) if bias_correction else v
    return m, v, m_hat / (v_hat.sqrt() + eps)


def trust_ratio(p_norm: Tensor, u_norm: Tensor, lr: float) -> Tensor:
    """LAMB's step size: ``lr * ||p|| / ||update||`` where both norms are nonzero, else ``lr``."""
    return torch.where((p_norm != 0) & (u_norm != 0), lr * p_norm / u_norm, lr)


def clip_divisor(norm: Tensor, limit: float | Tensor) -> Tensor:
    """What LAMB divides gradients by: ``norm / limit`` where the global ``norm`` exceeds ``limit``, else 1."""
    return torch.where(norm > limit, norm / limit, torch.ones_like(norm))
