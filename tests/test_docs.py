"""The README and docs stay true: relative links resolve, the README example runs, the examples train."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampinit import amp

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


# A path to the machine the docs were written on rather than to the repository: the workspace's shared folder, or
# an absolute path (other than /tmp, where examples write their output).
OUTSIDE = re.compile(r"(?<![\w.-])(?:shared/[\w.-]+(?:/[\w.-]+)*|/(?!tmp/)[\w.-]+(?:/[\w.-]+)+)")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
        assert (page.parent / target).resolve().is_relative_to(ROOT), f"{page.name} links outside the repo: {target}"


@pytest.mark.parametrize(
    "page", DOCS + sorted((ROOT / "examples").rglob("*.md")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_path_leaves_the_repository(page: Path) -> None:
    """A reader of a clone has the repository only: no doc names a file of the workspace it was written in."""
    text = page.read_text(encoding="utf-8")
    found = [m.group(0) for m in OUTSIDE.finditer(text) if not text[: m.start()].endswith(("http:/", "https:/"))]
    assert not found, f"{page.name} names paths outside the repository: {found}"


def test_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    example = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S)
    assert example is not None
    namespace: dict[str, object] = {}
    exec(compile(example.group(1), "README example", "exec"), namespace)
    assert amp.stats().steps == 10
    amp.deinitialize()
    printed = capsys.readouterr().out
    assert re.match(r"final loss \d+\.\d{4} AmpStats\(steps=10, skipped_steps=0,", printed), printed


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_master_weights_example_trains(level: str) -> None:
    result = subprocess.run(
        [sys.executable, "examples/o2_master_weights.py", "--opt-level", level, "--steps", "60"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    accuracy = float(re.search(r"train accuracy ([0-9.]+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9, result.stdout


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines() if not line.startswith("#")]
    assert commands == [
        "cd ampinit",
        'pip install torch==2.13.0 && pip install -e ".[demo]" --config-settings editable_mode=strict '
        "&& ampinit demo --quick",
        'pip install torch==2.13.0 && pip install -e ".[test,dev]" --config-settings editable_mode=strict '
        "&& python -m pytest -q",
    ]


def test_quickstart_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    example = re.search(r"## 3\. Add amp to a training loop\n.*?```python\n(.*?)```", text, re.S)
    assert example is not None
    exec(compile(example.group(1), "quickstart example", "exec"), {})
    assert "AmpStats(steps=10, skipped_steps=0, last_step_skipped=False" in capsys.readouterr().out
