#!/usr/bin/env bash
# Run the test suite under another torch release in a throwaway virtual environment.
#
#   scripts/test_torch_version.sh VERSION [pytest arguments...]
#
# e.g. `scripts/test_torch_version.sh 2.11.0 -x -q` (README.md, "Install", names the releases the suite ran under).
# The venv lives in a temporary folder that is removed on exit (set KEEP_VENV=1 to keep it and print its path).  PyPI's Linux torch wheels are CUDA builds (several GB with their
# nvidia-* dependencies); they run on a CPU-only machine.  Never run this in CI: it downloads a torch per call.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 TORCH_VERSION [pytest args...]" >&2
    exit 2
fi
version="$1"
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(mktemp -d "${TMPDIR:-/tmp}/ampinit-torch-${version}.XXXXXX")"
if [[ "${KEEP_VENV:-0}" != "1" ]]; then
    trap 'rm -rf "$venv"' EXIT
fi

python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==${version}"
# A current setuptools and wheel: a new venv's own (65.5 on Python 3.11) cannot build the editable wheel that
# tests/test_packaging.py builds, as CI's venv can.
"$venv/bin/pip" install -q --upgrade setuptools wheel
# The package with the same extras and install mode as README and .ci/run. torch is installed already and satisfies
# setup.py's lower bound, so pip keeps it (checked below).
"$venv/bin/pip" install -q -e "$repo[test,dev]" --config-settings editable_mode=strict
"$venv/bin/python" - "$version" <<'PY'
import sys

import torch

print(f"torch {torch.__version__} on python {sys.version.split()[0]}")
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"asked for torch {sys.argv[1]}, but the venv has {torch.__version__}")
PY
if [[ "${KEEP_VENV:-0}" == "1" ]]; then
    echo "venv kept at $venv"
fi
cd "$repo"
"$venv/bin/python" -m pytest "$@"
