"""The README and docs stay true: relative links resolve, the README example runs, the examples train, and
docs/design.md names only modules that exist, places every module, and draws layers the imports keep."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ampinit
from ampinit import amp
from tests.test_import_structure import MODULES, PACKAGE, imports_of

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


DESIGN = ROOT / "docs" / "design.md"

# Modules the map of docs/design.md may leave out, with the reason.
UNMAPPED = {
    "demo/__main__.py": "`python -m ampinit.demo`: two lines that call demo/cli.py",
}

# A path ending in .py, outside a longer path or URL; in design.md one not under a folder of the repository
# other than ampinit/ is read as a file of ampinit (``_masters/grads.py``, ``ampinit/_api.py``, ``cli.py``).
PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
# A dotted name that starts in ampinit: ``ampinit.x.y`` or a private module of the core (``_registry._live``),
# and the top-level folders of the products (``compat.apex.amp._amp_state``).
DOTTED = re.compile(r"(?<![\w./])((?:ampinit\.)?(?:_\w+|compat|migrate|optimizers|demo)(?:\.\w+)+)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FOLDER = re.compile(r"(?<!\S)((?:[\w-]+/)+)(?!\S)")


def relative(module: str) -> str:
    """``ampinit._masters.grads`` -> ``_masters/grads.py`` (a package: its ``__init__.py``)."""
    return MODULES[module].relative_to(PACKAGE).as_posix()


def ampinit_path(path: str) -> str | None:
    """``path`` as named in design.md, relative to ampinit/; None for a file of another folder of the repo."""
    if path.startswith("ampinit/"):
        return path[len("ampinit/") :]
    first = path.split("/")[0]
    if "/" in path and (ROOT / first).is_dir() and not (PACKAGE / first).is_dir():
        return None
    return path


def top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def resolve_dotted(name: str) -> tuple[str | None, str | None]:
    """``(module, None)`` when ``name`` is a module of ampinit or an attribute its module binds, else
    ``(None, why)``."""
    parts = name.removeprefix("ampinit.").split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(["ampinit", *parts[:cut]])
        if module in MODULES:
            rest = parts[cut:]
            if rest and rest[0] not in top_level_names(MODULES[module]):
                return None, f"{module} binds no {rest[0]!r}"
            return module, None
    return None, f"no module {'ampinit.' + parts[0]!r}"


def design_text() -> str:
    return DESIGN.read_text(encoding="utf-8")


def named_paths(text: str) -> set[str]:
    return {p for p in (ampinit_path(m) for m in PY_PATH.findall(text)) if p is not None}


def named_dotted(text: str) -> list[str]:
    return [name for span in CODE_SPAN.findall(text) for name in DOTTED.findall(span) if not name.endswith(".py")]


def test_the_design_names_only_modules_that_exist() -> None:
    text = design_text()
    missing = sorted(f"ampinit/{p}" for p in named_paths(text) if not (PACKAGE / p).is_file())
    unresolved = sorted({f"{name}: {why}" for name in named_dotted(text) for _, why in [resolve_dotted(name)] if why})
    folders = {ampinit_path(f) for span in CODE_SPAN.findall(text) for f in FOLDER.findall(span)}
    missing_folders = sorted(f"ampinit/{f}" for f in folders if f is not None and not (PACKAGE / f).is_dir())
    assert missing == [], f"docs/design.md names files of ampinit that do not exist: {missing}"
    assert unresolved == [], f"docs/design.md names modules of ampinit that do not exist: {unresolved}"
    assert missing_folders == [], f"docs/design.md names folders of ampinit that do not exist: {missing_folders}"


def test_the_design_places_every_module() -> None:
    text = design_text()
    named = named_paths(text) | {relative(m) for m in (resolve_dotted(n)[0] for n in named_dotted(text)) if m}
    named |= {f"{f}__init__.py" for span in CODE_SPAN.findall(text) for f in FOLDER.findall(span)}
    unplaced = sorted(relative(m) for m in MODULES if relative(m) not in named and relative(m) not in UNMAPPED)
    assert unplaced == [], f"docs/design.md never names these modules of ampinit (add them to its map): {unplaced}"
    assert all((PACKAGE / path).is_file() for path in UNMAPPED)


def layer_rows() -> list[list[str]]:
    """The layer drawing of docs/design.md: per row, top first, its boxes (``x.py`` or a folder ``x/``)."""
    section = design_text().split("## Layers", 1)[1]
    drawing = re.search(r"```\n(.*?)```", section, re.S)
    assert drawing is not None, "docs/design.md has no layer drawing under its Layers heading"
    box = re.compile(r"(?<!\S)([\w.]+\.py|[\w/]+/)(?!\S)")
    return [row for row in (box.findall(line) for line in drawing.group(1).splitlines()) if row]


def box_of(module_path: str, boxes: list[str]) -> str | None:
    """The box of the drawing a module (path relative to ampinit/) sits in: its file, or its folder's."""
    fitting = [b for b in boxes if module_path == b or (b.endswith("/") and module_path.startswith(b))]
    return max(fitting, key=len, default=None)


