"""Review of the distributed layer and the command-line tools: defects found, each pinned by a test.

The distributed claims of docs/distributed.md held up under probing (an inf on one rank skips the step on every
rank at O0-O5, with two losses, in sync-free mode, under LARC, with FSDP2 at O0/O1/O4; the compat DDP's hook
arguments reduce as Apex's do), so the failures here are in ``ampinit migrate`` and ``ampinit demo``: a bad path
or an unreadable file must give a clear error naming it (exit status 2 for a usage error, as argparse's own),
never a traceback, and ``migrate --write`` must change only what it reports, not the file's encoding or line
endings.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from ampinit.cli import main

ROOT = Path(__file__).resolve().parent.parent
needs_libcst = pytest.mark.skipif(importlib.util.find_spec("libcst") is None, reason="ampinit migrate needs libcst")

APEX_SCRIPT = 'from apex import amp\nmodel, opt = amp.initialize(model, opt, opt_level="O1")\n'


@needs_libcst
def test_migrate_a_missing_path_is_a_usage_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ampinit migrate real.py nowhere.py --write`` raised FileNotFoundError with a traceback (exit status 1),
    after having rewritten ``real.py`` already. A path that does not exist is a usage error: name it, exit 2,
    and change nothing on disk."""
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
    must be reported as left unchanged, with the reason, and the other files migrated."""
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
    """Bytes that are not UTF-8 (and no coding cookie) raised UnicodeDecodeError out of ``ampinit migrate``."""
    bad = tmp_path / "bad.py"
    bad.write_bytes(b'from apex import amp\nname = "\xff\xfe"\n')
    assert main(["migrate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.py (refused, left unchanged)" in out and "cannot be decoded" in out


@needs_libcst
def test_migrate_write_keeps_a_declared_source_encoding(tmp_path: Path) -> None:
    """PEP 263: ``# -*- coding: latin-1 -*-`` makes a valid Python file that is not UTF-8; migrate must read it in
    its declared encoding and write it back in the same one (it raised UnicodeDecodeError)."""
    script = tmp_path / "latin.py"
    script.write_bytes(b'# -*- coding: latin-1 -*-\nfrom apex import amp\nname = "caf\xe9"\n')
    assert main(["migrate", str(script), "--write"]) == 0
    assert script.read_bytes() == b'# -*- coding: latin-1 -*-\nfrom ampinit import amp\nname = "caf\xe9"\n'


@needs_libcst
def test_migrate_write_keeps_crlf_line_endings(tmp_path: Path) -> None:
    """``--write`` read in text mode and wrote ``\\n``: every line of a CRLF file changed on disk although the
    report (and ``--diff``) named only the import."""
    script = tmp_path / "crlf.py"
    script.write_bytes(APEX_SCRIPT.replace("\n", "\r\n").encode())
    assert main(["migrate", str(script), "--write"]) == 0
    expected = APEX_SCRIPT.replace("from apex import amp", "from ampinit import amp").replace("\n", "\r\n")
    assert script.read_bytes() == expected.encode()


@needs_libcst
def test_migrate_write_keeps_a_utf8_bom(tmp_path: Path) -> None:
    """A UTF-8 BOM is valid at the start of a Python file (``python`` runs it), but migrate read it as a character
    U+FEFF and its import check died with SyntaxError ("invalid non-printable character U+FEFF")."""
    script = tmp_path / "bom.py"
    script.write_bytes(b"\xef\xbb\xbf" + APEX_SCRIPT.encode())
    assert main(["migrate", str(script), "--write"]) == 0
    expected = APEX_SCRIPT.replace("from apex import amp", "from ampinit import amp")
    assert script.read_bytes() == b"\xef\xbb\xbf" + expected.encode()


def test_demo_out_that_is_a_file_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ampinit demo --out FILE`` trained every level and only then died with FileExistsError from ``mkdir``
    (a traceback, exit 1, the results lost). An output directory that cannot be one is a usage error: say so
    before training, naming the path."""
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


def test_run_takes_a_directory_with_main_as_python_does(tmp_path: Path) -> None:
    """``ampinit run`` promises to run a script "as ``python SCRIPT ARGS...`` would"; ``python DIR`` runs
    ``DIR/__main__.py`` with ``sys.path[0] == DIR``, but ``ampinit run DIR`` answered "no such file: 'DIR'" (exit 2)
    for a path that exists."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import sys\nprint('argv', sys.argv, 'path0', sys.path[0])\n", encoding="utf-8")
    command = [sys.executable, "-m", "ampinit", "run", str(app), "a"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"argv [{str(app)!r}, 'a'] path0 {app}" in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([*command[:4], str(empty)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2 and f"can't find '__main__' module in {str(empty)!r}" in result.stderr


def test_doctor_refuses_an_endless_budget(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``ampinit doctor --budget inf`` passed the "> 0" check and then timed training steps forever (the benchmark
    loops until ``now + budget``), collecting samples without bound. A budget must be a finite number of seconds."""
    from ampinit import doctor

    def endless(budget_s: float = 2.0) -> object:
        raise AssertionError(f"diagnose ran with budget {budget_s}: it would never return")

    monkeypatch.setattr(doctor, "diagnose", endless)
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--budget", "inf"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --budget" in err and "'inf'" in err and "finite" in err
