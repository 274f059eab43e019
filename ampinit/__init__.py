"""ampinit: automatic mixed precision for PyTorch with the NVIDIA Apex ``amp`` API.

from ampinit import amp            # or: import ampinit as amp
model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
with amp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
optimizer.step()
"""

import importlib
from typing import TYPE_CHECKING

from ampinit._version import __version__

# `ampinit --version`, `ampinit --help` and `python -m ampinit` load this package first, and the public names
# import torch (seconds): they are loaded on first use instead (PEP 562 ``__getattr__``), from these modules.
_MODULES = (
    "ampinit._api",
    "ampinit._casting",
    "ampinit._loss_scale",
    "ampinit._opt_levels",
    "ampinit._scaler",
    "ampinit._session",
    "ampinit._stuck",
    "ampinit._types",
)

if TYPE_CHECKING:
    from ampinit._api import (
        clip_grad_norm_,
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
    from ampinit._casting import (
        float_function,
        half_function,
        promote_function,
        register_float_function,
        register_half_function,
        register_promote_function,
    )
    from ampinit._loss_scale import DynamicLossScale
    from ampinit._opt_levels import Properties
    from ampinit._scaler import LossScaleAtMinimumError
    from ampinit._session import AmpSession, AmpStats
    from ampinit._stuck import StuckReport
    from ampinit._types import OptLevel

__all__ = [
    "AmpSession",
    "AmpStats",
    "DynamicLossScale",
    "LossScaleAtMinimumError",
    "OptLevel",
    "Properties",
    "StuckReport",
    "__version__",
    "clip_grad_norm_",
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


def __getattr__(name: str) -> object:
    # Only the public names: ``from ampinit import _registry`` asks here first, and must get AttributeError so
    # that the import system loads the submodule.
    if name in __all__:
        for module in _MODULES:
            found = getattr(importlib.import_module(module), name, _MISSING)
            if found is not _MISSING:
                globals()[name] = found  # later lookups are plain attribute reads
                return found
    raise AttributeError(f"module 'ampinit' has no attribute {name!r}")


_MISSING = object()
