"""``apex.amp.lists.functional_overrides``: Apex's O1 lists for ``MODULE``, as lists code may edit before initialize."""

from ampinit._casting.lists import BANNED_BCE_MESSAGE as _BANNED_MESSAGE
from ampinit._casting.lists import DEFAULT_LISTS as _DEFAULTS
from ampinit._casting.lists import LIST_MODULES as _MODULES

# As in Apex, no CASTS or SEQUENCE_CASTS here: only torch and Tensor functions were promoted.
__all__ = ["BANNED_FUNCS", "FP16_FUNCS", "FP32_FUNCS", "MODULE"]

MODULE = _MODULES["functional_overrides"]
FP16_FUNCS = list(_DEFAULTS.get("functional_overrides", "FP16_FUNCS"))
FP32_FUNCS = list(_DEFAULTS.get("functional_overrides", "FP32_FUNCS"))
# Apex's (name, message) pairs. Read-only in effect: ampinit raises its own message, addressed to its API, and
# ``allow_banned=True`` is the way to compute these in fp32.
BANNED_FUNCS = [("binary_cross_entropy", _BANNED_MESSAGE)]
