"""``amp.clip_grad_norm_`` folded into the step: no fp32 master grad, no fp32 master made for the clip.

Apex's pattern, ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)``, needs the fp32 master
grads. Where O2/O5's kernel step would read the half grads (``grads.PendingGrads``), asking for them makes amp write
them: per parameter 4 bytes allocated, 2 read and 4 written to make them, 4 read by the norm, 8 by the multiply,
and the step reads 4 where it would have read 2: 22 bytes of grad traffic where the fold moves 4. Where the
masters live in the bf16 weights (``master_weights="remainder"`` and the dial's other bf16 settings), it makes each
fp32 master too, and such masters take the chunked step, not the kernels.

The fold needs only the half grads' norms: each half grad's norm accumulated in fp32
(``torch._foreach_norm(..., dtype=torch.float32)``), times the factor the step will apply (the pending ``1/scale``),
is the norm of the fp32 grad the step would use; the clip coefficient then joins that factor, which the kernels (and
the chunked step, after widening) multiply every grad they read by. The norm reads 2 bytes per parameter; the rest
of the traffic is the step's own. Grads the optimizer reads as they are (fp32 parameters updated directly) are
clipped in place, by torch's ``clip_grads_with_norm_``.

The result is Apex's pattern's, bit for bit, where these hold:

- the factor is a power of two (a scale of 1, every dynamic scale; remainder grads are already unscaled): a widened
  grad times it is exact in fp32, so is scaling a norm of order 1, 2 or inf by it, and the half grad times
  ``factor * coefficient`` rounds once, as the master grad times the coefficient does. Other scales and norm orders
  run Apex's pattern (the callers return None);
- torch reduces a half tensor's norm with an fp32 accumulator in the order it reduces the widened tensor: it did
  under torch 2.11, 2.13 and 2.14 on CPU (``tests/test_clip.py``), whose GPU run checks CUDA's;
- the grads are plain tensors on one device, and those the optimizer reads as they are have fp32's dtype (torch
  stacks the per-tensor norms by dtype, here they are stacked in parameter order).

The total and the coefficient are torch's ops (``torch.nn.utils.clip_grad``), so the value returned is torch's.
"""

from __future__ import annotations

import math

import torch

from ampinit import _torch_kernels

#: Norm orders whose value scales exactly with a power-of-two factor (the fused clip's condition).
EXACT_ORDERS = frozenset({1.0, 2.0, math.inf})


def total_norm(
    grads: list[torch.Tensor], scaled: list[bool], factor: torch.Tensor | None, norm_type: float
) -> torch.Tensor:
    """The total norm torch's ``clip_grad_norm_`` reports for the fp32 grads ``g.float() * factor`` (where
    ``scaled``) and ``g`` (elsewhere), in this order, from the grads as they are. ``factor`` None: 1."""
    half = [g for g, s in zip(grads, scaled) if s]
    own = [g for g, s in zip(grads, scaled) if not s]
    own_norms = list(_torch_kernels.foreach_norm(own, norm_type)) if own else []
    stacked = torch.stack(own_norms) if own_norms else None
    if half:
        stacked = torch.stack(_torch_kernels.foreach_norm(half, norm_type, dtype=torch.float32))
        if factor is not None:
            stacked = stacked * factor.reshape(())
        if own_norms:  # both kinds: torch stacks the norms in the parameters' order
            halves, owns = iter(stacked.unbind()), iter(own_norms)
            stacked = torch.stack([next(halves) if s else next(owns) for s in scaled])
    assert stacked is not None, "no grads: the callers fold none"
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


def fold_(
    grads: list[torch.Tensor],
    scaled: list[bool],
    own: list[torch.Tensor],
    factor: torch.Tensor | None,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's clip of the fp32 grads :func:`total_norm` describes, but for the ``scaled`` ones: the parameters
    ``own`` (those whose grads are not ``scaled``, in place, by ``torch.nn.utils.clip_grads_with_norm_``) are
    clipped; the ``scaled`` grads are left to the caller, which multiplies them by the coefficient returned, after
    ``factor``. Returns the total norm and the coefficient (0-d fp32 tensors on the grads' device)."""
    total = total_norm(grads, scaled, factor, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        # torch's error, after the same host read of the norm
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    if own:
        torch.nn.utils.clip_grads_with_norm_(own, max_norm, total)
    # torch's coefficient (clip_grads_with_norm_): max_norm / (total + 1e-6), at most 1
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def same_device(grads: list[torch.Tensor]) -> bool:
    """Whether ``grads`` are plain tensors on one device (the fused clip's condition: torch's clip of a sharded
    grad or of grads on several devices is left to torch)."""
    if not grads:
        return False
    device = grads[0].device
    return all(type(g) is torch.Tensor and g.device == device for g in grads)
