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
    initialize,
    load_state_dict,
    master_params,
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
    "initialize",
    "load_state_dict",
    "master_params",
    "scale_loss",
    "session_of",
    "state_dict",
    "stats",
    "step_was_skipped",
]
