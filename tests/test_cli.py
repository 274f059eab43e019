"""The command line: ``ampinit --version`` and ``python -m ampinit``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

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
    assert main(["doctor", "--budget", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "Recommended opt level: O" in out and "autocast dtypes" in out


def test_demo_subcommand_quick(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out_dir = Path(str(tmp_path))
    argv = ["--quick", "--levels", "O0,O5", "--steps", "5", "--time-budget", "none", "--no-progress", "--no-plot"]
    code = main(["demo", *argv, "--out", str(out_dir)])
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


def test_bare_ampinit_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: ampinit" in capsys.readouterr().err


def test_migrate_without_libcst_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libcst" else real_find_spec(name, *a)
    )
    assert main(["migrate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "libcst, which is not installed" in err and "pip install 'ampinit[migrate]'" in err


def test_import_ampinit_leaves_sympy_and_dtensor_alone() -> None:
    code = (
        "import sys, torch; before = set(sys.modules); import ampinit, ampinit.amp; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'sympy' "
        "or m.startswith('torch.distributed.tensor') or m.startswith('ampinit.demo') or m == 'libcst'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
