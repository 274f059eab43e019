"""What a migration did: sites rewritten, sites left to a human, per file and in total."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Site:
    """One place in a file: ``line`` in the original source, what was done, and whether a human must decide."""

    line: int
    message: str
    needs_human: bool = False

    def render(self) -> str:
        return f"  line {self.line}: {'[needs a human] ' if self.needs_human else ''}{self.message}"


@dataclass
class FileResult:
    path: str
    original: str
    migrated: str
    sites: list[Site] = field(default_factory=list)
    refused: bool = False

    @property
    def changed(self) -> bool:
        return self.migrated != self.original

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if not s.needs_human]

    @property
    def needs_human(self) -> list[Site]:
        return [s for s in self.sites if s.needs_human]

    @property
    def diff(self) -> str:
        if not self.changed:
            return ""
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.migrated.splitlines(keepends=True),
                fromfile=f"a/{self.path}",
                tofile=f"b/{self.path}",
            )
        )


@dataclass
class Report:
    to: str
    files: list[FileResult] = field(default_factory=list)

    def summary(self, written: bool = False) -> str:
        changed = [f for f in self.files if f.changed]
        rewritten = sum(len(f.rewritten) for f in self.files)
        human = sum(len(f.needs_human) for f in self.files)
        refused = [f for f in self.files if f.refused]
        verb = "changed" if written else "would change"
        lines = [
            f"ampinit migrate --to {self.to}: {len(self.files)} file(s) scanned, {len(changed)} {verb}, "
            f"{rewritten} site(s) rewritten, {human} site(s) need a human"
            + (f", {len(refused)} file(s) refused" if refused else "")
        ]
        for result in self.files:
            if not result.sites:
                continue
            state = "refused, left unchanged" if result.refused else ("changed" if result.changed else "unchanged")
            lines.append(
                f"{result.path} ({state}): {len(result.rewritten)} rewritten, {len(result.needs_human)} need a human"
            )
            lines.extend(site.render() for site in result.sites)
        return "\n".join(lines)
