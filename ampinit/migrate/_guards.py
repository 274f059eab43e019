"""``--to torch``: Apex imports under ``try: ... except ImportError:``.

After a migration to native torch nothing imports Apex, so such a guard takes one path for good. Two shapes are
rewritten, each equivalent to a path the original code already had:

* every handler only raises (``raise ImportError("Please install apex")``): the guard could only turn a missing
  Apex into a crash; the body is kept (its Apex names are rewritten by the other passes) and the handlers go;
* a handler is the code's own fallback (``has_fused_layernorm = False``) and the body imports Apex names other
  than ``amp`` first: the handler is kept and the body goes, so the file does what it did where Apex was not
  installed (the path its authors wrote for that case).

``amp`` under a guard with a fallback is left to :mod:`ampinit.migrate._to_torch`, which refuses it: taking the
fallback would turn mixed precision off, taking the body would turn it on where it was off.

``--to ampinit`` drops the first shape only, and only where the migrated file imports no Apex name any more: its
message ("Please install apex ...") would send users after a package the file no longer needs. A guard with a
fallback keeps working there (ampinit provides what it imports, so the body runs, as where Apex was installed).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ampinit.migrate._report import Site
from ampinit.migrate._to_ampinit import dotted, is_apex

#: Exceptions whose handler runs when an import fails.
CATCHES_IMPORT_ERROR = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def apex_imports(statement: cst.CSTNode) -> list[str]:
    """The Apex modules or names a simple statement imports (``apex.amp``, ``apex.normalization.FusedLayerNorm``)."""
    if not isinstance(statement, cst.SimpleStatementLine):
        return []
    found: list[str] = []
    for small in statement.body:
        if isinstance(small, cst.Import):
            found.extend(n for n in (dotted(a.name) or "" for a in small.names) if is_apex(n))
        elif isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None:
            base = dotted(small.module) or ""
            if not is_apex(base):
                continue
            if isinstance(small.names, cst.ImportStar):
                found.append(f"{base}.*")
            else:
                found.extend(f"{base}.{dotted(a.name)}" for a in small.names)
    return found


def imports_amp(names: Sequence[str]) -> bool:
    return any(n == "apex.amp" or n.startswith("apex.amp.") for n in names)


def catches_import_error(handler: cst.ExceptHandler) -> bool:
    kind = handler.type
    if kind is None:
        return True
    names = [e.value for e in kind.elements] if isinstance(kind, cst.Tuple) else [kind]
    return any(dotted(n) in CATCHES_IMPORT_ERROR for n in names)


def only_raises(handler: cst.ExceptHandler) -> bool:
    """The handler ends in ``raise`` and does nothing else but call (print, warn, log) before it."""
    body = list(handler.body.body) if isinstance(handler.body, cst.IndentedBlock) else []
    smalls = [s for statement in body if isinstance(statement, cst.SimpleStatementLine) for s in statement.body]
    if len(smalls) != len(body) or not smalls or not isinstance(smalls[-1], cst.Raise):
        return False
    return all(isinstance(s, cst.Expr) and isinstance(s.value, cst.Call) for s in smalls[:-1])


def guard_shape(node: cst.Try, file_uses_amp: bool) -> str | None:
    """``"raises"``, ``"fallback"`` or None (not an Apex import guard this pass rewrites). A guarded
    ``import apex`` in a file that reaches ``apex.amp`` is no fallback: taking it would turn amp off."""
    if node.orelse is not None or node.finalbody is not None or not node.handlers:
        return None
    body = list(node.body.body) if isinstance(node.body, cst.IndentedBlock) else []
    names = [n for statement in body for n in apex_imports(statement)]
    if not names or not all(catches_import_error(h) for h in node.handlers):
        return None
    if all(only_raises(h) for h in node.handlers):
        return "raises"
    if file_uses_amp and "apex" in names:
        return None
    if len(node.handlers) == 1 and apex_imports(body[0]) and not imports_amp(names):
        return "fallback"
    return None


class _Guards(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, file_uses_amp: bool, fallbacks: bool) -> None:
        super().__init__()
        self.file_uses_amp = file_uses_amp
        self.fallbacks = fallbacks
        self.sites: list[Site] = []

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> Any:
        shape = guard_shape(original_node, self.file_uses_amp)
        if shape is None or (shape == "fallback" and not self.fallbacks):
            return updated_node
        line = int(self.get_metadata(PositionProvider, original_node).start.line)
        body = updated_node.body if shape == "raises" else updated_node.handlers[0].body
        statements = list(body.body) if isinstance(body, cst.IndentedBlock) else []
        names = sorted({n for s in original_node.body.body for n in apex_imports(s)})
        if shape == "raises":
            self.sites.append(
                Site(
                    line,
                    f"try/except around {', '.join(names)} only raised: the guard is dropped (the imports "
                    "cannot fail after the migration)",
                )
            )
        else:
            self.sites.append(
                Site(
                    line,
                    f"{', '.join(names)} under try/except ImportError: the code's own fallback is kept (the "
                    "file does what it did where Apex was not installed)",
                )
            )
        if not statements:
            return cst.SimpleStatementLine([cst.Pass()], leading_lines=updated_node.leading_lines)
        first: Any = statements[0]
        statements[0] = first.with_changes(leading_lines=[*updated_node.leading_lines, *first.leading_lines])
        return cst.FlattenSentinel(statements)


def rewrite_guards(source: str, fallbacks: bool = True) -> tuple[str, list[Site]]:
    """Apply the two rewrites above (the second only with ``fallbacks``); returns the new source and one site per
    guard (lines of ``source``)."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    transformer = _Guards(file_uses_amp="apex.amp" in source, fallbacks=fallbacks)
    new = wrapper.visit(transformer)
    return new.code, transformer.sites


def line_map(before: str, after: str) -> dict[int, int]:
    """For each line of ``after`` that comes from ``before`` (indentation aside), its line number there."""
    old = [line.strip() for line in before.splitlines()]
    new = [line.strip() for line in after.splitlines()]
    mapping: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            mapping[block.b + offset + 1] = block.a + offset + 1
    return mapping
