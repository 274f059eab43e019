"""``ampinit migrate``: rewrite Apex code with libcst, to ampinit (``--to ampinit``) or native torch.amp
(``--to torch``), keeping formatting and comments; plus helpers that convert Apex checkpoints for torch.amp.

See docs/migration.md for every rule and its reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Literal

from ampinit.migrate._report import FileResult, Report, Site
from ampinit.migrate.checkpoint import convert_apex_checkpoint, grad_scaler_state

__all__ = [
    "FileResult",
    "Report",
    "Site",
    "convert_apex_checkpoint",
    "grad_scaler_state",
    "migrate_paths",
    "migrate_source",
]

Destination = Literal["ampinit", "torch"]


def migrate_source(source: str, to: Destination = "ampinit", path: str = "<string>") -> FileResult:
    """Migrate one file's source. ``--to torch`` rewrites the amp part natively (or refuses, leaving the file
    unchanged) and then applies the ``--to ampinit`` rules to the rest of Apex (parallel, fp16_utils...)."""
    from ampinit.migrate._to_ampinit import migrate_module
    from ampinit.migrate._to_torch import migrate_module_to_torch

    if to not in ("ampinit", "torch"):
        raise ValueError(f"to must be 'ampinit' or 'torch', got {to!r}")
    if to == "torch":
        native, sites, refused = migrate_module_to_torch(source)
        if refused:
            return FileResult(path, source, source, sites, refused=True)
        migrated, more = migrate_module(native)
        return FileResult(path, source, migrated, sites + more)
    migrated, sites = migrate_module(source)
    return FileResult(path, source, migrated, sites)


def python_files(paths: Iterable[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))
        elif os.path.exists(path):
            yield path
        else:
            raise FileNotFoundError(f"No such file or directory: {path!r}")


def migrate_paths(paths: Iterable[str], to: Destination = "ampinit", write: bool = False) -> Report:
    """Migrate every ``.py`` file under ``paths``; write the changes back only with ``write=True``."""
    report = Report(to)
    for path in python_files(paths):
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        result = migrate_source(source, to, path)
        report.files.append(result)
        if write and result.changed:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(result.migrated)
    return report
