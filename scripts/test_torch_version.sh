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
# --no-deps for ampinit itself so pip keeps the torch chosen above; the test extras are installed by name
# (setup.py's "test" extra: triton runs the master-step kernels through its interpreter, and requires no torch).
"$venv/bin/pip" install -q --no-deps -e "$repo"
"$venv/bin/pip" install -q packaging "pytest>=7" "hypothesis>=6" "libcst>=1.1" numpy triton
"$venv/bin/python" -c 'import sys, torch; print(f"torch {torch.__version__} on python {sys.version.split()[0]}")'
if [[ "${KEEP_VENV:-0}" == "1" ]]; then
    echo "venv kept at $venv"
fi
cd "$repo"
"$venv/bin/python" -m pytest "$@"
