"""FusedNovoGrad: Apex's NovoGrad (per-layer gradient-norm second moment) on foreach ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import fp32_work, l2_norms, write_back
from ampinit.optimizers._adam_math import bias_corrections
from ampinit.optimizers._apex_ops import TensorLists, adam_arguments, check_lists
from ampinit.optimizers._base import FusedOptimizer, Implementation, ParamsT, adam_defaults
from ampinit.optimizers._update_io import reference_inputs, unscaled_copies

# Apex keeps one norm tensor per dtype in group['exp_avg_sq']: [fp16, fp32]. bf16 is ampinit's third slot.
NORM_SLOTS = (torch.float16, torch.float32, torch.bfloat16)
# A negative stored norm means "no norm seen yet": the first real step then stores the gradient's norm.
UNSET_NORM = -1.0


def layer_norms(grads: Sequence[Tensor], norm_type: int) -> Tensor:
    """Per-tensor norms (L2 for ``norm_type`` 2, max-abs for 0) of float32 ``grads`` as one 1-D tensor."""
    if norm_type == 2:
        return torch.stack(l2_norms(grads))
    # The infinity norm of an empty tensor is undefined in torch; Apex's kernel reports 0 for it.
    nonempty = [g if g.numel() else g.new_zeros(1) for g in grads]
    return torch.stack(_torch_kernels.foreach_norm(nonempty, float("inf")))


def blend_norms(old: Tensor, new: Tensor, beta2: float, norm_type: int) -> Tensor:
    """Running per-layer norm: ``sqrt(b2*old^2 + (1-b2)*new^2)`` (L2) or ``b2*old + (1-b2)*new`` (inf)."""
    if norm_type == 2:
        blended = (beta2 * old * old + (1 - beta2) * new * new).sqrt()
    else:
        blended = beta2 * old + (1 - beta2) * new
    return torch.where(old < 0, new, blended)


def novograd_multi_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    grad_norms: Tensor,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    moment_mode: int,
    norm_type: int,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One NovoGrad update (Apex's ``multi_tensor_novograd`` math) of tensors on ``grad_norms.device``.

    ``grad_norms`` (float32, one entry per tensor) is blended with this step's norms in place.
    ``moment_mode`` 0 normalises the gradient and adds weight decay before the momentum (the paper);
    1 applies both to the update after it.
    """
    device = grad_norms.device
    skip = None if found_inf is None else found_inf.to(device).bool()
    wp, wm = fp32_work(params, private=skip is not None), fp32_work(exp_avgs, private=skip is not None)
    g = unscaled_copies(grads, grad_scale)
    norms = blend_norms(grad_norms, layer_norms(g, norm_type), beta2, norm_type)
    bias1, bias2 = bias_corrections(step.to(device), beta1, beta2, bias_correction)
    denoms = list((norms / bias2.sqrt() + eps).unbind())
    beta3 = 1 - beta1 if grad_averaging else 1.0
    if moment_mode == 0:
        _torch_kernels.foreach_div_(g, denoms)
        _torch_kernels.foreach_add_(g, wp, alpha=weight_decay)
        _torch_kernels.foreach_mul_(wm, beta1)
        _torch_kernels.foreach_add_(wm, g, alpha=beta3)
        _torch_kernels.foreach_add_(wp, _torch_kernels.foreach_div(wm, bias1), alpha=-lr)
    else:
        _torch_kernels.foreach_mul_(wm, beta1)
        _torch_kernels.foreach_add_(wm, g, alpha=beta3)
        update = _torch_kernels.foreach_div(wm, bias1)
        _torch_kernels.foreach_div_(update, denoms)
        _torch_kernels.foreach_add_(update, wp, alpha=weight_decay)
        _torch_kernels.foreach_add_(wp, update, alpha=-lr)
    write_back(params, wp, skip)
    write_back(exp_avgs, wm, skip)
    write_back([grad_norms], [norms], skip)


# novograd_multi_tensor's signature, spelled out: the two are interchangeable (``implementation`` picks one).
def novograd_single_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    grad_norms: Tensor,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    moment_mode: int,
    norm_type: int,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """The update of :func:`novograd_multi_tensor`, one tensor at a time in plain torch (the reference)."""
    device = grad_norms.device
    skip = None if found_inf is None else found_inf.to(device).bool()
    t = step.to(device)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    new_norms = []
    for i, (param, grad, exp_avg) in enumerate(zip(params, grads, exp_avgs)):
        p, g = reference_inputs(param, grad, grad_scale)
        # max() of an empty tensor is an error; Apex's kernel reports 0 for it.
        empty = g.numel() == 0
        layer = l2_norms([g])[0] if norm_type == 2 or empty else g.abs().max()
        norm = blend_norms(grad_norms[i], layer, beta2, norm_type)
        new_norms.append(norm)
        denom = (norm / (1 - beta2**t).sqrt() if bias_correction else norm) + eps
        m_correction = 1 - beta1**t if bias_correction else 1.0
        if moment_mode == 0:
            m = beta1 * exp_avg + beta3 * (g / denom + weight_decay * p)
            update = m / m_correction
        else:
            m = beta1 * exp_avg + beta3 * g
            update = m / m_correction / denom + weight_decay * p
        write_back([param, exp_avg], [p - lr * update, m], skip)
    if new_norms:
        write_back([grad_norms], [torch.stack(new_norms)], skip)


