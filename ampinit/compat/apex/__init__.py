"""Apex's public surface as thin aliases over ampinit: ``apex.amp``, ``apex.optimizers``, ``apex.fp16_utils``,
``apex.parallel``, ``apex.multi_tensor_apply`` and ``amp_C``.

Use them directly (``from ampinit.compat.apex import amp``) or make ``import apex`` resolve here:
``ampinit run script.py`` (the script runs unchanged), or ``ampinit.compat.apex.install()`` / ``uninstall()``.
See docs/migration.md for what differs from Apex and why.
"""

from ampinit._version import __version__ as __version__  # Apex had none; code that logs which amp is loaded reads it
from ampinit.compat.apex import (
    amp,
    amp_C,
    apex_C,
    fp16_utils,
    multi_tensor_apply,
    normalization,
    optimizers,
    parallel,
)
from ampinit.compat.apex._alias import install, installed_apex, is_installed, uninstall

__all__ = [
    "amp",
    "amp_C",
    "apex_C",
    "fp16_utils",
    "install",
    "installed_apex",
    "is_installed",
    "multi_tensor_apply",
    "normalization",
    "optimizers",
    "parallel",
    "uninstall",
]
