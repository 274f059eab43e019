"""``apex.optimizers``: ampinit's fused optimizers, with Apex's constructors (see docs/optimizers.md)."""

from ampinit.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]