def multi_tensor_novograd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    grad_norms: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    norm_type: int,
) -> None:
    """NovoGrad on lists ``[g, p, m]``; ``grad_norms`` (one float32 per tensor) is blended in place."""
    if not check_lists("multi_tensor_novograd", tensor_lists, (3,)):
        return
    g, p, m = tensor_lists
    novograd_multi_tensor(
        p,
        g,
        m,
        grad_norms,
        **adam_arguments(grad_norms.device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction),
        grad_averaging=grad_averaging == 1,
        moment_mode=mode,
        norm_type=norm_type,
    )


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad with Apex's ``FusedNovoGrad`` signature and defaults.

    The second moment is one number per parameter tensor (its gradient norm, L2 for ``norm_type=2`` or
    max-abs for ``norm_type=0``), kept per group as Apex keeps it: ``group['exp_avg_sq']`` is
    ``[fp16_norms, fp32_norms]`` (plus ``bf16_norms`` when the group has bf16 parameters), in the order of
    the group's parameters that have gradients. ``init_zero=False`` starts the running norm at the first
    step's norm, ``True`` at 0. ``reg_inside_moment`` selects Apex's moment mode 0. State per parameter:
    ``exp_avg`` (float32). All parameters of one dtype in a group must be on one device, as in Apex.
    """

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        *,
        implementation: Implementation = "multi_tensor",
    ) -> None:
        defaults = adam_defaults("FusedNovoGrad", amsgrad, lr, bias_correction, betas, eps, weight_decay)
        defaults.update(grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        if norm_type not in (0, 2):
            raise ValueError(f"Invalid norm_type: {norm_type!r}. FusedNovoGrad supports 2 (L2) and 0 (infinity)")
        super().__init__(params, defaults, set_grad_none=set_grad_none, implementation=implementation)
        self.multi_tensor_novograd = multi_tensor_novograd
        self.moment_mode = 0 if reg_inside_moment else 1

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One NovoGrad step over every group."""
        loss = self._evaluate(closure)
        for group in self.param_groups:
            # Empty groups are skipped, as in Apex and torch.optim; a group of frozen parameters only counts a step.
            if group["params"]:
                self._step_group(group, self._params_with_grads(group))
        return loss

    def _step_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        update = novograd_multi_tensor if self.implementation == "multi_tensor" else novograd_single_tensor
        with self._adam_step(group) as arguments:
            slots = [[p for p in params if p.dtype == dtype] for dtype in NORM_SLOTS]
            for slot, slot_norms in zip(slots, self._slot_norms(group, slots)):
                if not slot:
                    continue
                self._zero_state(slot, "exp_avg")
                update(
                    slot,
                    [p.grad for p in slot],  # type: ignore[misc]
                    [self.state[p]["exp_avg"] for p in slot],
                    slot_norms,
                    grad_averaging=bool(group["grad_averaging"]),
                    moment_mode=self.moment_mode,
                    norm_type=group["norm_type"],
                    **arguments,
                )

    @staticmethod
    def _slot_norms(group: dict[str, Any], slots: list[list[Tensor]]) -> list[Tensor]:
        """The group's per-dtype norm tensors, created on first use and checked against the parameters."""
        initial = 0.0 if group["init_zero"] else UNSET_NORM
        norms: list[Tensor] = list(group.get("exp_avg_sq", []))
        had_bf16_slot = len(norms) > 2
        for i, slot in enumerate(slots):
            if i >= len(norms):
                device = slot[0].device if slot else group["params"][0].device
                norms.append(torch.full((len(slot),), initial, dtype=torch.float32, device=device))
            elif norms[i].numel() != len(slot):
                raise RuntimeError(
                    f"FusedNovoGrad keeps one norm per parameter with a gradient; this group had "
                    f"{norms[i].numel()} {NORM_SLOTS[i]} such parameters and now has {len(slot)}"
                )
        # Keep Apex's two-entry layout unless bf16 parameters need the third slot.
        group["exp_avg_sq"] = norms if slots[2] or had_bf16_slot else norms[:2]
        return norms
