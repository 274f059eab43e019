"""``--to torch`` and ``apex.pyprof``: the hook ``pyprof.nvtx.init()`` (which only pushed NVTX markers of each torch
call's arguments, Apex's nvtx/nvmarker.py) is removed with a note and reported as a profiling change to confirm,
while the file migrates; every other pyprof use keeps the file refused, with the use and pyprof's successor named.

The reference for the rewritten files is the same file without the pyprof lines, migrated: removing the hook must
change nothing else."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from ampinit.migrate import FileResult, migrate_source
from ampinit.migrate._resolve import imported_modules
from ampinit.migrate._to_torch import _examples

FASTSPEECH = (
    Path(__file__).parent / "legacy_corpus" / "dle__CUDA-Optimized_FastSpeech_fastspeech_trainer_trainer.py.txt"
)
NOTE = "# ampinit: apex.pyprof.nvtx.init() removed by --to torch"
PROFILED = """

def profile(batches, profiling):
    if profiling:
        from apex import pyprof

        pyprof.nvtx.init()
    with torch.autograd.profiler.emit_nvtx(enabled=profiling):
        train(batches)
"""
WITHOUT = """

def profile(batches, profiling):
    if profiling:
        pass
    with torch.autograd.profiler.emit_nvtx(enabled=profiling):
        train(batches)
"""


def _migrated(source: str) -> FileResult:
    result = migrate_source(source, "torch")
    assert not result.refused, result.sites
    compile(result.migrated, "<migrated>", "exec")
    roots = {module.split(".")[0] for _, module in imported_modules(result.migrated)}
    assert not roots & {"apex", "ampinit"}, roots
    return result


def _without_notes(source: str) -> str:
    """``source`` without the ``# ampinit:`` lines and trailing comments the rewrite writes."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith("# ampinit:")]
    return "".join(line.split("  # ampinit:")[0] + "\n" for line in lines)


def _profiling_sites(result: FileResult) -> list[tuple[int, bool]]:
    return [(s.line, s.needs_human) for s in result.sites if "pyprof" in s.message]


def test_the_hook_is_removed_and_everything_else_migrates_as_without_it() -> None:
    result = _migrated(_examples.LOOP + PROFILED)
    reference = migrate_source(_examples.LOOP + WITHOUT, "torch")
    assert _without_notes(result.migrated) == reference.migrated
    assert NOTE in result.migrated and "emit_nvtx(record_shapes=True)" in result.migrated
    assert "nvidia-dlprof-pytorch-nvtx" in result.migrated
    hook_line = (_examples.LOOP + PROFILED).splitlines().index("        pyprof.nvtx.init()") + 1
    assert _profiling_sites(result) == [(hook_line, True)]  # a profiling change for a human to confirm
    assert "profiling change" in result.sites[[s.line for s in result.sites].index(hook_line)].message
    again = migrate_source(result.migrated, "torch")
    assert not again.changed  # idempotent: the note stays, reported as left by the earlier migration


@pytest.mark.parametrize(
    ("profiled", "without"),
    [
        # one line, under `if`: the suite keeps a `pass`
        (
            "if PROFILE: from apex.pyprof import nvtx; nvtx.init()\n",
            "if PROFILE: pass\n",
        ),
        # module level with an alias: the note goes on the statement after the call
        (
            "import apex.pyprof as pp\n\npp.nvtx.init()\nSTEPS = 3\n",
            "STEPS = 3\n",
        ),
        # the last statement of the module: a `pass` carries the note
        (
            "from apex import pyprof\npyprof.nvtx.init()\n",
            "pass\n",
        ),
    ],
)
def test_each_shape_of_the_hook_is_removed(profiled: str, without: str) -> None:
    source = _examples.LOOP + "PROFILE = False\n" + profiled
    result = _migrated(source)
    reference = migrate_source(_examples.LOOP + "PROFILE = False\n" + without, "torch")
    assert _without_notes(result.migrated) == reference.migrated
    assert "apex.pyprof.nvtx.init() removed" in result.migrated
    assert [human for _, human in _profiling_sites(result)] == [True]


def test_amp_and_pyprof_imported_together() -> None:
    """One import of amp and pyprof: the amp rewrite drops amp, this one pyprof."""
    source = _examples.edit("from apex import amp\n", "from apex import amp, pyprof\n") + "pyprof.nvtx.init()\n"
    result = _migrated(source)
    assert _without_notes(result.migrated) == migrate_source(_examples.LOOP + "pass\n", "torch").migrated
    assert [human for _, human in _profiling_sites(result)] == [True]


def test_fastspeech_migrates_with_its_profiling_change_named() -> None:
    """The corpus file refused before for ``apex.pyprof`` alone: its amp part migrates, the hook goes, and the
    ``emit_nvtx`` that produced the ranges stays."""
    source = FASTSPEECH.read_text(encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the file's invalid escape sequences
        result = _migrated(source)
    assert "with torch.autograd.profiler.emit_nvtx(enabled=self.pyprof_enabled):" in result.migrated
    assert "pyprof" not in _without_notes(result.migrated).replace("pyprof_enabled", "")
    hook_line = source.splitlines().index("            pyprof.nvtx.init()") + 1
    assert _profiling_sites(result) == [(hook_line, True)]


SUCCESSOR = "nvidia-dlprof-pytorch-nvtx"


@pytest.mark.parametrize(
    ("use", "named"),
    [
        # a marker around a user function: pyprof's own wrapper, no torch counterpart
        (
            "from apex import pyprof\npyprof.nvtx.wrap(torch, 'matmul')\n",
            "apex.pyprof (pyprof.nvtx.wrap(torch, 'matmul'))",
        ),
        # Apex's pyprof had no init() (that is the standalone PyProf's): AttributeError under Apex, not removed
        ("from apex import pyprof\npyprof.init()\n", "apex.pyprof (pyprof.init())"),
        # the hook with arguments (Apex's took none)
        ("from apex import pyprof\npyprof.nvtx.init(True)\n", "apex.pyprof (pyprof.nvtx.init(True))"),
        # the name handed on
        ("from apex import pyprof\nPROFILER = pyprof\n", "apex.pyprof (pyprof)"),
        # pyprof's parser and report tools
        ("from apex.pyprof import parse\n", "apex.pyprof.parse"),
        ("import apex.pyprof\napex.pyprof.nvtx.init()\n", "apex.pyprof.nvtx.init"),
    ],
)
def test_other_pyprof_uses_are_refused_naming_the_use_and_the_successor(use: str, named: str) -> None:
    result = migrate_source(_examples.LOOP + use, "torch")
    assert result.refused and not result.changed
    messages = [s.message for s in result.needs_human]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{named} has no native torch equivalent (nor an ampinit one): ")
    assert SUCCESSOR in messages[0] and "record_shapes=True" in messages[0]
