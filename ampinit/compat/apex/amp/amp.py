"""``apex.amp.amp``: the old ``amp.init()`` entry point and the function-annotation API."""

from __future__ import annotations

import torch
from torch import nn

import ampinit
from ampinit import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampinit.compat.apex.amp._amp_state import _amp_state
from ampinit.compat.apex.amp.frontend import follow_apex_tensor_rules, initialize, load_state_dict, state_dict
from ampinit.compat.apex.amp.handle import AmpHandle, NoOpHandle

__all__ = [
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "state_dict",
]


class _DeviceMarker(nn.Module):
    """A weightless module on one device: tells an O1 session without models which devices to cast on."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("marker", torch.empty(0, device=device), persistent=False)


def cast_devices() -> list[str]:
    """Where ``amp.init()`` casts: CUDA on a machine that has it (Apex only ever cast CUDA tensors, so CPU code
    beside it keeps running in fp32), the CPU on a machine without one (ampinit's CPU extension)."""
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle | NoOpHandle:
    """Apex's old ``amp.init()``: switch O1 function casts on (see :func:`cast_devices` for where).

    Returns the handle; ``handle._deactivate()`` switches the casts off again. ``enable_caching`` keeps each
    weight's cast until the next ``scale_loss`` exit or optimizer step, as Apex's cache did (a session without
    models has no model forward, the only place ampinit caches otherwise); ``verbose`` does not print each cast.
    Apex's tensor rules apply as under :func:`initialize` at O1 (``.cpu()`` of a half tensor gives float32,
    in-place fp32-list functions refuse fp16).
    """
    if not enabled:
        return NoOpHandle()
    ampinit.initialize(
        [_DeviceMarker(d) for d in cast_devices()],
        opt_level="O1",
        loss_scale=loss_scale,
        verbosity=0,
        allow_banned=allow_banned,
        cast_policy="apex",  # Apex's exact lists, as under apex.amp.initialize
    )
    session = ampinit.current_session()
    assert session is not None
    follow_apex_tensor_rules(session)
    if enable_caching:
        session.cache_casts_outside_forwards()
    return _amp_state.handle_for(session, verbose=verbose)
