"""Apex's fused optimizers (``apex.optimizers``) on PyTorch's own fused and foreach kernels.

Each class takes Apex's constructor arguments with Apex's defaults, supports the AMP-scaling protocol of
``torch.amp.GradScaler`` (``grad_scale``/``found_inf``, no host sync) and float32, float16 and bfloat16
parameters. See ``docs/optimizers.md``.
"""

from ampinit.optimizers.fused_adagrad import FusedAdagrad
from ampinit.optimizers.fused_adam import FusedAdam
from ampinit.optimizers.fused_lamb import FusedLAMB
from ampinit.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from ampinit.optimizers.fused_novograd import FusedNovoGrad
from ampinit.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedSGD"]
