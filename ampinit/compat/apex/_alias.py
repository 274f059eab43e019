"""The opt-in import alias: ``import apex`` / ``import amp_C`` resolve to ``ampinit.compat.apex``.

``install()`` puts every module of this package into ``sys.modules`` under its Apex name (``apex``, ``apex.amp``,
``apex.amp._amp_state``, ..., ``amp_C``) and adds a finder that maps any other ``apex.X`` to
``ampinit.compat.apex.X`` (or says clearly that ampinit does not provide it). It never shadows a real apex
silently: when one is importable, a warning names it and says that the aliases are used instead.
``uninstall()`` removes the aliases and puts back whatever ``sys.modules`` held before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger("ampinit")

PACKAGE = "ampinit.compat.apex"
_TOP_LEVEL = ("apex", "amp_C", "apex_C")

# Entries of sys.modules that install() replaced (None: there was none), or None when not installed.
_saved: dict[str, ModuleType | None] | None = None


def _alias_of(name: str) -> str | None:
    """The ampinit module behind an Apex module name, or None if the name is not Apex's."""
    if name in ("amp_C", "apex_C"):
        return f"{PACKAGE}.{name}"
    if name == "apex" or name.startswith("apex."):
        return PACKAGE + name[len("apex") :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # Replacing the sys.modules entry during exec is the import system's supported way to alias a module.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        alias = _alias_of(fullname)
        if alias is None:
            return None
        try:
            found = importlib.util.find_spec(alias)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: ampinit's Apex aliases provide apex.amp, apex.optimizers, "
                "apex.fp16_utils, apex.parallel, apex.normalization, apex.multi_tensor_apply, amp_C and apex_C "
                "(see docs/migration.md)",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(alias))


_FINDER = _AliasFinder()


def installed_apex() -> str | None:
    """Where a real (non-ampinit) ``apex`` or ``amp_C`` would be imported from, or None."""
    for name in _TOP_LEVEL:
        module = sys.modules.get(name)
        if module is not None and not module.__name__.startswith(PACKAGE):
            return str(getattr(module, "__file__", None) or name)
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is not None:
            return str(spec.origin or (list(spec.submodule_search_locations or []) or [name])[0])
    return None


def is_installed() -> bool:
    return _saved is not None


def install() -> None:
    """Make ``import apex``, ``from apex import amp`` and ``import amp_C`` resolve to ampinit's aliases.

    Idempotent. If a real apex is importable (NVIDIA's, or PyPI's unrelated ``apex`` package), a warning names it;
    the aliases win, since this is only called by code that asked for them (``ampinit run`` or an explicit call).
    """
    global _saved
    if _saved is not None:
        return
    real = installed_apex()
    importlib.import_module(PACKAGE)
    saved: dict[str, ModuleType | None] = {}
    for name in list(sys.modules):
        if name in _TOP_LEVEL or name.startswith("apex."):
            saved[name] = sys.modules.pop(name)
    ours = {
        name: module for name, module in list(sys.modules.items()) if name == PACKAGE or name.startswith(PACKAGE + ".")
    }
    for name, module in ours.items():
        alias = "apex" + name[len(PACKAGE) :]
        if alias in ("apex.amp_C", "apex.apex_C"):
            alias = alias[len("apex.") :]
        saved.setdefault(alias, None)
        sys.modules[alias] = module
    sys.meta_path.insert(0, _FINDER)
    _saved = saved
    if real is not None:
        warnings.warn(
            f"A real apex is installed ({real}); `import apex` and `import amp_C` now resolve to ampinit's Apex "
            "aliases (ampinit.compat.apex) instead. Call ampinit.compat.apex.uninstall() to use the installed one.",
            UserWarning,
            stacklevel=2,
        )
    logger.info("import apex / amp_C now resolve to ampinit.compat.apex (ampinit's Apex aliases)")


def uninstall() -> None:
    """Remove the aliases and restore the ``sys.modules`` entries they replaced. Idempotent."""
    global _saved
    if _saved is None:
        return
    saved, _saved = _saved, None
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in list(sys.modules):
        if (name in _TOP_LEVEL or name.startswith("apex.")) and sys.modules[name].__name__.startswith(PACKAGE):
            del sys.modules[name]
    for name, module in saved.items():
        if module is not None:
            sys.modules[name] = module
