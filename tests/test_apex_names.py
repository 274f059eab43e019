"""docs/migration.md's table of Apex names against the aliases: every "provided" name resolves under
``apex.*``/``amp_C``, no "refused" name does, and every name the alias modules export is in the table."""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import ampinit.compat.apex as compat_apex

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
ROW = re.compile(r"^\| `([^`]+)` \| (module|class|function|constant|attribute) \| (provided|refused) \|")

# Names another branch of this project adds (apex.normalization, apex_C, ...). The table lists them as provided;
# until that branch is merged they must not resolve, and once it is this test fails until the set is emptied,
# so the table is then checked for them like every other row.
PENDING_MERGE: set[str] = set()


def table() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    section = text[text.index("\n## Apex names\n") :]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        found = ROW.match(line)
        if found:
            name, kind, status = found.groups()
            assert name not in rows, f"{name} is listed twice"
            rows[name] = (kind, status)
    return rows


@pytest.fixture
def aliases() -> Iterator[None]:
    was_installed = compat_apex.is_installed()
    compat_apex.install()
    try:
        yield
    finally:
        if not was_installed:
            compat_apex.uninstall()


def resolves(name: str) -> bool:
    """Whether ``name`` (a module, or a module's attribute) can be imported or looked up."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            # Apex's historic names (apex.optimizers.FP16_Optimizer) resolve with a FutureWarning, which
            # tests/test_apex_arguments.py pins; here only presence is asked.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
        return True
    return False


def test_table_is_there_and_covers_every_package() -> None:
    rows = table()
    assert len(rows) > 100
    for prefix in ("apex.amp.", "apex.optimizers.", "apex.fp16_utils.", "apex.parallel.", "amp_C."):
        assert any(n.startswith(prefix) and s == "provided" for n, (_, s) in rows.items()), prefix
        assert prefix == "apex.optimizers." or any(
            n.startswith(prefix) and s == "refused" for n, (_, s) in rows.items()
        )


@pytest.mark.usefixtures("aliases")
def test_provided_names_resolve_and_refused_names_do_not() -> None:
    unresolved, present, merged = [], [], []
    for name, (kind, status) in table().items():
        if kind == "attribute":  # attributes of objects (optimizer._amp_stash) are tested where they are set
            continue
        ok = resolves(name)
        if name in PENDING_MERGE:
            if ok:
                merged.append(name)
        elif status == "provided" and not ok:
            unresolved.append(name)
        elif status == "refused" and ok:
            present.append(name)
    assert not unresolved, f"listed as provided but missing under the aliases: {unresolved}"
    assert not present, f"listed as refused but present under the aliases: {present}"
    assert not merged, f"now provided: remove from PENDING_MERGE so the table checks them: {merged}"


def alias_name(module: str) -> str:
    suffix = module[len(compat_apex.__name__) :]
    if suffix in (".amp_C", ".apex_C"):
        return suffix[1:]  # Apex's C extensions are top-level modules, not submodules of apex
    return "apex" + suffix


def test_every_name_the_alias_modules_export_is_in_the_table() -> None:
    rows = table()
    missing = []
    modules = [compat_apex.__name__] + [
        info.name for info in pkgutil.walk_packages(compat_apex.__path__, compat_apex.__name__ + ".")
    ]
    for module_name in modules:
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf.startswith("_") and leaf != "_amp_state":
            continue  # ampinit's own plumbing (_alias), never aliased as an Apex name
        module = importlib.import_module(module_name)
        alias = alias_name(module_name)
        if alias != "apex" and rows.get(alias, ("", ""))[1] != "provided":
            missing.append(alias)
        exported = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
        for name in exported:
            qualified = f"{alias}.{name}"
            if rows.get(qualified, ("", ""))[1] != "provided" and qualified not in {"apex.amp_C"}:
                missing.append(qualified)
    assert not missing, f"exported by the aliases but not listed as provided in docs/migration.md: {missing}"


def test_the_table_parser_reads_rows() -> None:
    assert ROW.match("| `amp_C.multi_tensor_scale` | function | provided | x |")
    assert not ROW.match("| `amp_C.multi_tensor_scale` | function | maybe | x |")


@pytest.mark.usefixtures("session_cleanup")
def test_attribute_rows_are_present_on_the_objects_apex_put_them_on() -> None:
    """Apex-private attributes public code touches: each "provided" row names one that exists (their behaviour is
    tested against Apex's in test_apex_private_attributes.py and test_compat_scalers.py)."""
    import torch

    from ampinit.compat.apex import amp
    from ampinit.compat.apex.amp.scaler import LossScaler
    from ampinit.optimizers import FusedAdam

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    owners = {
        "optimizer": optimizer,
        "LossScaler": LossScaler("dynamic"),
        "FusedAdam": FusedAdam([torch.nn.Parameter(torch.zeros(2))]),
    }
    rows = {name: status for name, (kind, status) in table().items() if kind == "attribute"}
    assert len(rows) >= 8
    for name, status in rows.items():
        owner, attribute = name.split(".")
        assert status == "provided", name
        assert hasattr(owners[owner], attribute), name
