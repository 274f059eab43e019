"""The O1/O4 casting wing, one concern per module.

=================  ===========================================================================================
``lists``          Apex's op lists as data, the aten operators they reach, and the plan of extra kernels
``arguments``      autocast's eligibility rule, the weight-cast cache, the dtype helpers
``scopes``         which policy is on, per thread and process-wide
``kernels``        the extra autocast kernels and their reference-counted registration
``policy``         ``CastPolicy``: autocast switched on for a session, forward hooks, suspension
``user_functions`` Apex's ``half_function``/``register_half_function`` family
``apex_tensor``    Apex's O1 tensor rules under the Apex API: ``.cpu()`` to fp32, in-place fp32 ops on fp16 refused
=================  ===========================================================================================
"""

from ampinit._casting.policy import CastPolicy
from ampinit._casting.user_functions import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

__all__ = [
    "CastPolicy",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]
