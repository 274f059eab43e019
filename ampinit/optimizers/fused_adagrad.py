"""FusedAdagrad: Apex's Adagrad (L2 or decoupled weight decay) on torch's fused Adagrad kernel."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import fp32_work, group_indices, pick, write_back
from ampinit.optimizers._apex_ops import TensorLists, check_lists
from ampinit.optimizers._base import FusedOptimizer, Implementation, ParamsT
from ampinit.optimizers._update_io import amp_on, reference_inputs, unscaled_copies, write_back_fused


def adagrad_multi_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state_sums: Sequence[Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One Adagrad update of every tensor with ``torch._fused_adagrad_``.

    L2 mode adds ``weight_decay*p`` to the gradient (the kernel does it). Decoupled mode subtracts
    ``lr*weight_decay*p`` from the parameter: it is applied first as a multiplication by a device-side
    factor that is exactly 1 on a skipped step, so the skip stays bitwise exact.
    """
    for (device, dtypes), indices in group_indices([params, grads, state_sums]).items():
        p, g, h = pick(params, indices), pick(grads, indices), pick(state_sums, indices)
        amp = amp_on(device, grad_scale, found_inf)
        if not _torch_kernels.has_fused_adagrad(device):
            _adagrad_foreach(p, g, h, lr, eps, weight_decay, adagrad_w_mode, grad_scale, amp.skip)
            continue
        wp, wg, wh = (p, g, h) if len(set(dtypes)) == 1 else (fp32_work(p), fp32_work(g), fp32_work(h))
        if adagrad_w_mode and weight_decay != 0:
            keep = torch.ones((), device=device) if amp.found_inf is None else 1 - amp.found_inf
            _torch_kernels.foreach_mul_(wp, 1 - lr * weight_decay * keep)
        # lr_decay is 0, so the kernel's step count only enters as (step - 1) * 0.
        steps = [torch.ones((), device=device) for _ in wp]
        _torch_kernels.fused_adagrad_(
            wp,
            wg,
            wh,
            steps,
            lr=lr,
            lr_decay=0.0,
            weight_decay=0.0 if adagrad_w_mode else weight_decay,
            eps=eps,
            maximize=False,
            **amp.kernel_arguments(),
        )
        write_back_fused(amp, p + h, wp + wh, g, wg)


def _adagrad_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
    grad_scale: Tensor | None,
    skip: Tensor | None,
) -> None:
    """The fused kernel's update on foreach ops, for devices where ``torch._fused_adagrad_`` has no kernel.

    Like the kernel, it leaves the gradients unscaled in place when ``grad_scale`` is given; a skipped step
    (``skip`` true) changes nothing.
    """
    wp, wh = fp32_work(params, private=skip is not None), fp32_work(state_sums, private=skip is not None)
    g = unscaled_copies(grads, grad_scale)
    if grad_scale is not None:
        write_back(grads, g, skip)
    if not adagrad_w_mode and weight_decay != 0:
        g = list(_torch_kernels.foreach_add(g, wp, alpha=weight_decay))
    _torch_kernels.foreach_addcmul_(wh, g, g)
    denom = _torch_kernels.foreach_sqrt(wh)
    _torch_kernels.foreach_add_(denom, eps)
    update = _torch_kernels.foreach_div(g, denom)
    if adagrad_w_mode and weight_decay != 0:
        _torch_kernels.foreach_add_(update, wp, alpha=weight_decay)
    _torch_kernels.foreach_add_(wp, update, alpha=-lr)
    write_back(params, wp, skip)
    write_back(state_sums, wh, skip)


# adagrad_multi_tensor's signature, spelled out: the two are interchangeable (``implementation`` picks one).
def adagrad_single_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state_sums: Sequence[Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    adagrad_w_mode: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """The update of :func:`adagrad_multi_tensor`, one tensor at a time in plain torch (the reference)."""
    for param, grad, state_sum in zip(params, grads, state_sums):
        device = param.device
        p, g = reference_inputs(param, grad, grad_scale, 0.0 if adagrad_w_mode else weight_decay)
        h = state_sum + g * g
        update = g / (h.sqrt() + eps)
        if adagrad_w_mode and weight_decay != 0:
            update = update + weight_decay * p
        skip = None if found_inf is None else found_inf.to(device).bool()
        write_back([param, state_sum], [p - lr * update, h], skip)


def multi_tensor_adagrad(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    epsilon: float,
    mode: int,
    weight_decay: float,
) -> None:
    """Adagrad on lists ``[g, p, h]``; ``mode`` 0 is L2 weight decay, 1 is decoupled."""
    if not check_lists("multi_tensor_adagrad", tensor_lists, (3,)):
        return
    g, p, h = tensor_lists
    adagrad_multi_tensor(p, g, h, lr=lr, eps=epsilon, weight_decay=weight_decay, adagrad_w_mode=mode != 0)


class FusedAdagrad(FusedOptimizer):
    """Adagrad with Apex's ``FusedAdagrad`` signature and defaults.

    ``adagrad_w_mode=True`` decouples weight decay from the gradient (``p -= lr*(g/(sqrt(h)+eps) + wd*p)``).
    State per parameter: ``sum`` (float32), Apex's name for the running sum of squared gradients.
    """

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        *,
        implementation: Implementation = "multi_tensor",
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr!r}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r}")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none=set_grad_none, implementation=implementation)
        self.multi_tensor_adagrad = multi_tensor_adagrad
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adagrad step over every group."""
        loss = self._evaluate(closure)
        update = adagrad_multi_tensor if self.implementation == "multi_tensor" else adagrad_single_tensor
        for group in self.param_groups:
            params = self._params_with_grads(group)
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["sum"] = torch.zeros_like(p, dtype=torch.float32)
            scaling = self._amp_scaling(params[0].device)
            update(
                params,
                [p.grad for p in params],  # type: ignore[misc]
                [self.state[p]["sum"] for p in params],
                lr=group["lr"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adagrad_w_mode=bool(self.adagrad_w_mode),
                grad_scale=scaling.grad_scale,
                found_inf=scaling.found_inf,
            )
        return loss
