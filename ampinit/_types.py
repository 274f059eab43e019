"""Type aliases shared across ampinit's layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Union

import torch

OptLevel = Literal["O0", "O1", "O2", "O3", "O4", "O5"]
OPT_LEVELS: tuple[OptLevel, ...] = ("O0", "O1", "O2", "O3", "O4", "O5")
#: The levels that cast per op (a cast policy on for the session's thread and model forwards), not the weights.
FUNCTION_CAST_LEVELS: tuple[OptLevel, ...] = ("O1", "O4")

#: The dtypes a model or a cast policy may be set to.
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

ModelOrModels = Union[torch.nn.Module, list[torch.nn.Module]]
OptimizerOrOptimizers = Union[torch.optim.Optimizer, list[torch.optim.Optimizer]]
TensorList = list[torch.Tensor]
Params = Iterable[torch.Tensor]
