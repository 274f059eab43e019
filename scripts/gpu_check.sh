#!/usr/bin/env bash
# The GPU check of docs/gpu.md, one command (under 10 minutes on one H100):
#
#   scripts/gpu_check.sh [OUT_DIR]          # default: gpu_check_results/<UTC time>
#
# 1. the test suite with `--device cuda` (CUDA-only tests included)  -> OUT_DIR/pytest.txt, pytest.xml
# 2. benchmarks/gpu_train_step.py: every opt level's train step and peak memory against native fp32, autocast
#    bf16, autocast fp16 + GradScaler and pure bf16, on the MLP and a GPT-2-small-shaped transformer, and the
#    O2/O5 master step against plain fused AdamW                   -> OUT_DIR/gpu_train_step.json, .md
# 3. OUT_DIR/summary.json and summary.md: the suite's counts, the benchmark's target verdicts, the machine.
#
# Exit status: 0 when the suite passed and every target was met, 1 otherwise, 2 when no GPU is usable.
# PYTHON picks the interpreter (default: python3); it needs torch with CUDA, pytest, hypothesis, libcst, numpy.
# SUITE_TIMEOUT / BENCH_TIMEOUT (seconds) bound the two halves; BENCH_ARGS is passed on to the benchmark
# (e.g. BENCH_ARGS="--batch 4" on a GPU with less memory than an H100's 80 GB).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
out="${1:-$repo/gpu_check_results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch.cuda.is_available() is False under $python: no GPU to check" >&2
    exit 2
fi
"$python" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' > "$out/machine.txt"
nvidia-smi >> "$out/machine.txt" 2>&1 || true
cat "$out/machine.txt"

echo "== 1/2 the suite on cuda (log: $out/pytest.txt)"
timeout "${SUITE_TIMEOUT:-330}" "$python" -m pytest -q -p no:cacheprovider --device cuda \
    --junitxml="$out/pytest.xml" > "$out/pytest.txt" 2>&1
suite_rc=$?
tail -n 15 "$out/pytest.txt"

echo "== 2/2 train-step benchmark"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "${BENCH_TIMEOUT:-240}" "$python" -m benchmarks.gpu_train_step --device cuda --out "$out" ${BENCH_ARGS:-} \
    > "$out/benchmark.txt" 2>&1
bench_rc=$?
cat "$out/benchmark.txt"

"$python" scripts/gpu_check_summary.py "$out" "$suite_rc" "$bench_rc"
