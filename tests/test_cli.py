"""The command line: ``ampinit --version`` and ``python -m ampinit``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ampinit
from ampinit.cli import main


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ampinit {ampinit.__version__}"


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "ampinit", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"ampinit {ampinit.__version__}"
