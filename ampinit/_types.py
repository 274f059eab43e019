"""Names and value sets shared across ampinit's layers; each is spelled here once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

OptLevel = Literal["O0", "O1", "O2", "O3", "O4", "O5"]
OPT_LEVELS: tuple[OptLevel, ...] = get_args(OptLevel)

#: The O1/O4 op lists: ``"apex"`` adds Apex's list entries that PyTorch's autocast lacks, ``"native"`` none, and
#: ``"auto"`` (``initialize``'s default) those of ``"apex"`` less the entries measured to change no result on the
#: device (``ampinit._casting.lists.UNCHANGED``).
CastPolicyName = Literal["auto", "apex", "native"]
CAST_POLICIES: tuple[CastPolicyName, ...] = get_args(CastPolicyName)

#: The reduced-precision dtypes a model or a cast policy may use, and every dtype a model may be cast to.
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, *HALF_DTYPES)

TensorList = list[torch.Tensor]
#: What ``scale_loss`` takes: the optimizer, or the optimizers, whose parameters get this backward's gradients.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
