"""The benchmark workloads, which live in :mod:`ampinit.demo.tasks` so that ``ampinit demo`` ships them.

Re-exported here so that ``from benchmarks.models import make_mlp`` keeps working for the benchmark scripts.
"""

from ampinit.demo.tasks import (
    MLP,
    CheckerboardNet,
    FourierFeatures,
    Workload,
    checkerboard,
    coordinate_grid,
    make_checkerboard,
    make_mlp,
)

__all__ = [
    "MLP",
    "CheckerboardNet",
    "FourierFeatures",
    "Workload",
    "checkerboard",
    "coordinate_grid",
    "make_checkerboard",
    "make_mlp",
]
