"""``apex.amp.lists.tensor_overrides``: Apex's O1 lists for ``MODULE``, as lists code may edit before initialize."""

from ampinit._casting.lists import DEFAULT_LISTS as _DEFAULTS
from ampinit._casting.lists import LIST_MODULES as _MODULES

__all__ = ["CASTS", "FP16_FUNCS", "FP32_FUNCS", "MODULE", "SEQUENCE_CASTS"]

MODULE = _MODULES["tensor_overrides"]
FP16_FUNCS = list(_DEFAULTS.get("tensor_overrides", "FP16_FUNCS"))
FP32_FUNCS = list(_DEFAULTS.get("tensor_overrides", "FP32_FUNCS"))
CASTS = list(_DEFAULTS.get("tensor_overrides", "CASTS"))
SEQUENCE_CASTS = list(_DEFAULTS.get("tensor_overrides", "SEQUENCE_CASTS"))
