"""``ampinit demo``: small tasks trained once per opt level, with a table, JSON, Markdown and a PNG.

Run it as ``ampinit demo`` or ``python -m ampinit.demo`` (``--quick`` for a 30-second version); from Python::

    from ampinit.demo import DemoConfig, run_demo
    report = run_demo(DemoConfig(levels=("O0", "O5"), out=Path("out")))

The task builders (also used by the benchmarks) are in :mod:`ampinit.demo.tasks`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampinit.demo.config import DemoConfig, quick_config
    from ampinit.demo.results import DemoReport, RunResult, TaskReport
    from ampinit.demo.run import run_demo

__all__ = ["DemoConfig", "DemoReport", "RunResult", "TaskReport", "quick_config", "run_demo"]

# The module each public name lives in.
_HOMES = {
    "DemoConfig": "config",
    "quick_config": "config",
    "DemoReport": "results",
    "RunResult": "results",
    "TaskReport": "results",
    "run_demo": "run",
}


def __getattr__(name: str) -> object:
    # `ampinit --help` loads this package for the demo's parser: the demo itself (and torch) loads on first use.
    if name in __all__:
        found = getattr(importlib.import_module(f"ampinit.demo.{_HOMES[name]}"), name)
        globals()[name] = found
        return found
    raise AttributeError(f"module 'ampinit.demo' has no attribute {name!r}")
