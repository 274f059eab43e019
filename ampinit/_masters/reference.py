"""The master-weight optimizer step as one operation, in plain torch ops: the reference of the Triton kernels.

With master weights (O2/O5) a step, unfused, is: widen the half grads to fp32 and unscale them, check them for
inf/NaN, run the optimizer on the fp32 masters, and copy the masters back into the half model weights. The
functions here do all of it in one call, per list of tensors:

- :func:`check_finite_` raises the overflow flag if any (still scaled, still half) grad is inf or NaN;
- :func:`adam_` and :func:`sgd_` read each grad in its own dtype, multiply it by ``inv_scale``, update the
  fp32 master and the optimizer state, and write the master, rounded to nearest-even, into the half weight; they
  do nothing at all when ``found_inf`` is nonzero. With remainder masters (:class:`Masters`) they join each
  master from its bf16 weight and remainder and split it back instead.

The functions in this module are the *reference*: plain torch ops in a fixed order, each op rounded to fp32 (no
fused multiply-add), so that ``ampinit._masters.triton_kernels``, which take the same arguments, reproduce them
bit for bit. The per-element math is that of torch's fused CPU kernels (``m*beta1 + g*(1-beta1)``, ``v*beta2 +
g*g*(1-beta2)``, ``sqrt(v)/sqrt(bc2) + eps``), with the bias corrections computed once per tensor in float64 by
:func:`adam_step_scalars`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ampinit._masters import remainder as encoding
from ampinit._types import TensorList


@dataclass(frozen=True)
class AdamSettings:
    """One param group's Adam (``decoupled=False``) or AdamW settings, as every master-step function takes them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamSettings:
        """The settings of ``group`` of a torch ``Adam``/``AdamW``."""
        beta1, beta2 = group["betas"]
        decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], decoupled, group["maximize"])


@dataclass(frozen=True)
class SgdSettings:
    """One param group's SGD settings (torch's rule), as every master-step function takes them."""

    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    maximize: bool

    @classmethod
    def of(cls, group: dict[str, Any]) -> SgdSettings:
        """The settings of ``group`` of a torch ``SGD`` (the fields are named as its keys)."""
        return cls(**{field.name: group[field.name] for field in fields(cls)})


@dataclass(frozen=True)
class Masters:
    """Where one list's fp32 masters live: what every master-step function updates.

    Either fp32 ``masters``, updated in place, and the half model ``weights`` written from them (empty: none),
    or bf16 ``weights`` with the int16 ``remainders`` that make them fp32 masters (:mod:`ampinit._masters.remainder`).
    Build one with :meth:`fp32` or :meth:`remainder`.
    """

    masters: TensorList
    weights: TensorList
    remainders: TensorList

    @classmethod
    def fp32(cls, masters: TensorList, weights: TensorList | None = None) -> Masters:
        return cls(masters, weights or [], [])

    @classmethod
    def remainder(cls, weights: TensorList, remainders: TensorList) -> Masters:
        return cls([], weights, remainders)

    def take(self, indices: list[int]) -> Masters:
        """The masters at ``indices``, stored as these are."""

        def pick(tensors: TensorList) -> TensorList:
            return [tensors[i] for i in indices] if tensors else []

        return Masters(pick(self.masters), pick(self.weights), pick(self.remainders))

    def master(self, i: int) -> torch.Tensor:
        """Master ``i`` as an fp32 tensor: the master itself, or joined from its weight and remainder."""
        return encoding.join(self.weights[i], self.remainders[i]) if self.remainders else self.masters[i]

    def store(self, i: int, master: torch.Tensor) -> None:
        """Keep the updated ``master`` ``i``: written into its half weight, or split back (``master`` is scratch)."""
        if self.remainders:
            encoding.split_(master, self.weights[i], self.remainders[i])
        elif self.weights:
            self.weights[i].copy_(master)


