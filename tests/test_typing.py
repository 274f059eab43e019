"""The front door is typed: mypy (strict) sees ``initialize`` return the shape it was given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy comes with the [dev] extra")

CASES = Path(__file__).parent / "typing_cases"


def _mypy(*args: str) -> tuple[str, int]:
    stdout, stderr, status = mypy_api.run(["--strict", "--no-error-summary", *args])
    return stdout + stderr, status


@pytest.mark.slow
def test_initialize_and_scale_loss_types() -> None:
    output, status = _mypy(str(CASES / "initialize_shapes.py"))
    assert status == 0, output


@pytest.mark.slow
def test_a_wrong_shape_is_a_type_error(tmp_path: Path) -> None:
    case = tmp_path / "wrong.py"
    case.write_text("import torch\nimport ampinit\n\nampinit.initialize(torch.nn.Linear(1, 1), 3)\n")
    output, status = _mypy(str(case))
    assert status == 1 and 'No overload variant of "initialize" matches argument types "Linear", "int"' in output


@pytest.mark.slow
def test_opt_level_is_the_level_literal() -> None:
    case = CASES / "opt_level_literal.py"
    lines = case.read_text().splitlines()
    expected = {(number, line.split("# E: ")[1]) for number, line in enumerate(lines, start=1) if "# E: " in line}
    output, status = _mypy("--show-error-codes", str(case))
    found = {
        (int(number), code)
        for number, code in re.findall(r"opt_level_literal\.py:(\d+): error: .*\[([\w-]+)\]", output)
    }
    assert status == 1 and found == expected, output
