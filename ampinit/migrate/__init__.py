"""``ampinit migrate``: rewrite Apex code with libcst, to ampinit (``--to ampinit``) or native torch.amp
(``--to torch``), keeping formatting and comments; plus helpers that convert Apex checkpoints for torch.amp.

See docs/migration.md for every rule and its reason.
"""

from __future__ import annotations

import io
import os
import tokenize
from collections.abc import Iterable, Iterator
from typing import Literal

import libcst

from ampinit.migrate._guards import line_map, rewrite_guards
from ampinit.migrate._multi_tensor import rewrite_multi_tensor
from ampinit.migrate._optimizers import NOT_NATIVE, rewrite_fused_adam
from ampinit.migrate._pyprof import NOT_NATIVE as PYPROF_NOT_NATIVE
from ampinit.migrate._pyprof import rewrite_pyprof
from ampinit.migrate._report import FileResult, Report, Site
from ampinit.migrate._resolve import imported_modules, unresolved_imports
from ampinit.migrate._to_ampinit import COMMENT_PREFIX, migrate_module
from ampinit.migrate._to_torch import migrate_module_to_torch
from ampinit.migrate.checkpoint import convert_apex_checkpoint, grad_scaler_state, torch_optimizer_state

__all__ = [
    "FileResult",
    "Report",
    "Site",
    "convert_apex_checkpoint",
    "grad_scaler_state",
    "migrate_paths",
    "migrate_source",
    "torch_optimizer_state",
]

Destination = Literal["ampinit", "torch"]


def migrate_source(source: str, to: Destination = "ampinit", path: str = "<string>") -> FileResult:
    """Migrate one file's source. ``--to torch`` rewrites the amp part natively (or refuses, leaving the file
    unchanged), then the rest of Apex (parallel, fp16_utils...) where torch has it; a file that would still import
    Apex or ampinit afterwards is refused with the names that have no native equivalent."""

    if to not in ("ampinit", "torch"):
        raise ValueError(f"to must be 'ampinit' or 'torch', got {to!r}")
    if to == "torch":
        return _to_torch(source, path)
    migrated, sites = migrate_module(source)
    guarded, guard_sites = rewrite_guards(source, fallbacks=False)
    if guard_sites and not _imports_apex(migrated):
        migrated, sites = migrate_module(guarded)
        sites = sorted(guard_sites + _relined(sites, guarded, source), key=lambda s: s.line)
    return _checked(FileResult(path, source, migrated, sites))


def _imports_apex(source: str) -> bool:
    return bool({module.split(".")[0] for _, module in imported_modules(source)} & {"apex", "amp_C", "apex_C"})


def _to_torch(source: str, path: str) -> FileResult:

    guarded, guard_sites = rewrite_guards(source)
    native, sites, refused = migrate_module_to_torch(guarded)
    sites = _relined(sites, guarded, source)
    if refused:
        return _earlier_notes(FileResult(path, source, source, sites, refused=True))
    optimizers, optimizer_sites = rewrite_fused_adam(native)
    optimizer_sites = _relined(optimizer_sites, native, source)
    tensors, tensor_sites = rewrite_multi_tensor(optimizers)
    tensor_sites = _relined(tensor_sites, optimizers, source)
    profiled, pyprof_sites = rewrite_pyprof(tensors)
    pyprof_sites = _relined(pyprof_sites, tensors, source)
    migrated, more = migrate_module(profiled, "torch")
    more = _relined(more, profiled, source)
    left = _dependencies_left(migrated, more)
    if left:  # the specific reasons replace the generic ones
        # pyprof's sites are reasons only where it was left in place (a removed hook is no reason to refuse)
        blocked = pyprof_sites if profiled == tensors else []
        reasons = [s for s in optimizer_sites + tensor_sites + blocked if s.needs_human]
        if any(s in optimizer_sites for s in reasons):
            left = [s for s in left if "FusedAdam" not in s.message]
        if any(s in tensor_sites for s in reasons):
            left = [s for s in left if not s.message.startswith(("amp_C ", "apex.multi_tensor_apply"))]
        if blocked:
            left = [s for s in left if not s.message.startswith("apex.pyprof")]
        return _earlier_notes(FileResult(path, source, source, sorted(reasons + left, key=lambda s: s.line), True))
    found = guard_sites + sites + optimizer_sites + tensor_sites + pyprof_sites + more
    return _checked(FileResult(path, source, migrated, sorted(found, key=lambda s: s.line)))


