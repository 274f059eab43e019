"""The master-weight optimizer step as one operation, in plain torch ops: the reference of the Triton kernels.

With master weights (O2/O5) a step, unfused, is: widen the half grads to fp32 and unscale them, check them for
inf/NaN, run the optimizer on the fp32 masters, and copy the masters back into the half model weights. The
functions here do all of it in one call, per list of tensors:

- :func:`check_finite_` raises the overflow flag if any (still scaled, still half) grad is inf or NaN;
- :func:`adam_` and :func:`sgd_` read each grad in its own dtype, multiply it by ``inv_scale``, update the
  fp32 master and the optimizer state, and write the master, rounded to nearest-even, into the half weight; they
  do nothing at all when ``found_inf`` is nonzero. With remainder masters (:class:`Masters`) they join each
  master from its bf16 weight and remainder and split it back instead;
- :func:`adam_dial_` and :func:`sgd_dial_` run the same per-element math over the precision dial's storages
  (:mod:`ampinit._masters.precision`): masters as above, as bf16 weights with 8-bit remainders
  (``Masters.remainder8``) or as bare bf16 weights (``Masters.stochastic``), and optimizer state as fp32, bf16 or
  8-bit block-wise codes (:class:`Moments`). Each step decodes the master and the moments, updates them in fp32,
  and encodes what it stores (stochastic rounding with the keys the caller passes, one per tensor and purpose).
  ``adam_`` and ``sgd_`` are these with fp32 moments.

The functions in this module are the *reference*: plain torch ops in a fixed order, each op rounded to fp32 (no
fused multiply-add), so that ``ampinit._masters.triton_kernels``, which take the same arguments, reproduce them
bit for bit. The per-element math is that of torch's fused CPU kernels (``m*beta1 + g*(1-beta1)``, ``v*beta2 +
g*g*(1-beta2)``, ``sqrt(v)/sqrt(bc2) + eps``), with the bias corrections computed once per tensor in float64 by
:func:`adam_step_scalars`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from ampinit import _torch_kernels
from ampinit._masters import precision
from ampinit._masters import remainder as encoding
from ampinit._types import TensorList

MasterKind = Literal["fp32", "remainder", "remainder8", "stochastic"]
MomentFormat = Literal["fp32", "bf16", "8bit"]


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

    ``kind`` says how (build one with the class method of its name):

    - ``"fp32"``: fp32 ``masters``, updated in place, and the half model ``weights`` written from them (empty:
      none);
    - ``"remainder"``: bf16 ``weights`` with the int16 ``remainders`` that make them fp32 masters
      (:mod:`ampinit._masters.remainder`);
    - ``"remainder8"``: bf16 ``weights`` with int8 ``remainders``, 24-bit masters whose low 8 bits are rounded
      stochastically on the way back (:mod:`ampinit._masters.precision`);
    - ``"stochastic"``: bf16 ``weights`` only: the fp32 update result is stochastically rounded into them.

    ``keys`` (``"remainder8"``, ``"stochastic"``) holds one int64 random key per tensor (purpose 0 of
    :func:`ampinit._masters.precision.keys`), on the tensors' device.
    """

    masters: TensorList
    weights: TensorList
    remainders: TensorList
    kind: MasterKind = "fp32"
    keys: torch.Tensor | None = None

    @classmethod
    def fp32(cls, masters: TensorList, weights: TensorList | None = None) -> Masters:
        return cls(masters, weights or [], [])

    @classmethod
    def remainder(cls, weights: TensorList, remainders: TensorList) -> Masters:
        return cls([], weights, remainders, "remainder")

    @classmethod
    def remainder8(cls, weights: TensorList, remainders: TensorList, keys: torch.Tensor) -> Masters:
        _check_keys(keys, len(weights), "remainder8 masters")
        return cls([], weights, remainders, "remainder8", keys)

    @classmethod
    def stochastic(cls, weights: TensorList, keys: torch.Tensor) -> Masters:
        _check_keys(keys, len(weights), "stochastic masters")
        return cls([], weights, [], "stochastic", keys)

    def take(self, indices: list[int]) -> Masters:
        """The masters at ``indices``, stored as these are."""

        def pick(tensors: TensorList) -> TensorList:
            return [tensors[i] for i in indices] if tensors else []

        keys = None if self.keys is None else self.keys[indices]
        return Masters(pick(self.masters), pick(self.weights), pick(self.remainders), self.kind, keys)

    def master(self, i: int) -> torch.Tensor:
        """Master ``i`` as an fp32 tensor: the master itself, or decoded from its storage (a new tensor)."""
        if self.kind == "remainder":
            return encoding.join(self.weights[i], self.remainders[i])
        if self.kind == "remainder8":
            return precision.join8(self.weights[i], self.remainders[i])
        if self.kind == "stochastic":
            return precision.decode_bf16(self.weights[i])
        return self.masters[i]

    def store(self, i: int, master: torch.Tensor) -> None:
        """Keep the updated ``master`` ``i``: written into its half weight, or encoded back (``master`` is scratch)."""
        if self.kind == "remainder":
            encoding.split_(master, self.weights[i], self.remainders[i])
        elif self.kind == "remainder8":
            precision.split8_keyed_(master, self.weights[i], self.remainders[i], self._key(i))
        elif self.kind == "stochastic":
            precision.encode_bf16_keyed_(self.weights[i], master, self._key(i))
        elif self.weights:
            self.weights[i].copy_(master)

    def _key(self, i: int) -> torch.Tensor:
        assert self.keys is not None  # the constructors of the stochastic kinds take keys
        return self.keys[i]


