"""What every update function's input and output share: the AMP inputs on the update's device, the float32
unscaled gradients it starts from, and storing back what a torch fused kernel computed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import fp32_copies, write_back
from ampinit.optimizers._base import AmpScaling


def amp_on(device: torch.device, grad_scale: Tensor | None, found_inf: Tensor | None) -> AmpScaling:
    """An update's ``grad_scale`` and float ``found_inf`` moved to ``device``, with ``skip`` made from the latter."""
    found_inf = None if found_inf is None else found_inf.to(device)
    return AmpScaling(
        grad_scale=None if grad_scale is None else grad_scale.to(device),
        found_inf=found_inf,
        skip=None if found_inf is None else found_inf.bool(),
    )


def unscaled_copies(grads: Sequence[Tensor], grad_scale: Tensor | None) -> list[Tensor]:
    """Float32 copies of ``grads`` (all on one device), divided by ``grad_scale`` when there is one."""
    copies = fp32_copies(grads)
    if grad_scale is not None and copies:
        _torch_kernels.foreach_div_(copies, grad_scale.to(copies[0].device))
    return copies


def reference_inputs(param: Tensor, grad: Tensor, grad_scale: Tensor | None, l2: float = 0.0) -> tuple[Tensor, Tensor]:
    """The float32 parameter and gradient a per-tensor reference update starts from: the gradient divided
    by ``grad_scale`` when there is one, plus ``l2 * param`` when ``l2`` (L2 weight decay) is nonzero."""
    p = param.float()
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale.to(param.device)
    if l2 != 0:
        g = g + l2 * p
    return p, g


def write_back_fused(
    amp: AmpScaling, targets: list[Tensor], work: list[Tensor], grads: list[Tensor], work_grads: list[Tensor]
) -> None:
    """Store a torch fused kernel's work lists into their targets, and also the gradients, which the kernel
    unscales in place when there is a ``grad_scale``; nothing changes on a skipped step."""
    write_back(targets, work, amp.skip)
    if amp.grad_scale is not None:
        write_back(grads, work_grads, amp.skip)
