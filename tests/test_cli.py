"""The command line: ``ampinit --version``, ``python -m ampinit``, and each subcommand's handling of what it is given.

A bad path, an unreadable file or an impossible value gives a clear error naming it (exit status 2 for a usage
error, as argparse's own), never a traceback, and before any work is done; ``migrate --write`` changes only what it
reports, not a file's encoding or line endings.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ampinit
from ampinit.cli import main

needs_libcst = pytest.mark.skipif(importlib.util.find_spec("libcst") is None, reason="ampinit migrate needs libcst")

APEX_SCRIPT = 'from apex import amp\nmodel, opt = amp.initialize(model, opt, opt_level="O1")\n'


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


# -- migrate: bad paths and unreadable files are reported, --write changes only what it reports ------------------------
@needs_libcst
def test_migrate_a_missing_path_is_a_usage_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ampinit migrate real.py nowhere.py --write`` raised FileNotFoundError with a traceback (exit status 1),
    after having rewritten ``real.py`` already. A path that does not exist is a usage error: name it, exit 2,
    and change nothing on disk.

    Found by: the review of the distributed layer and the command-line tools.
    """
    real = tmp_path / "real.py"
    real.write_text(APEX_SCRIPT, encoding="utf-8")
    missing = tmp_path / "nowhere.py"
    assert main(["migrate", str(real), str(missing), "--write"]) == 2
    err = capsys.readouterr().err
    assert "ampinit migrate: error:" in err and repr(str(missing)) in err
    assert real.read_text(encoding="utf-8") == APEX_SCRIPT


@needs_libcst
def test_migrate_a_file_python_cannot_parse_does_not_abort_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Legacy Apex trees often hold Python 2 files. One of them made ``ampinit migrate DIR`` die with libcst's
    ParserSyntaxError (no report at all, and with ``--write`` the files before it already rewritten). The file
    must be reported as left unchanged, with the reason, and the other files migrated.

    Found by: the review of the distributed layer and the command-line tools.
    """
    (tmp_path / "a_py2.py").write_text('from apex import amp\nprint "x"\n', encoding="utf-8")
    (tmp_path / "b.py").write_text(APEX_SCRIPT, encoding="utf-8")
    assert main(["migrate", str(tmp_path), "--write"]) == 1  # a refused file makes the exit status 1
    out = capsys.readouterr().out
    assert "a_py2.py (refused, left unchanged)" in out and "cannot be parsed" in out
    assert (tmp_path / "a_py2.py").read_text(encoding="utf-8") == 'from apex import amp\nprint "x"\n'
    assert "from ampinit import amp" in (tmp_path / "b.py").read_text(encoding="utf-8")


@needs_libcst
def test_migrate_a_file_that_is_not_utf8_is_reported_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes that are not UTF-8 (and no coding cookie) raised UnicodeDecodeError out of ``ampinit migrate``.

    Found by: the review of the distributed layer and the command-line tools.
    """
    bad = tmp_path / "bad.py"
    bad.write_bytes(b'from apex import amp\nname = "\xff\xfe"\n')
    assert main(["migrate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.py (refused, left unchanged)" in out and "cannot be decoded" in out


@needs_libcst
def test_migrate_write_keeps_a_declared_source_encoding(tmp_path: Path) -> None:
    """PEP 263: ``# -*- coding: latin-1 -*-`` makes a valid Python file that is not UTF-8; migrate must read it in
    its declared encoding and write it back in the same one (it raised UnicodeDecodeError).

    Found by: the review of the distributed layer and the command-line tools.
    """
    script = tmp_path / "latin.py"
    script.write_bytes(b'# -*- coding: latin-1 -*-\nfrom apex import amp\nname = "caf\xe9"\n')
    assert main(["migrate", str(script), "--write"]) == 0
    assert script.read_bytes() == b'# -*- coding: latin-1 -*-\nfrom ampinit import amp\nname = "caf\xe9"\n'


@needs_libcst
def test_migrate_write_keeps_crlf_line_endings(tmp_path: Path) -> None:
    """``--write`` read in text mode and wrote ``\\n``: every line of a CRLF file changed on disk although the
    report (and ``--diff``) named only the import.

    Found by: the review of the distributed layer and the command-line tools.
    """
    script = tmp_path / "crlf.py"
    script.write_bytes(APEX_SCRIPT.replace("\n", "\r\n").encode())
    assert main(["migrate", str(script), "--write"]) == 0
    expected = APEX_SCRIPT.replace("from apex import amp", "from ampinit import amp").replace("\n", "\r\n")
    assert script.read_bytes() == expected.encode()


@needs_libcst
def test_migrate_write_keeps_a_utf8_bom(tmp_path: Path) -> None:
    """A UTF-8 BOM is valid at the start of a Python file (``python`` runs it), but migrate read it as a character
    U+FEFF and its import check died with SyntaxError ("invalid non-printable character U+FEFF").

    Found by: the review of the distributed layer and the command-line tools.
    """
    script = tmp_path / "bom.py"
    script.write_bytes(b"\xef\xbb\xbf" + APEX_SCRIPT.encode())
    assert main(["migrate", str(script), "--write"]) == 0
    expected = APEX_SCRIPT.replace("from apex import amp", "from ampinit import amp")
    assert script.read_bytes() == b"\xef\xbb\xbf" + expected.encode()


# -- demo and doctor: values refused before any work -------------------------------------------------------------------
def test_demo_out_that_is_a_file_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ampinit demo --out FILE`` trained every level and only then died with FileExistsError from ``mkdir``
    (a traceback, exit 1, the results lost). An output directory that cannot be one is a usage error: say so
    before training, naming the path.

    Found by: the review of the distributed layer and the command-line tools.
    """
    from ampinit.demo import run

    def no_training(*args: object, **kwargs: object) -> object:
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(run, "_run_task", no_training)
    target = tmp_path / "results"
    target.write_text("", encoding="utf-8")
    argv = ["demo", "--quick", "--out", str(target), "--levels", "O0", "--tasks", "mlp", "--no-progress"]
    assert main([*argv, "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "ampinit demo: error:" in err and str(target) in err and "not a directory" in err


def test_doctor_refuses_an_endless_budget(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``ampinit doctor --budget inf`` passed the "> 0" check and then timed training steps forever (the benchmark
    loops until ``now + budget``), collecting samples without bound. A budget must be a finite number of seconds.

    Found by: the review of the distributed layer and the command-line tools.
    """
    from ampinit import doctor

    def endless(budget_s: float = 2.0) -> object:
        raise AssertionError(f"diagnose ran with budget {budget_s}: it would never return")

    monkeypatch.setattr(doctor, "diagnose", endless)
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--budget", "inf"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --budget" in err and "'inf'" in err and "finite" in err
