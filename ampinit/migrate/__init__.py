"""``ampinit migrate``: rewrite Apex code with libcst, to ampinit (``--to ampinit``) or native torch.amp
(``--to torch``), keeping formatting and comments; plus helpers that convert Apex checkpoints for torch.amp.

See docs/migration.md for every rule and its reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Literal

from ampinit.migrate._report import FileResult, Report, Site
from ampinit.migrate._to_ampinit import COMMENT_PREFIX
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
            return _earlier_notes(FileResult(path, source, source, sites, refused=True))
        migrated, more = migrate_module(native)
        return _checked(FileResult(path, source, migrated, sites + more))
    migrated, sites = migrate_module(source)
    return _checked(FileResult(path, source, migrated, sites))


def _earlier_notes(result: FileResult) -> FileResult:
    """``# ampinit:`` notes that an earlier migration left in the file still need a human: report them (once per
    statement: a note this run raised again is not counted twice)."""
    lines = result.original.splitlines()
    human = {site.line for site in result.sites if site.needs_human}
    extra: list[Site] = []
    for index, text in enumerate(lines):
        stripped = text.strip()
        if not stripped.startswith(COMMENT_PREFIX):
            continue
        statement = index + 1
        while statement < len(lines) and lines[statement].strip().startswith("#"):
            statement += 1
        if statement + 1 in human:
            continue
        extra.append(Site(index + 1, f"left by an earlier migration: {stripped[len(COMMENT_PREFIX) :]}", True))
    if not extra:
        return result
    sites = sorted(result.sites + extra, key=lambda site: site.line)
    return FileResult(result.path, result.original, result.migrated, sites, result.refused)


def _checked(result: FileResult) -> FileResult:
    """The codemod's last check: a result that would import a name that does not exist is refused, unchanged."""
    from ampinit.migrate._resolve import unresolved_imports

    result = _earlier_notes(result)
    if not result.changed:
        return result
    broken = unresolved_imports(result.migrated, result.original)
    if not broken:
        return result
    sites = [Site(1, f"{reason} at line {line} of the migrated file: left unchanged", True) for line, reason in broken]
    return FileResult(result.path, result.original, result.original, sites, refused=True)


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
