"""Apex-style namespace: ``from ampinit import amp; amp.initialize(...)``.

The same objects as the package root, so ``amp.X is ampinit.X`` for every public name; the list lives in one
place, ``ampinit.__all__``. Code written for Apex's ``amp`` *package* logs ``amp.__path__``, ``__file__`` and
``__version__`` to say which amp is loaded, so this module answers all three: its ``__path__`` names ampinit's
own directory (no submodule is ever imported through it).
"""

import os as _os

import ampinit as _ampinit
from ampinit import *  # noqa: F403

__all__ = [name for name in _ampinit.__all__ if name != "__version__"]
__path__ = [_os.path.dirname(_os.path.abspath(__file__))]
