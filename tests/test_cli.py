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


def test_doctor_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--budget", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "Recommended opt level: O" in out and "autocast dtypes" in out


def test_demo_subcommand_quick(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    out_dir = Path(str(tmp_path))
    code = main(["demo", "--quick", "--levels", "O0,O5", "--no-progress", "--no-plot", "--out", str(out_dir)])
    assert code == 0
    report = json.loads((out_dir / "results.json").read_text())
    printed = capsys.readouterr().out
    for task in report["tasks"]:
        assert [run["level"] for run in task["runs"]] == ["O0", "O5"]
        assert task["name"] in printed  # the table printed by the same run that wrote the JSON


def test_unknown_demo_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--levels", "O7"])
    assert info.value.code == 2
    assert "O7" in capsys.readouterr().err
