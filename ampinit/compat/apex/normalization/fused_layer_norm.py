"""``apex.normalization.fused_layer_norm``: the module path older code imports the layer norms from."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

Shape = int | Sequence[int] | torch.Size

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]


def _shape(normalized_shape: Shape) -> torch.Size:
    if isinstance(normalized_shape, numbers.Integral):
        return torch.Size((int(normalized_shape),))
    if isinstance(normalized_shape, str) or not isinstance(normalized_shape, (Sequence, torch.Size)):
        kind = type(normalized_shape).__name__
        raise TypeError(f"normalized_shape must be an int, a sequence of ints or a torch.Size, got {kind}")
    return torch.Size(tuple(int(d) for d in normalized_shape))


def _effective_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype Apex's kernel sees: under autocast, Apex first casts its floating arguments to the autocast dtype
    (torch's autocast ``_cast``, which leaves float64 alone)."""
    if tensor.is_floating_point() and tensor.dtype != torch.float64 and torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32, as Apex's kernels accumulate half and fp32 inputs; float64 where one is float64 (their ``acc_type``)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _layer_norm(
    x: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    dtype = _compute_dtype(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        w = None if weight is None else weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        return F.layer_norm(x.to(dtype), shape, w, b, eps)


def _rms_norm(x: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = _compute_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        w = None if weight is None else weight.to(dtype)
        return F.rms_norm(x.to(dtype), shape, w, eps)


class _ApexNorm(torch.nn.Module):
    """What Apex's norm modules share: the arguments, the affine parameters, the output dtype rule."""

    _HAS_BIAS = True
    weight: torch.nn.Parameter | None

    def __init__(
        self,
        normalized_shape: Shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        names = ("weight", "bias") if self._HAS_BIAS else ("weight",)
        for name, init in zip(names, (torch.ones, torch.zeros)):
            if elementwise_affine:
                setattr(self, name, torch.nn.Parameter(init(self.normalized_shape)))
            else:
                self.register_parameter(name, None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        bias = getattr(self, "bias", None)  # RMS norms have none
        if bias is not None:
            torch.nn.init.zeros_(bias)

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        return _effective_dtype(x)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedLayerNorm(_ApexNorm):
    """Apex's ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``.

    ``memory_efficient`` only chose what Apex's kernel saved for backward; it is accepted and changes nothing here.
    """

    bias: torch.nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return out.to(self._output_dtype(x))


class FusedRMSNorm(_ApexNorm):
    """Apex's ``FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``:
    ``x / sqrt(mean(x**2) + eps) * weight`` over the last ``len(normalized_shape)`` dimensions."""

    _HAS_BIAS = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.normalized_shape, self.weight, self.eps).to(self._output_dtype(x))


def _mixed_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    if "elementwise_affine" in kwargs:
        affine = kwargs.pop("elementwise_affine")
        if not affine:
            raise RuntimeError(f"{name} does not support elementwise_affine=False (Apex's rule); use Fused{name[10:]}")
        warnings.warn(f"{name} does not support the elementwise_affine argument (it is always True)", stacklevel=3)
    if kwargs:
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(kwargs)}; allowed: eps, memory_efficient")


class _WeightDtypeOutput(_ApexNorm):
    """Apex's "mixed" norms: always affine, and the output has the weight's dtype."""

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        assert self.weight is not None
        return _effective_dtype(self.weight)


class MixedFusedLayerNorm(_WeightDtypeOutput, FusedLayerNorm):
    """Apex's ``MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: always affine, and the
    output has the weight's dtype (fp32 weights on a half input give an fp32 output)."""

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs: Any):
        _mixed_kwargs("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient)


class MixedFusedRMSNorm(_WeightDtypeOutput, FusedRMSNorm):
    """Apex's ``MixedFusedRMSNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: always affine, and the
    output has the weight's dtype."""

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs: Any):
        _mixed_kwargs("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient)


# -- Apex's functional forms (timm, Megatron and fairseq call these directly) ----------------------------------------
# Apex's defaults: eps=1e-6 here, unlike the modules' 1e-5. ``memory_efficient`` changes nothing here (see above).
# Each spells out Apex's signature, so the plain and mixed-dtype forms repeat their arguments; the work is shared.


def fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """Layer norm with weight and bias, statistics in fp32, output in the input's (autocast) dtype."""
    return _layer_norm(input, _shape(normalized_shape), weight, bias, eps).to(_effective_dtype(input))


def fused_layer_norm(
    input: torch.Tensor, normalized_shape: Shape, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """Layer norm without affine parameters."""
    return _layer_norm(input, _shape(normalized_shape), None, None, eps).to(_effective_dtype(input))


def mixed_dtype_fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """Layer norm whose output has the weight's dtype (``MixedFusedLayerNorm``'s function)."""
    return _layer_norm(input, _shape(normalized_shape), weight, bias, eps).to(_effective_dtype(weight))


def fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """RMS norm with a weight, output in the input's (autocast) dtype."""
    return _rms_norm(input, _shape(normalized_shape), weight, eps).to(_effective_dtype(input))


def fused_rms_norm(
    input: torch.Tensor, normalized_shape: Shape, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """RMS norm without a weight."""
    return _rms_norm(input, _shape(normalized_shape), None, eps).to(_effective_dtype(input))


def mixed_dtype_fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """RMS norm whose output has the weight's dtype (``MixedFusedRMSNorm``'s function)."""
    return _rms_norm(input, _shape(normalized_shape), weight, eps).to(_effective_dtype(weight))


class FusedLayerNormAffineFunction:
    """Apex's autograd function, called as ``FusedLayerNormAffineFunction.apply(input, weight, bias,
    normalized_shape, eps[, memory_efficient])`` (Megatron does); torch's layer_norm provides the backward."""

    apply = staticmethod(fused_layer_norm_affine)


class FusedLayerNormFunction:
    """``FusedLayerNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``."""

    apply = staticmethod(fused_layer_norm)


class FusedRMSNormAffineFunction:
    """``FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps[, memory_efficient])``."""

    apply = staticmethod(fused_rms_norm_affine)


class FusedRMSNormFunction:
    """``FusedRMSNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``."""

    apply = staticmethod(fused_rms_norm)