def _relined(sites: list[Site], source: str, original: str) -> list[Site]:
    """Sites found in an intermediate ``source`` with their lines in the ``original`` file."""
    if source == original:
        return sites
    mapping = line_map(original, source)
    out = []
    for site in sites:
        line = site.line
        while line > 1 and line not in mapping:
            line -= 1
        out.append(Site(mapping.get(line, site.line), site.message, site.needs_human))
    return out


def _dependencies_left(migrated: str, sites: list[Site]) -> list[Site]:
    """``--to torch`` leaves no dependency: the Apex names that would keep one (through ampinit, or unrewritten),
    each with the reason; empty when the output imports neither."""
    roots = {module.split(".")[0] for _, module in imported_modules(migrated)}
    if not roots & {"apex", "amp_C", "apex_C", "ampinit"}:
        return []
    left = []
    for site in sites:
        name = site.message.split(" -> ")[0].split(": ")[0]
        if site.needs_human and "ampinit provides no" in site.message and name.split(".")[:2] == ["apex", "pyprof"]:
            left.append(Site(site.line, f"{name} {PYPROF_NOT_NATIVE}", True))
        elif site.needs_human and "ampinit provides no" in site.message:
            left.append(Site(site.line, f"{name} has no native torch equivalent (nor an ampinit one)", True))
        elif " -> ampinit" in site.message or " -> import ampinit" in site.message:
            why = NOT_NATIVE.get(name.rsplit(".", 1)[-1])
            detail = f": {why};" if why else ":"
            reason = f"{name} has no native torch equivalent{detail} use --to ampinit (or replace it by hand)"
            left.append(Site(site.line, reason, True))
    if not left:
        lines = [line for line, module in imported_modules(migrated) if module.split(".")[0] in roots]
        left.append(Site(lines[0], "the migrated file would still import Apex or ampinit: use --to ampinit", True))
    return left


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


def _refused(path: str, reason: str) -> FileResult:
    return FileResult(path, "", "", [Site(1, f"{reason}: left unchanged", True)], refused=True)


def _decode(data: bytes) -> tuple[str, str]:
    """The text of a Python source file and its encoding, as Python reads it (PEP 263 cookie, UTF-8 BOM), with its
    line endings kept (``\r\n`` stays ``\r\n`` when written back)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding


def migrate_paths(paths: Iterable[str], to: Destination = "ampinit", write: bool = False) -> Report:
    """Migrate every ``.py`` file under ``paths``; write the changes back only with ``write=True``.

    Every path is checked before any file is read (a missing one raises ``FileNotFoundError`` and nothing is
    written). A file that cannot be decoded or parsed is reported as refused and left unchanged; each file written
    back keeps its encoding and line endings.
    """
    report = Report(to)
    for path in list(python_files(paths)):
        with open(path, "rb") as handle:
            data = handle.read()
        try:
            source, encoding = _decode(data)
        except (SyntaxError, UnicodeDecodeError) as error:
            report.files.append(_refused(path, f"cannot be decoded as Python source ({error})"))
            continue
        try:
            result = migrate_source(source, to, path)
        except (SyntaxError, libcst.ParserSyntaxError) as error:
            reason = str(error).strip().splitlines()[0]
            report.files.append(_refused(path, f"cannot be parsed as Python 3 ({reason})"))
            continue
        report.files.append(result)
        if write and result.changed:
            with open(path, "wb") as handle:
                handle.write(result.migrated.encode(encoding))
    return report
