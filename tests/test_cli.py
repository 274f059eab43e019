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
    assert "Recommended opt level: " in out and "autocast dtypes" in out


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


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_answer_without_importing_torch(flag: str) -> None:
    # As `ampinit FLAG` and `python -m ampinit FLAG` run it: the package and the command line load, then argparse
    # answers and exits; torch (seconds to import) must not have been loaded by then.
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['ampinit', {flag!r}]\n"
        "try:\n"
        "    runpy.run_module('ampinit', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    *answer, loaded = result.stdout.strip().splitlines()
    assert loaded == "[]"
    assert ("usage: ampinit" in answer[0]) if flag == "--help" else (answer == [f"ampinit {ampinit.__version__}"])


def test_public_names_load_on_first_use() -> None:
    import ampinit._api
    import ampinit._session

    assert ampinit.initialize is ampinit._api.initialize and ampinit.AmpStats is ampinit._session.AmpStats
    assert all(getattr(ampinit, name) is not None for name in ampinit.__all__)
    with pytest.raises(AttributeError, match="no attribute 'initialise'"):
        ampinit.initialise  # noqa: B018
