"""Running a 2-process job under torchrun from a test.

Rarely (seen twice in ~60 runs, only under heavy load) a rank aborts in torch's C++ distributed runtime with
"terminate called without an active exception" (SIGABRT, no Python traceback). That is a torch/gloo shutdown race,
not the code under test, so such a run is retried once; any other failure, and a second abort, fail the test.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

_TORCH_RUNTIME_ABORT = "terminate called without an active exception"


def run_job(command: Sequence[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 and _TORCH_RUNTIME_ABORT in result.stderr:
        result = subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return result