@dataclass(frozen=True)
class Moments:
    """One list of optimizer state (``exp_avg``, ``exp_avg_sq`` or ``momentum_buffer``) in its stored format.

    - ``"fp32"``: fp32 ``values``, torch's layout, updated in place;
    - ``"bf16"``: bf16 ``values``, stochastically rounded with ``keys`` (one int64 per tensor, purpose 1 or 2);
    - ``"8bit"``: uint8 codes in ``values`` (the parameter's shape) and fp32 per-block scales in ``absmax``, with
      the map ``qmap`` (signed for ``exp_avg``/``momentum_buffer``, unsigned for ``exp_avg_sq``).
    """

    format: MomentFormat
    values: TensorList
    absmax: TensorList = field(default_factory=list)
    keys: torch.Tensor | None = None
    qmap: precision.QuantMap | None = None

    @classmethod
    def fp32(cls, values: TensorList) -> Moments:
        return cls("fp32", values)

    @classmethod
    def bf16(cls, values: TensorList, keys: torch.Tensor) -> Moments:
        _check_keys(keys, len(values), "bf16 moments")
        return cls("bf16", values, keys=keys)

    @classmethod
    def eight_bit(cls, codes: TensorList, absmax: TensorList, qmap: precision.QuantMap) -> Moments:
        return cls("8bit", codes, absmax, qmap=qmap)

    def take(self, indices: list[int]) -> Moments:
        """The moments at ``indices``, stored as these are."""

        def pick(tensors: TensorList) -> TensorList:
            return [tensors[i] for i in indices] if tensors else []

        keys = None if self.keys is None else self.keys[indices]
        return Moments(self.format, pick(self.values), pick(self.absmax), keys, self.qmap)

    def load(self, i: int) -> torch.Tensor:
        """Moment ``i`` as fp32: the tensor itself (fp32) or decoded (exactly for bf16)."""
        if self.format == "bf16":
            return precision.decode_bf16(self.values[i])
        if self.format == "8bit":
            assert self.qmap is not None
            return precision.dequantize_blockwise(self.values[i], self.absmax[i], self.qmap)
        return self.values[i]

    def store(self, i: int, value: torch.Tensor) -> None:
        """Keep the fp32 ``value`` of moment ``i``, encoded in this format."""
        if self.format == "bf16":
            assert self.keys is not None
            precision.encode_bf16_keyed_(self.values[i], value, self.keys[i])
        elif self.format == "8bit":
            assert self.qmap is not None
            codes, absmax = precision.quantize_blockwise(value, self.qmap)
            self.values[i].copy_(codes)
            self.absmax[i].copy_(absmax)
        else:
            self.values[i].copy_(value)


def _check_keys(keys: torch.Tensor, count: int, what: str) -> None:
    if keys.dtype != torch.int64 or keys.shape != (count,):
        raise ValueError(
            f"{what} need one int64 random key per tensor ({count}), got {keys.dtype} of shape {tuple(keys.shape)}"
        )


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


