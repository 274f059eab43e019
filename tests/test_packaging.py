"""What an install gives a user: the editable install README.md prescribes is visible to mypy, and the package
metadata names its authors and licence (the LICENSE file it ships) without inventing a home page."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: What a type checker must see through an editable install: mypy names the type of ampinit.__version__.
CASE = "import ampinit\n\nversion: int = ampinit.__version__\n"
SEEN = 'Incompatible types in assignment (expression has type "str", variable has type "int")'
UNSEEN = 'Cannot find implementation or library stub for module named "ampinit"'


def readme_editable_mode() -> str:
    """The setuptools editable mode of README.md's development install (``pip install -e ...``)."""
    commands = [line for line in README.splitlines() if re.search(r"pip install .*-e ", line)]
    assert commands, "README.md has no `pip install -e` command"
    modes = set()
    for line in commands:
        found = re.search(r"editable_mode=(\w+)", line)
        modes.add(found.group(1) if found else "lenient")  # setuptools' default
    assert len(modes) == 1, f"README.md's editable installs differ: {commands}"
    (mode,) = modes
    return mode


def editable_install(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """Install a copy of the project in ``mode`` into a fresh virtual environment, as pip would (the PEP 660
    editable wheel, unpacked); returns the environment's python and the wheel's ``.dist-info`` directory."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "ampinit", project / "ampinit", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = (
        "import sys; from setuptools import build_meta; "
        f"print(build_meta.build_editable({str(wheels)!r}, config_settings={{'editable_mode': sys.argv[1]}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", build, mode], cwd=project, capture_output=True, text=True, check=True
    )
    wheel = wheels / result.stdout.strip().splitlines()[-1]
    environment = tmp_path / "env"
    venv.create(environment, with_pip=False)
    (site,) = environment.glob("lib/python*/site-packages")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    (dist_info,) = site.glob("ampinit-*.dist-info")
    return environment / "bin" / "python", dist_info


def mypy_sees_ampinit(tmp_path: Path, python: Path) -> str:
    """mypy's output on ``CASE`` for the environment of ``python``, run from a directory that holds neither the
    checkout's ampinit nor its mypy configuration (mypy searches its working directory first)."""
    pytest.importorskip("mypy", reason="mypy comes with the [dev] extra")
    case = tmp_path / "case.py"
    case.write_text(CASE)
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--no-error-summary"]
    command += ["--python-executable", str(python), case.name]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    return result.stdout + result.stderr


def test_readme_installs_in_setuptools_strict_editable_mode() -> None:
    # The default ("lenient") editable install loads ampinit through an import hook that mypy cannot follow.
    assert readme_editable_mode() == "strict"
    assert "--config-settings editable_mode=strict" in README


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the virtual environment's layout here is POSIX's")
@pytest.mark.parametrize("mode", ["readme", "lenient"])
def test_mypy_sees_an_editable_install(tmp_path: Path, mode: str) -> None:
    python, _ = editable_install(tmp_path, readme_editable_mode() if mode == "readme" else mode)
    output = mypy_sees_ampinit(tmp_path, python)
    if mode == "readme":
        assert SEEN in output and UNSEEN not in output, output
    else:  # the contrast that makes the check mean something: pip's default mode is invisible to mypy
        assert UNSEEN in output, output


@pytest.mark.slow
def test_metadata_names_authors_licence_and_no_invented_home_page(tmp_path: Path) -> None:
    _, dist_info = editable_install(tmp_path, "strict")
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    assert "\nAuthor: the ampinit authors\n" in metadata
    assert "\nLicense: BSD-3-Clause\n" in metadata and "\nLicense-File: LICENSE\n" in metadata
    assert "\nKeywords: " in metadata and "Classifier: Typing :: Typed" in metadata
    assert "Home-page:" not in metadata and "Project-URL:" not in metadata  # there is no public home page yet
    licence = (dist_info / "licenses" / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("BSD 3-Clause License\n") and "the ampinit authors" in licence
    assert "Neither the name of the copyright holder nor the names of its" in licence  # clause 3: BSD-3, not 2
