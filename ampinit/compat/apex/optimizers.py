"""``apex.optimizers``: ampinit's fused optimizers, with Apex's constructors (see docs/optimizers.md)."""

from ampinit.compat.apex.fp16_utils import FP16_Optimizer  # Apex's older home of it (apex.optimizers.FP16_Optimizer)
from ampinit.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

__all__ = [
    "FP16_Optimizer",
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
]
