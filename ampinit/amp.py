"""Apex-style namespace: ``from ampinit import amp; amp.initialize(...)``.

The same objects as the package root, so ``amp.X is ampinit.X`` for every public name; the list lives in one
place, ``ampinit.__all__``.
"""

import ampinit as _ampinit
from ampinit import *  # noqa: F403

__all__ = [name for name in _ampinit.__all__ if name != "__version__"]
