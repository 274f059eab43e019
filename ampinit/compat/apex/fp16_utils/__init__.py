"""``apex.fp16_utils``: Apex's manual mixed-precision utilities (deprecated in Apex itself; see docs/migration.md).

Every name of :mod:`.fp16util` is re-exported; its ``__all__`` is the one list of them.
"""

from ampinit.compat.apex.fp16_utils import fp16util
from ampinit.compat.apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from ampinit.compat.apex.fp16_utils.fp16util import *  # noqa: F403
from ampinit.compat.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "FP16_Optimizer", "LossScaler", *fp16util.__all__]
