"""The import structure of ampinit: no import circle spans two folders, the optimizers import nothing from the
Apex compat layer, the engine (the master-weight wing above all) imports nothing from the optimizers, and
``import ampinit`` loads no optimizer.

Imports are read from the source (``ast``) at any depth, so a lazy import inside a function counts as much as a
module-level one: it closes the same circle the first time it runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ampinit

PACKAGE = Path(ampinit.__file__).resolve().parent
ROOT = PACKAGE.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_names(source: str, package: str) -> set[str]:
    """Every dotted name an import statement in ``source`` (a module of ``package``) reaches, at any depth,
    relative imports resolved: for ``from X import Y``, ``X.Y`` where that is a module of ampinit, else ``X``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def imports_of(name: str) -> set[str]:
    path = MODULES[name]
    return imported_names(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def import_graph() -> dict[str, set[str]]:
    """Module of ampinit -> the modules of ampinit it imports (the files, not their parent packages)."""
    return {name: {n for n in imports_of(name) if n in MODULES} - {name} for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def folder(name: str) -> Path:
    return MODULES[name].parent


def test_the_scanner_finds_a_lazy_circle_across_folders() -> None:
    """The scanner itself: an import inside a function is read, relative imports resolve, and a circle of three
    modules is one component."""
    source = "def f():\n    from ..optimizers import fused_adam\n    from . import amp_C\n    import torch\n"
    assert imported_names(source, "ampinit.compat.apex") == {
        "ampinit.compat.optimizers",
        "ampinit.compat.apex.amp_C",
        "torch",
    }
    assert imported_names("from .. import _torch_kernels, amp\n", "ampinit.optimizers") == {
        "ampinit._torch_kernels",
        "ampinit.amp",
    }
    graph = {"a.x": {"b.y"}, "b.y": {"b.z"}, "b.z": {"a.x"}, "c": {"a.x"}}
    assert circles(graph) == [{"a.x", "b.y", "b.z"}]


def test_no_import_circle_spans_two_folders() -> None:
    spanning = [sorted(c) for c in circles(import_graph()) if len({folder(name) for name in c}) > 1]
    assert spanning == []


def test_the_optimizers_import_nothing_from_the_compat_layer() -> None:
    reaches = {
        (name, target)
        for name in MODULES
        if name.startswith("ampinit.optimizers")
        for target in imports_of(name)
        if target == "ampinit.compat" or target.startswith("ampinit.compat.")
    }
    assert reaches == set()


def test_the_engine_imports_nothing_from_the_optimizers() -> None:
    """``ampinit._masters`` (and every private module of the core) asks for an optimizer's master update through
    a protocol instead of importing the optimizers, which sit above it."""
    wing = [name for name in MODULES if name.startswith("ampinit._masters.")]
    assert wing  # the scan below covers the master-weight wing
    reaches = {
        (name, target)
        for name in MODULES
        if name.startswith("ampinit._")
        for target in imports_of(name)
        if target == "ampinit.optimizers" or target.startswith("ampinit.optimizers.")
    }
    assert reaches == set()


# Run in one fresh interpreter, each stage on top of the last, printing the optimizer modules loaded so far.
LOAD_STAGES = """
import sys
def loaded(stage):
    print(stage, sorted(m for m in sys.modules if m.startswith("ampinit.optimizers")))
import ampinit
loaded("import-ampinit")
from ampinit import amp
loaded("import-amp")
import torch
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = ampinit.initialize(model, optimizer, opt_level="O2", verbosity=0)
with ampinit.scale_loss(model(torch.ones(1, 2)).float().sum(), optimizer) as loss:
    loss.backward()
optimizer.step()
loaded("O2-step-with-a-torch-optimizer")
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
model, optimizer = ampinit.initialize(model, optimizer, opt_level="O5", master_weights="remainder", verbosity=0)
with ampinit.scale_loss(model(torch.ones(1, 2)).float().sum(), optimizer) as loss:
    loss.backward()
optimizer.step()
loaded("remainder-step-with-a-torch-optimizer")
from ampinit.optimizers import FusedAdam
print("FusedAdam", "ampinit.optimizers.fused_adam" in sys.modules)
"""


def test_importing_ampinit_loads_no_optimizer_until_one_is_used() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", LOAD_STAGES], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.splitlines() == [
        "import-ampinit []",
        "import-amp []",
        "O2-step-with-a-torch-optimizer []",
        "remainder-step-with-a-torch-optimizer []",
        "FusedAdam True",
    ]
