"""``apex.amp``: Apex's public amp API, as thin aliases over ampinit (see docs/migration.md)."""

from ampinit._version import __version__ as __version__  # Apex had none; code that logs which amp is loaded reads it
from ampinit.compat.apex.amp import scaler
from ampinit.compat.apex.amp._amp_state import _amp_state, master_params
from ampinit.compat.apex.amp.amp import (
    float_function,
    half_function,
    init,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampinit.compat.apex.amp.frontend import initialize, load_state_dict, state_dict
from ampinit.compat.apex.amp.handle import disable_casts, scale_loss

__all__ = [
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "scaler",
    "state_dict",
]
