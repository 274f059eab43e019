"""The codemod's own check: every import a migration adds must resolve against the installed packages.

A rewrite to a name that does not exist is worse than no rewrite (the file looks migrated and fails at import
time), so :func:`unresolved_imports` is run on every migrated file and a file that fails it is refused, unchanged.
"""

from __future__ import annotations

import ast
import importlib
import warnings

from ampinit.migrate._rules import resolves

#: Only imports of these packages are checked: the codemod emits no others (the rest of a file is the user's).
CHECKED_ROOTS = ("ampinit", "torch")

Import = tuple[int, str, "str | None", "str | None"]  # (line, module, name or None, alias)


def _imports(source: str) -> list[Import]:
    """(line, module, name or None, alias) for every absolute import of a checked package, anywhere in the file
    (Python's own parser: a second libcst pass would double the codemod's time)."""
    found: list[Import] = []
    with warnings.catch_warnings():  # old code's invalid escape sequences are not this check's business
        warnings.simplefilter("ignore")  # SyntaxWarning (3.12+) or DeprecationWarning (3.11)
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None, alias.asname) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module is not None:
            found.extend((node.lineno, node.module, a.name, a.asname) for a in node.names if a.name != "*")
    return [item for item in found if item[1].split(".")[0] in CHECKED_ROOTS]


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``, whatever the package."""
    out: list[tuple[int, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module is not None:
            out.append((node.lineno, node.module))
    return sorted(out)


def _resolves_from(module: str, name: str) -> bool:
    if resolves(module, name):
        return True
    try:  # ``from package import submodule``
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


def unresolved_imports(migrated: str, original: str) -> list[tuple[int, str]]:
    """The imports of ``migrated`` (not already in ``original``) that do not resolve: (line, reason)."""
    before = {item[1:] for item in _imports(original)}
    out: list[tuple[int, str]] = []
    for line, module, name, alias in _imports(migrated):
        if (module, name, alias) in before:
            continue
        ok = resolves(module) if name is None else _resolves_from(module, name)
        if not ok:
            what = module if name is None else f"{module}.{name}"
            out.append((line, f"the migration would write an import that does not resolve ({what})"))
    return out
