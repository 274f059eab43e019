"""``amp_C``: Apex's multi-tensor ops under their Apex names, written on ampinit's kernel boundary.

``import amp_C`` resolves to this module once the aliases are installed (``ampinit run``); ``ampinit.multi_tensor``
re-exports it. Every op takes Apex's leading ``(chunk_size, noop_flag, tensor_lists)`` arguments followed by
Apex's own; call them directly or through ``apex.multi_tensor_apply.multi_tensor_applier``. ``chunk_size`` is
accepted and ignored: torch's kernels choose their own chunking. ``noop_flag`` is an int32 tensor of shape [1];
ops set it to 1 where Apex's kernels do and never clear it, and the ops that Apex makes exit early when it is
set (``multi_tensor_sgd``) skip their update on the device, without a host sync.

Differences from Apex's harness: tensors in one list may mix dtypes (each op runs once per device and
dtype combination), an empty ``tensor_lists[0]`` is a no-op instead of an error, and the tensors need not be
on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _kernels
from ampinit._kernels import device_scalar, fp32_copies, group_indices, l2_norms, pick, total_norm, write_back
from ampinit.optimizers._adam_math import adam_update_foreach, bias_corrections, clip_divisor
from ampinit.optimizers.fused_adagrad import adagrad_multi_tensor
from ampinit.optimizers.fused_adam import adam_multi_tensor
from ampinit.optimizers.fused_lamb import lamb_multi_tensor
from ampinit.optimizers.fused_novograd import novograd_multi_tensor
from ampinit.optimizers.fused_sgd import sgd_multi_tensor

__all__ = [
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "multi_tensor_novograd",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]

TensorLists = Sequence[Sequence[Tensor]]

# Each op spells out Apex's positional signature (Megatron, NeMo and Apex's optimizers call them positionally),
# so ops with the same arguments repeat them; what they compute is shared below and in ampinit.optimizers.


def flag_if(noop_flag: Tensor, condition: Tensor) -> None:
    """Set the int32 ``noop_flag`` to 1 if the 0-d or one-element ``condition`` is true; never clear it."""
    noop_flag.masked_fill_(condition.reshape(1).to(device=noop_flag.device, dtype=torch.bool), 1)


def _check_lists(name: str, tensor_lists: TensorLists, depths: tuple[int, ...]) -> bool:
    """Validate Apex's list-shape rules; return False when there is nothing to do."""
    if len(tensor_lists) not in depths:
        raise ValueError(f"{name} takes {' or '.join(map(str, depths))} tensor lists, got {len(tensor_lists)!r}")
    lengths = [len(tensors) for tensors in tensor_lists]
    if len(set(lengths)) != 1:
        raise ValueError(f"{name}: every tensor list must have the same length, got lengths {lengths!r}")
    for tensors in tensor_lists[1:]:
        for i, (first, other) in enumerate(zip(tensor_lists[0], tensors)):
            if first.numel() != other.numel():
                raise ValueError(
                    f"{name}: tensor {i} has {first.numel()} elements in the first list and {other.numel()} in another"
                )
    return lengths[0] > 0


