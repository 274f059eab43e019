"""ampinit: automatic mixed precision for PyTorch with the NVIDIA Apex ``amp`` API.

from ampinit import amp            # or: import ampinit as amp
model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
with amp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
optimizer.step()
"""

from ampinit._casting import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampinit._initialize import (
    current_session,
    deinitialize,
    disable_casts,
    initialize,
    load_state_dict,
    master_params,
    scale_loss,
    session_of,
    state_dict,
    stats,
    step_was_skipped,
)
from ampinit._loss_scale import DynamicLossScale
from ampinit._opt_levels import Properties
from ampinit._scaler import LossScaleAtMinimumError
from ampinit._session import AmpSession, AmpStats
from ampinit._version import __version__

__all__ = [
    "AmpSession",
    "AmpStats",
    "DynamicLossScale",
    "LossScaleAtMinimumError",
    "Properties",
    "__version__",
    "current_session",
    "deinitialize",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "session_of",
    "state_dict",
    "stats",
    "step_was_skipped",
]
