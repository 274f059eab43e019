"""``apex.optimizers``: ampinit's fused optimizers, with Apex's constructors (see docs/optimizers.md).

``apex.optimizers.FP16_Optimizer`` existed only from Apex commit be42aad5 (2018-12-05, "WIP: improve fused adam")
to commit 1904e48d (2019-10-04, "move previous fused_adam and fp16_optimizer to contrib", #517): a cut-down
``apex.fp16_utils.FP16_Optimizer`` for FusedAdam that kept one flat fp32 master per group. Code of that era still
imports it from here, so the name resolves, with a FutureWarning, to ``apex.fp16_utils.FP16_Optimizer``: the same
constructor, ``backward(loss)``, ``step()`` and ``zero_grad()``; the old class's per-group ``max_grad_norm``
clipping is done by FusedAdam itself (see ``ampinit.optimizers.fused_adam``). Its checkpoints (``cur_scale``,
``fp32_groups_flat``) are the one thing that does not carry over, and the warning says so.
"""

import warnings

from ampinit.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

__all__ = [
    "FP16_Optimizer",  # noqa: F822 (served, with its FutureWarning, by __getattr__)
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
]

FP16_OPTIMIZER_WARNING = (
    "apex.optimizers.FP16_Optimizer is Apex's 2018-12..2019-10 name (commits be42aad5 to 1904e48d, which moved it "
    "to apex.contrib.optimizers) of a FusedAdam-only FP16_Optimizer with flat fp32 masters per group; ampinit "
    "gives apex.fp16_utils.FP16_Optimizer instead (same constructor, backward(loss), step(), zero_grad()), whose "
    "state_dict has another layout: a checkpoint saved by the old class (cur_scale, fp32_groups_flat) does not "
    "load. Import it from apex.fp16_utils"
)


def __getattr__(name: str) -> object:
    if name == "FP16_Optimizer":
        from ampinit.compat.apex.fp16_utils import FP16_Optimizer

        warnings.warn(FP16_OPTIMIZER_WARNING, FutureWarning, stacklevel=2)
        return FP16_Optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