def _exact_copy(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or dst in (torch.float32, torch.float64)


def _scale_into(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: float) -> list[Tensor]:
    """``outputs = inputs * scale`` in float32 math; returns per-device flags of non-finite *inputs*."""
    flags = []
    for (device, (src_dtype, dst_dtype)), indices in group_indices([inputs, outputs]).items():
        src, dst = pick(inputs, indices), pick(outputs, indices)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        # The amp kernel checks the values before multiplying, which is Apex's rule, so the copy it works on
        # must hold the inputs exactly: the output itself when it can, else a float32 copy.
        if _exact_copy(src_dtype, dst_dtype):
            pairs = [(d, s) for s, d in zip(src, dst) if s is not d]
            if pairs:
                _kernels.copy_([d for d, _ in pairs], [s for _, s in pairs])
            work = dst
        else:
            work = fp32_copies(src)
        _kernels.unscale_and_check_(work, found, device_scalar(scale, device))
        if work is not dst:
            _kernels.copy_(dst, work)
        flags.append(found)
    return flags


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out = in * scale`` for lists ``[in, out]``; flags any non-finite input. Never exits early."""
    if not _check_lists("multi_tensor_scale", tensor_lists, (2,)):
        return
    for found in _scale_into(tensor_lists[0], tensor_lists[1], scale):
        flag_if(noop_flag, found)


def multi_tensor_axpby(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, a: float, b: float, arg_to_check: int
) -> None:
    """``out = a*x + b*y`` for lists ``[x, y, out]``; flags non-finite x (0), y (1) or either (-1)."""
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"Invalid arg_to_check: {arg_to_check!r}. Allowed values: -1 (both), 0 (x), 1 (y)")
    if not _check_lists("multi_tensor_axpby", tensor_lists, (3,)):
        return
    for (device, _), indices in group_indices(tensor_lists).items():
        x, y = fp32_copies(pick(tensor_lists[0], indices)), fp32_copies(pick(tensor_lists[1], indices))
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for work, factor, checked in ((x, a, arg_to_check in (-1, 0)), (y, b, arg_to_check in (-1, 1))):
            if checked:
                _kernels.unscale_and_check_(work, found, device_scalar(factor, device))
            else:
                _kernels.foreach_mul_(work, factor)
        _kernels.foreach_add_(x, y)
        _kernels.copy_(pick(tensor_lists[2], indices), x)
        flag_if(noop_flag, found)


def _norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Float32 L2 norm of each tensor, in input order (fp32 sums of squares per chunk, as Apex)."""
    return l2_norms(tensors)


def _norm_result(
    noop_flag: Tensor, norms: list[Tensor], device: torch.device, per_tensor: bool | None
) -> tuple[Tensor, Tensor]:
    total = total_norm(norms, device)
    flag_if(noop_flag, ~torch.isfinite(total))
    if per_tensor and norms:
        return total, torch.stack([n.to(device) for n in norms])
    return total, torch.empty(0, dtype=torch.float32, device=device)


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """``(norm, per_tensor_norms)`` of list ``[t]``: shape [1] float32, and shape [n] (or [0] unless
    ``per_tensor``). Flags a non-finite norm."""
    device = noop_flag.device
    if not _check_lists("multi_tensor_l2norm", tensor_lists, (1,)):
        return _norm_result(noop_flag, [], device, per_tensor)
    return _norm_result(noop_flag, _norms(tensor_lists[0]), tensor_lists[0][0].device, per_tensor)


def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """Norm of ``in`` (as :func:`multi_tensor_l2norm`) and ``out = in * scale`` for lists ``[in, out]``."""
    if not _check_lists("multi_tensor_l2norm_scale", tensor_lists, (2,)):
        return _norm_result(noop_flag, [], noop_flag.device, per_tensor)
    result = _norm_result(noop_flag, _norms(tensor_lists[0]), tensor_lists[0][0].device, per_tensor)
    _scale_into(tensor_lists[0], tensor_lists[1], scale)
    return result


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """Norm of ``t * inv_scale`` for list ``[t]``, leaving ``t`` untouched. Flags a non-finite norm.

    Computed as ``norm(t) * |inv_scale|`` to avoid a scaled copy of every tensor; this differs from Apex
    only by rounding, and if ``sum(t**2)`` overflows float32 while ``sum((t*inv_scale)**2)`` does not.
    """
    if not _check_lists("multi_tensor_unscale_l2norm", tensor_lists, (1,)):
        return _norm_result(noop_flag, [], noop_flag.device, per_tensor)
    device = tensor_lists[0][0].device
    factor = inv_scale.to(device=device, dtype=torch.float32).reshape(()).abs()
    norms = [n.to(device) * factor for n in _norms(tensor_lists[0])]
    return _norm_result(noop_flag, norms, device, per_tensor)


def _adam_arguments(
    device: torch.device,
    step: int,
    lr: float,
    betas: tuple[float, float],
    epsilon: float,
    weight_decay: float,
    bias_correction: int,
) -> dict[str, Any]:
    """Apex's Adam-family op arguments as the keyword arguments of ampinit's update functions."""
    return dict(
        step=device_scalar(float(step), device),
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        eps=epsilon,
        weight_decay=weight_decay,
        bias_correction=bias_correction == 1,
    )


def multi_tensor_adam(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Adam on lists ``[g, p, m, v]``; ``mode`` 0 is L2 weight decay, 1 is AdamW. Ignores the flag."""
    if not _check_lists("multi_tensor_adam", tensor_lists, (4,)):
        return
    g, p, m, v = tensor_lists
    hyper = _adam_arguments(p[0].device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction)
    adam_multi_tensor(p, g, m, v, adam_w_mode=mode != 0, **hyper)


def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    weight_decay: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float = 1.0,
) -> None:
    """SGD on ``[g, p, m]`` or ``[g, p, m, p_out]`` (``p_out`` receives the updated ``p`` in its own dtype).

    Gradients are multiplied by ``scale`` first (without modifying them). Nothing changes if the flag is set.
    """
    if not _check_lists("multi_tensor_sgd", tensor_lists, (3, 4)):
        return
    g, p, m = tensor_lists[:3]
    if scale != 1.0:
        g = fp32_copies(g)
        _kernels.foreach_mul_(g, scale)
    sgd_multi_tensor(
        p,
        g,
        m,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        wd_after_momentum=wd_after_momentum,
        first_run=first_run,
        found_inf=noop_flag.reshape(()).ne(0).to(torch.float32),
        model_params=tensor_lists[3] if len(tensor_lists) == 4 else None,
    )


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
    if not _check_lists("multi_tensor_adagrad", tensor_lists, (3,)):
        return
    g, p, h = tensor_lists
    adagrad_multi_tensor(p, g, h, lr=lr, eps=epsilon, weight_decay=weight_decay, adagrad_w_mode=mode != 0)


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
    if not _check_lists("multi_tensor_lamb", tensor_lists, (4,)):
        return
    g, p, m, v = tensor_lists
    multi_tensor_l2norm(chunk_size, noop_flag, [p])
    updates = lamb_multi_tensor(
        p,
        g,
        m,
        v,
        **_adam_arguments(p[0].device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction),
        grad_averaging=grad_averaging == 1,
        adam_w_mode=mode != 0,
        global_grad_norm=global_grad_norm,
        max_grad_norm=max_grad_norm,
        use_nvlamb=bool(use_nvlamb),
    )
    _kernels.copy_(list(g), updates)
    multi_tensor_l2norm(chunk_size, noop_flag, [g])


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
    if not _check_lists("multi_tensor_novograd", tensor_lists, (3,)):
        return
    g, p, m = tensor_lists
    novograd_multi_tensor(
        p,
        g,
        m,
        grad_norms,
        **_adam_arguments(grad_norms.device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction),
        grad_averaging=grad_averaging == 1,
        moment_mode=mode,
        norm_type=norm_type,
    )


def _not_flagged(noop_flag: Tensor, device: torch.device) -> Tensor:
    """0-d bool on ``device``: true while the flag is clear (read on the device, never on the host)."""
    return noop_flag.reshape(()).to(device).eq(0)


def multi_tensor_l2norm_mp(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """Apex's mixed-precision-LAMB variant of :func:`multi_tensor_l2norm` (same arguments and results).

    Apex's kernel leaves its outputs unwritten when the flag is already set; here they are always the norms.
    """
    return multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)


def update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> Tensor:
    """Loss-scale update with hysteresis (Megatron's and NeMo's scaler), in place on the device; returns
    ``current_scale``.

    An overflow (``found_inf > 0``) first counts ``hysteresis_tracker`` down; while it stays above 0 the scale
    is kept and only ``growth_tracker`` is reset. Otherwise the scale is multiplied by ``backoff_factor``
    (overflow) or, after ``growth_interval`` clean steps in a row, by ``growth_factor`` unless that is not
    finite in float32. A clean step resets ``hysteresis_tracker`` to ``hysteresis``. The products are
    formed in float64 and rounded to float32, as Apex's kernel does.
    """
    found = found_inf.reshape(()).to(current_scale.device)
    tracker = hysteresis_tracker.reshape(())
    counted = torch.where(found > 0, tracker - 1, tracker)
    hold = (found > 0) & (counted > 0)
    backoff = ~hold & (found != 0)
    successful = growth_tracker.reshape(()) + 1
    grow = ~hold & ~backoff & (successful == growth_interval)
    scale = current_scale.reshape(())
    grown = (scale.double() * growth_factor).float()
    shrunk = (scale.double() * backoff_factor).float()
    new_scale = torch.where(backoff, shrunk, torch.where(grow & grown.isfinite(), grown, scale))
    new_growth = torch.where(hold | backoff | grow, torch.zeros_like(successful), successful)
    new_hysteresis = torch.where(found <= 0, torch.full_like(counted, hysteresis), counted)
    current_scale.copy_(new_scale.reshape(current_scale.shape))
    growth_tracker.copy_(new_growth.reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(new_hysteresis.reshape(hysteresis_tracker.shape))
    return current_scale


def _times(tensors: list[Tensor], factor: Tensor) -> list[Tensor]:
    """Float32 copies of ``tensors`` multiplied by the one-element ``factor`` (Apex's ``inv_scale``)."""
    work = fp32_copies(tensors)
    if work:
        _kernels.foreach_mul_(work, factor.to(device=work[0].device, dtype=torch.float32).reshape(()))
    return work


def _float64_corrections(
    step: Tensor, beta1: float, beta2: float, bias_correction: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Adam's bias corrections at the device-side ``step``, powers taken in float64 as Apex's kernels take them."""
    t = step.to(device=device, dtype=torch.float64).reshape(())
    return bias_corrections(t, beta1, beta2, bias_correction == 1)


def _adam_capturable(
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Apex's capturable Adam kernels: every input that changes per step is a device tensor, so one
    captured graph replays correctly; nothing is read on the host."""
    masters = len(tensor_lists) == 5
    decoupled = mode != 0  # Apex tests mode == 0 (L2) and takes any other value as decoupled
    for (device, _), indices in group_indices(tensor_lists).items():
        g, p, m, v = (pick(t, indices) for t in tensor_lists[:4])
        skip = ~_not_flagged(noop_flag, device)
        # The kernel multiplies the gradients by inv_scale and stores them back, then works in float32.
        wg = _times(g, inv_scale)
        source = pick(tensor_lists[4], indices) if masters else p
        wp, wm, wv = fp32_copies(source), fp32_copies(m), fp32_copies(v)
        update = adam_update_foreach(
            wp,
            wg,
            wm,
            wv,
            betas=(beta1, beta2, 1 - beta1),
            eps=epsilon,
            weight_decay=weight_decay,
            decoupled=decoupled,
            corrections=_float64_corrections(step, beta1, beta2, bias_correction, device),
        )
        _kernels.foreach_mul_(update, lr.to(device=device, dtype=torch.float32).reshape(()))
        _kernels.foreach_sub_(wp, update)
        if not decoupled and weight_decay != 0:
            # The gradient stored back is the unscaled one, without the L2 term.
            wg = _times(g, inv_scale)
        write_back(g + p + m + v, wg + wp + wm + wv, skip)
        if masters:
            write_back(pick(tensor_lists[4], indices), wp, skip)


def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Adam on lists ``[g, p, m, v]`` with ``lr``, ``step`` and ``inv_scale`` as device tensors.

    Gradients are multiplied by ``inv_scale`` and stored back; ``mode`` 0 is L2, 1 is AdamW. Nothing changes
    when the flag is set (Apex's FusedAdam passes its overflow flag here).
    """
    if not _check_lists("multi_tensor_adam_capturable", tensor_lists, (4,)):
        return
    _adam_capturable(
        noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
    )


def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """:func:`multi_tensor_adam_capturable` on ``[g, p, m, v, p_master]``: the update runs on the float32
    ``p_master``, and ``p`` receives it rounded to its own dtype."""
    if not _check_lists("multi_tensor_adam_capturable_master", tensor_lists, (5,)):
        return
    _adam_capturable(
        noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
    )


def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: Tensor,
    use_nvlamb: bool | None,
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """Apex's mixed-precision LAMB on ``[g, p, m, v]`` (float32 or half ``p``) or ``[g, p, m, v, p_model]``
    (float32 master ``p``, ``p_model`` receives it rounded).

    Three stages, each skipped when the flag is set by then, as Apex's kernels are: (1) per-tensor norms of
    ``p`` (a non-finite one sets the flag); (2) ``g*inv_scale``, divided by ``global_grad_norm /
    max_grad_norm`` when that exceeds 1, drives the Adam moments, and ``g`` is overwritten with the update
    (weight decay inside it for ``mode`` 1, in the gradient for ``mode`` 0); (3) the update norms (a non-finite
    one sets the flag) give the trust ratio ``lr * ||p|| / ||update||`` (when ``use_nvlamb`` or
    ``weight_decay != 0`` and both are nonzero, else ``lr``), and ``p -= ratio * update``. ``found_inf`` is
    accepted and unused, as in Apex (the caller copies it into the flag).
    """
    if not _check_lists("multi_tensor_lamb_mp", tensor_lists, (4, 5)):
        return
    g, p, m, v = tensor_lists[:4]
    p_norms = _flagged_norms(noop_flag, p)
    for (device, _), indices in group_indices([g, p, m, v]).items():
        wg = _times(pick(g, indices), inv_scale)
        norm = global_grad_norm.to(device=device, dtype=torch.float32).reshape(())
        _kernels.foreach_div_(wg, clip_divisor(norm, max_grad_norm.to(device=device, dtype=torch.float32).reshape(())))
        wm, wv = fp32_copies(pick(m, indices)), fp32_copies(pick(v, indices))
        update = adam_update_foreach(
            fp32_copies(pick(p, indices)),
            wg,
            wm,
            wv,
            betas=(beta1, beta2, 1 - beta1 if grad_averaging == 1 else 1.0),
            eps=epsilon,
            weight_decay=weight_decay,
            decoupled=mode != 0,
            corrections=_float64_corrections(step, beta1, beta2, bias_correction, device),
        )
        write_back(
            pick(g, indices) + pick(m, indices) + pick(v, indices), update + wm + wv, ~_not_flagged(noop_flag, device)
        )
    u_norms = _flagged_norms(noop_flag, g)
    trusted = bool(use_nvlamb) or weight_decay != 0
    _lamb_mp_apply(noop_flag, tensor_lists, lr, p_norms if trusted else None, u_norms)


def _flagged_norms(noop_flag: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Float32 L2 norm of each tensor; sets the flag if any is non-finite."""
    norms = _norms(tensors)
    flag_if(noop_flag, torch.stack([n.to(noop_flag.device) for n in norms]).isfinite().all().logical_not())
    return norms


def _lamb_mp_apply(
    noop_flag: Tensor, tensor_lists: TensorLists, lr: Tensor, p_norms: list[Tensor] | None, u_norms: list[Tensor]
) -> None:
    """Stage 3 of :func:`multi_tensor_lamb_mp`: ``p -= ratio * update`` (the update is in ``g``), with the trust
    ratio ``lr * (||p|| / ||update||)`` where ``p_norms`` is given and both norms are nonzero, else ``lr``."""
    g, p = tensor_lists[:2]
    for (device, _), indices in group_indices([g, p]).items():
        skip = ~_not_flagged(noop_flag, device)
        learning_rate = lr.to(device=device, dtype=torch.float32).reshape(())
        ratios = [learning_rate] * len(indices)
        if p_norms is not None:
            pairs = [(p_norms[i].to(device), u_norms[i].to(device)) for i in indices]
            ratios = [torch.where((pn != 0) & (un != 0), learning_rate * (pn / un), learning_rate) for pn, un in pairs]
        wp = fp32_copies(pick(p, indices))
        _kernels.foreach_sub_(wp, _kernels.foreach_mul(fp32_copies(pick(g, indices)), ratios))
        write_back(pick(p, indices), wp, skip)
        if len(tensor_lists) == 5:
            write_back(pick(tensor_lists[4], indices), wp, skip)