def imports_against_rows(rows: list[list[str]]) -> tuple[list[str], list[str]]:
    """``(modules in no box, imports from a box to one in its own row or above)``."""
    row_of = {box: i for i, row in enumerate(rows) for box in row}
    box_at = {m: box_of(relative(m), list(row_of)) for m in MODULES}
    unplaced = sorted(relative(m) for m, box in box_at.items() if box is None)
    placed = {m: box for m, box in box_at.items() if box is not None}
    upward = sorted(
        f"{relative(m)} -> {relative(t)}"
        for m, box in placed.items()
        for t in imports_of(m)
        if t in placed and placed[t] != box and row_of[box] >= row_of[placed[t]]
    )
    return unplaced, upward


def test_the_design_layers_are_the_imports() -> None:
    """Every import of ampinit goes from a box of the drawing to one in a lower row (a folder is one box)."""
    rows = layer_rows()
    unplaced, upward = imports_against_rows(rows)
    assert unplaced == [], f"modules in no box of docs/design.md's layer drawing: {unplaced}"
    assert upward == [], f"imports that do not go down docs/design.md's layer drawing: {upward}"


def test_the_layer_check_sees_an_upward_import() -> None:
    """The check itself: with the ledger drawn on top, every import of it goes up and is reported."""
    rows = layer_rows()
    raised = [["_registry.py"], *[[b for b in row if b != "_registry.py"] for row in rows]]
    assert {"_api.py -> _registry.py", "_session.py -> _registry.py"} <= set(imports_against_rows(raised)[1])


def test_the_api_page_gives_initialize_its_real_signature() -> None:
    """docs/api.md opens with ``initialize``'s signature: every parameter, in order, with its default, as the
    function has them (a changed default, ``sync_free``'s once, must not leave the page behind)."""
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(initialize\(.*?\))\n```", page, re.S)
    assert block is not None, "docs/api.md lost its signature block"
    tree = ast.parse("def " + block.group(1) + ": ...").body[0]
    assert isinstance(tree, ast.FunctionDef)
    documented = tree.args
    names = [a.arg for a in documented.args] + ["*"] + [a.arg for a in documented.kwonlyargs]
    defaults = dict(zip([a.arg for a in documented.args][-len(documented.defaults) :], documented.defaults))
    defaults |= {a.arg: d for a, d in zip(documented.kwonlyargs, documented.kw_defaults) if d is not None}

    real = inspect.signature(ampinit.initialize).parameters.values()
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    real_names = [p.name for p in real if p.kind is not keyword_only] + ["*"]
    real_names += [p.name for p in real if p.kind is keyword_only]
    assert names == real_names
    # Evaluated without builtins: the defaults are literals and one power (``2.**24``).
    assert {name: eval(ast.unparse(d), {"__builtins__": {}}) for name, d in defaults.items()} == {
        p.name: p.default for p in real if p.default is not inspect.Parameter.empty
    }


def test_distributed_fsdp2_example_runs() -> None:
    """docs/distributed.md's FSDP2 block, as shown (after a one-rank gloo group, a model and its optimizer), trains a
    step: the level it names must combine with the ``MixedPrecisionPolicy`` it shows (O0 did not: its fp32 input
    cast undid FSDP's bf16 one)."""
    text = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(from torch\.distributed\.fsdp import .*?)```", text, re.S)
    assert block is not None, "docs/distributed.md lost its FSDP2 block"
    lines = block.group(1).splitlines(keepends=True)
    shard = next(i for i, line in enumerate(lines) if line.startswith("fully_shard("))
    optimizer = "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    snippet = "".join([*lines[: shard + 1], optimizer, *lines[shard + 1 :]])
    script = (
        "import os, socket, torch, torch.distributed as dist\n"
        "from ampinit import amp\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        + snippet
        + "loss = model(torch.randn(4, 8)).float().sum()\n"
        "with amp.scale_loss(loss, optimizer) as scaled:\n"
        "    scaled.backward()\n"
        "optimizer.step()\n"
        "print('steps', amp.stats().steps)\n"
        "amp.deinitialize()\n"
        "dist.destroy_process_group()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and "steps 1" in result.stdout, result.stderr[-2000:]