def step_scalars_(
    powers: torch.Tensor, lr: float, steps: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`adam_step_scalars`' rows from the counts' float64 powers ``powers = [beta1**step; beta2**step]``
    (``2 x n``); with ``found_inf``, the counts ``steps`` (advanced by one) are taken back by it, after the powers
    were computed (a step the flag skips uses no scalar)."""
    bias_correction1, bias_correction2 = 1 - powers
    scalars = torch.stack([lr / bias_correction1, bias_correction2.sqrt()], dim=1).float()
    if found_inf is not None:
        assert steps is not None, "a flag takes back counts"
        steps.sub_(found_inf)
    return scalars


def advance_step_scalars_(
    steps: torch.Tensor, betas: torch.Tensor, lr: float, found_inf: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`step_scalars_` of the counts ``steps`` advanced by one (in their dtype, torch's ``add_(1.0)``), their
    powers torch's float64 ``pow`` of ``betas`` (``[beta1, beta2]``); with ``found_inf``, the advanced counts are
    taken back by it."""
    steps.add_(1.0)
    powers = torch.pow(betas.reshape(2, 1), steps)
    return step_scalars_(powers, lr, steps, found_inf)


def update_scale_(
    scale: torch.Tensor,
    tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float | None,
    max_scale: float,
) -> torch.Tensor:
    """A dynamic loss scale's update (hysteresis 1) as torch's ops do it: ``_amp_update_scale_`` (through
    ``_torch_kernels``, the one module that names torch's private kernels), ``clamp_`` and ``reciprocal`` (the scale
    and tracker in place; the new ``1 / scale`` a new tensor)."""
    _torch_kernels.update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    scale.clamp_(min=min_scale, max=max_scale)
    return torch.reciprocal(scale)


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
    grad_key: object = None,
    known: object = None,
    prepared: object = None,
) -> None:
    """One Adam or AdamW step of ``masters`` from ``grads``.

    ``step_scalars`` comes from :func:`adam_step_scalars` (one row per tensor). ``grad_key``, ``known`` and
    ``prepared`` are the Triton twin's (what the caller read of the grads, masters and weights when it checked them,
    and the launch's tables made before it); the tensors are read here as they are.
    """
    moments = Moments.fp32(exp_avgs), Moments.fp32(exp_avg_sqs)
    adam_dial_(grads, masters, *moments, step_scalars, settings, inv_scale=inv_scale, found_inf=found_inf)


def adam_tables(
    grads: TensorList,
    masters: Masters,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    *,
    grad_key: object = None,
    known: object = None,
) -> None:
    """The Triton twin's launch tables, made before a step's first launch: none here (nothing is read through a
    pointer, so nothing is refused)."""


def sgd_tables(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: TensorList,
    *,
    grad_key: object = None,
    known: object = None,
) -> None:
    """As :func:`adam_tables`."""


def adam_dial_(
    grads: TensorList,
    masters: Masters,
    exp_avgs: Moments,
    exp_avg_sqs: Moments,
    step_scalars: torch.Tensor,
    settings: AdamSettings,
    *,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """:func:`adam_` over any storage of the masters and the moments: the update runs on the fp32 moments of this
    step, and only what is stored is encoded."""
    _check_maps(exp_avgs, signed=True, what="exp_avg")
    _check_maps(exp_avg_sqs, signed=False, what="exp_avg_sq")
    if skipped(found_inf):
        return
    s = settings
    with torch.no_grad():
        for i, grad in enumerate(grads):
            g = _unscaled(grad, inv_scale, s.maximize)
            p = master = masters.master(i)
            if s.weight_decay != 0:
                if s.decoupled:
                    p = p * (1 - s.lr * s.weight_decay)
                else:
                    g = g + p * s.weight_decay
            m = exp_avgs.load(i) * s.beta1 + g * (1 - s.beta1)
            v = exp_avg_sqs.load(i) * s.beta2 + (g * g) * (1 - s.beta2)
            exp_avgs.store(i, m)
            exp_avg_sqs.store(i, v)
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
    grad_key: object = None,
    known: object = None,
    prepared: object = None,
) -> None:
    """One SGD step (torch's rule; with momentum the buffers are set to the grad on ``first_step``).

    ``momentum_buffers`` is empty when ``settings.momentum == 0``. ``grad_key``, ``known`` and ``prepared``: as
    :func:`adam_`'s.
    """
    buffers = Moments.fp32(momentum_buffers)
    sgd_dial_(grads, masters, buffers, settings, first_step=first_step, inv_scale=inv_scale, found_inf=found_inf)


def sgd_dial_(
    grads: TensorList,
    masters: Masters,
    momentum_buffers: Moments,
    settings: SgdSettings,
    *,
    first_step: bool,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """:func:`sgd_` over any storage of the masters and the momentum buffers (as :func:`adam_dial_`)."""
    _check_maps(momentum_buffers, signed=True, what="momentum_buffer")
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
                buf = g if first_step else momentum_buffers.load(i) * s.momentum + g * (1 - s.dampening)
                momentum_buffers.store(i, buf)
                g = g + buf * s.momentum if s.nesterov else buf
            master.copy_(master - g * s.lr)  # bitwise torch's p + (-lr)*g
            masters.store(i, master)


def _check_maps(moments: Moments, *, signed: bool, what: str) -> None:
    if moments.format == "8bit" and (moments.qmap is None or moments.qmap.signed != signed):

        def name(signed_map: bool) -> str:
            return "signed" if signed_map else "unsigned"

        got = "no map" if moments.qmap is None else f"the {name(moments.qmap.signed)} one"
        raise ValueError(f"8-bit {what} is quantized with the {name(signed)} dynamic map, got {got}")
