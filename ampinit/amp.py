"""Apex-style namespace: ``from ampinit import amp; amp.initialize(...)``.

The same objects as the package root, so ``amp.X is ampinit.X`` for every public name.
"""

from ampinit import (
    AmpSession,
    AmpStats,
    DynamicLossScale,
    LossScaleAtMinimumError,
    Properties,
    current_session,
    deinitialize,
    disable_casts,
    float_function,
    half_function,
    initialize,
    load_state_dict,
    master_params,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
    scale_loss,
    session_of,
    state_dict,
    stats,
    step_was_skipped,
)

__all__ = [
    "AmpSession",
    "AmpStats",
    "DynamicLossScale",
    "LossScaleAtMinimumError",
    "Properties",
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
