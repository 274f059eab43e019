"""One Python floor: setup.py, ruff and mypy name the same version, and it is one torch supports."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _version(pattern: str, text: str) -> tuple[int, int]:
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, pattern
    return int(match.group(1)), int(match.group(2))


def test_setup_ruff_and_mypy_agree_and_torch_runs_there() -> None:
    setup = (ROOT / "setup.py").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = _version(r'python_requires=">=(\d+)\.(\d+)"', setup)
    assert _version(r'^target-version = "py(\d)(\d+)"', pyproject) == floor
    assert _version(r'^python_version = "(\d+)\.(\d+)"', pyproject) == floor
    torch_requires = metadata.metadata("torch")["Requires-Python"]
    assert _version(r">=(\d+)\.(\d+)", torch_requires) <= floor <= sys.version_info[:2]