def adam_step_scalars(
    steps: Sequence[torch.Tensor] | torch.Tensor, beta1: float, beta2: float, lr: float
) -> torch.Tensor:
    """``[[step_size, sqrt(bias_correction2)], ...]`` in fp32, one row per tensor, from its step count (``steps``:
    one 0-d tensor per tensor, or their values in one 1-D tensor).

    Computed on the steps' device in float64 (as torch's Adam does on the host), then rounded once to fp32: no
    host synchronisation, so a step count that a skipped step did not advance stays correct on the device.
    """
    if isinstance(steps, torch.Tensor):
        step = steps.double()
    else:
        # torch keeps 0-d step counts; a view of each (reshape) would cost more host time than the rest of the step.
        step = torch.stack([s if s.dim() == 0 else s.reshape(()) for s in steps]).double()
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    return torch.stack([lr / bias_correction1, bias_correction2.sqrt()], dim=1).float()


def check_finite_(grads: TensorList, found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` (a one-element fp32 tensor) to 1.0 if any grad holds an inf or NaN; never clear it."""
    if not grads:
        return
    bad = torch.stack([g.isfinite().all().logical_not() for g in grads]).any()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape)))


# Square root and division correctly rounded to fp32, as the kernels' sqrt_rn and div_rn: through float64, whose
# 53 bits make the second rounding harmless. torch's own fp32 versions on CPU are not always so: its vectorised
# sqrt can be one ulp off, and a division by a scalar multiplies by the reciprocal.
def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return x.double().sqrt().float()


def _div(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.double() / y.double()).float()


def skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf.reshape(-1)[0].item() != 0)


def _unscaled(grad: torch.Tensor, inv_scale: torch.Tensor | None, maximize: bool) -> torch.Tensor:
    g = grad.float()
    if inv_scale is not None:
        g = g * inv_scale.reshape(())
    elif g is grad:
        g = g.clone()
    return -g if maximize else g


def adam_(
    grads: TensorList,
    masters: Masters,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    step_scalars: torch.Tensor,
    settings: AdamSettings,
    *,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam or AdamW step of ``masters`` from ``grads``.

    ``step_scalars`` comes from :func:`adam_step_scalars` (one row per tensor).
    """
    if skipped(found_inf):
        return
    s = settings
    with torch.no_grad():
        for i, (grad, m, v) in enumerate(zip(grads, exp_avgs, exp_avg_sqs)):
            g = _unscaled(grad, inv_scale, s.maximize)
            p = master = masters.master(i)
            if s.weight_decay != 0:
                if s.decoupled:
                    p = p * (1 - s.lr * s.weight_decay)
                else:
                    g = g + p * s.weight_decay
            m.copy_(m * s.beta1 + g * (1 - s.beta1))
            v.copy_(v * s.beta2 + (g * g) * (1 - s.beta2))
            denom = _div(_sqrt(v), step_scalars[i, 1]) + s.eps
            master.copy_(p - _div(step_scalars[i, 0] * m, denom))
            masters.store(i, master)


def sgd_(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: TensorList,
    settings: SgdSettings,
    *,
    first_step: bool,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One SGD step (torch's rule; with momentum the buffers are set to the grad on ``first_step``).

    ``momentum_buffers`` is empty when ``settings.momentum == 0``.
    """
    if skipped(found_inf):
        return
    s = settings
    with torch.no_grad():
        for i, grad in enumerate(grads):
            master = masters.master(i)
            g = _unscaled(grad, inv_scale, s.maximize)
            if s.weight_decay != 0:
                g = g + master * s.weight_decay
            if s.momentum != 0:
                buf = momentum_buffers[i]
                buf.copy_(g if first_step else buf * s.momentum + g * (1 - s.dampening))
                g = g + buf * s.momentum if s.nesterov else buf
            master.copy_(master - g * s.lr)  # bitwise torch's p + (-lr)*g
            masters.store(i, master)
