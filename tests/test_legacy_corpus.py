"""``ampinit migrate`` over real Apex-era training code (tests/legacy_corpus, see its README for the projects,
commits and licences): both migrations produce files that compile and import only names that exist, and each
file's outcome is the one recorded in expectations.json after a human read the file and the migrated output:

* ``ampinit``: ``clean`` (no human needed) or ``needs_human`` (a name ampinit does not provide, or an
  availability guard), with the reasons;
* ``torch``: ``migrated`` (amp rewritten to torch.amp; the diff was checked by hand to be equivalent on every
  path), ``refused`` (left unchanged, with the reasons), or ``changed``/``unchanged`` for files that do not use
  amp; no ``--to torch`` output imports Apex or ampinit;
* ``torch_native`` (files that use amp): whether their amp use has a native torch.amp equivalent ("yes"), or why
  not; the share of those that migrate is the issue's measure.

A change in any outcome fails here and must be reviewed (and expectations.json updated) on purpose.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from ampinit.migrate import migrate_source
from ampinit.migrate._resolve import imported_modules, unresolved_imports

CORPUS = Path(__file__).resolve().parent / "legacy_corpus"
EXPECTED: dict[str, dict[str, Any]] = json.loads((CORPUS / "expectations.json").read_text(encoding="utf-8"))


def test_the_corpus_is_what_the_readme_names() -> None:
    files = sorted(p.name for p in CORPUS.glob("*.py.txt"))
    assert files == sorted(EXPECTED) and len(files) >= 30
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    assert all(name in readme for name in files)
    assert len({name.split("__")[0] for name in files}) >= 12


#: The corpus in two halves, the second in test_legacy_corpus_second_half.py: under ``--dist loadfile`` a file runs
#: in one worker, and the whole corpus was the GPU check's longest file (167 s of a 220 s suite on the seventeenth
#: session's slower H100 host).
NAMES = sorted(EXPECTED)
FIRST_HALF, SECOND_HALF = NAMES[: len(NAMES) // 2], NAMES[len(NAMES) // 2 :]


@pytest.mark.slow
@pytest.mark.parametrize("name", FIRST_HALF)
def test_corpus_file_migrates_as_expected(name: str) -> None:
    assert_migrates_as_expected(name)


def assert_migrates_as_expected(name: str) -> None:
    """Both migrations of corpus file ``name`` compile, import only names that exist and have the reviewed outcome."""
    source = (CORPUS / name).read_text(encoding="utf-8")
    expected = EXPECTED[name]
    to_ampinit = migrate_source(source, "ampinit", name)
    to_torch = migrate_source(source, "torch", name)
    for result in (to_ampinit, to_torch):
        with warnings.catch_warnings():  # old code has invalid escape sequences ('\d' in a plain string)
            warnings.simplefilter("ignore")  # SyntaxWarning (3.12+) or DeprecationWarning (3.11)
            compile(result.migrated, name, "exec")
        assert unresolved_imports(result.migrated, source) == []
    assert ("needs_human" if to_ampinit.needs_human else "clean") == expected["ampinit"]
    assert sorted({s.message.split(":")[0] for s in to_ampinit.needs_human}) == expected["ampinit_reasons"]
    if to_torch.refused:
        outcome = "refused"
        assert not to_torch.changed
    elif "torch_native" in expected and to_torch.changed:
        outcome = "migrated"
    else:
        outcome = "changed" if to_torch.changed else "unchanged"
    assert outcome == expected["torch"]
    if not to_torch.refused:  # --to torch leaves no dependency
        roots = {module.split(".")[0] for _, module in imported_modules(to_torch.migrated)}
        assert not roots & {"apex", "amp_C", "apex_C", "ampinit"}, roots
    assert sorted({s.message[:80] for s in to_torch.needs_human})[:4] == expected["torch_reasons"]


def test_corpus_shares() -> None:
    """The shares the README reports, from the reviewed expectations: --to ampinit needs no human for at least 95%
    of the files whose every Apex name ampinit provides, and --to torch migrates at least half of the files whose
    amp use has a native equivalent."""
    unprovided = [
        name
        for name, e in EXPECTED.items()
        if any(
            r.startswith(("apex.contrib", "apex.pyprof", "apex.reparameterization", "amp_C", "apex.amp._initialize"))
            for r in e["ampinit_reasons"]
        )
    ]
    provided = [name for name in EXPECTED if name not in unprovided]
    clean = [name for name in provided if EXPECTED[name]["ampinit"] == "clean"]
    assert len(clean) / len(provided) >= 0.95, sorted(set(provided) - set(clean))
    native = [name for name, e in EXPECTED.items() if e.get("torch_native") == "yes"]
    migrated = [name for name in native if EXPECTED[name]["torch"] == "migrated"]
    assert len(migrated) / len(native) >= 0.5, sorted(set(native) - set(migrated))
    assert all(e["torch"] != "migrated" for e in EXPECTED.values() if e.get("torch_native", "yes") != "yes")
