#!/usr/bin/env bash
# The GPU check of docs/gpu.md: the whole verdict in one command of at most 8 minutes on one H100.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default: gpu_check_results/<UTC time>
#
# 1. the test suite with `--device cuda`, in parallel (pytest-xdist, one test file per worker at a time), each
#    test under a timeout (pytest-timeout), the whole run under SUITE_TIMEOUT: a cut run still ends with counts;
# 2. benchmarks/gpu_train_step.py --profile under BENCH_TIMEOUT (every variant interleaved in one process; a
#    failing variant is a row with its error; the JSON is rewritten after every variant and round, so a cut run
#    keeps what it measured);
# 3. benchmarks/cast_list_effect.py --device cuda (bf16, then fp16), each under CAST_TIMEOUT: which of Apex's extra
#    cast-list entries change results on CUDA, the figures cast_policy="auto"'s measured set is decided from (the
#    tables go into the logs archive);
# 4. OUT_DIR/summary.json and summary.md (counts, every failure with its reason, each target's verdict),
#    verdict.txt, profile.txt (the profiler's top kernels of O5, O2, O4, the 8-bit dial and native autocast, when
#    the benchmark got that far), and the logs packed into OUT_DIR/gpu_check_logs.tar.gz (pytest.txt with -rfE, --tb=short and
#    --durations=25, pytest.xml, the benchmark's JSON/Markdown/log, machine.txt): at most five files, so OUT_DIR
#    comes back whole from a device call (at most 8 files of 16 MiB). The last line printed is the verdict.
# At the default limits the worst case, start-up, summary and packing included, is about 540 s (230 + 170 + 2 x 35,
# four KILL_AFTERs of at most 15, 5, 5 and 15 s, and about 30 s for the rest); the two checks of the ninth session
# took 264 and 365 s on an H100, the fourteenth's 297 and 363 s on an H200, the fifteenth's 317 and 344 s and the
# seventeenth's 301 and 387 s on an H100 (cast-list runs cut to 1 s; the seventeenth's second suite took 220 s of its
# 230 on a slow host). The cast-list runs compare gradients too since the tenth session (35 s each, was 25).
#
# Exit status: 0 when the suite passed and every target was met, 1 otherwise, 2 when no GPU is usable.
# PYTHON picks the interpreter (default: python3); it needs torch with CUDA, pytest, pytest-xdist, pytest-timeout,
# hypothesis, numpy, libcst and expecttest. Wheels in WHEELS_DIR (default: .whl in the checkout) are installed
# first into a folder of their own (docs/gpu.md says how to fetch libcst's and expecttest's).
# Limits, in seconds: SUITE_TIMEOUT (default 230), TEST_TIMEOUT per test (default 120; tests and module
# fixtures that need longer say so with a timeout mark), BENCH_TIMEOUT (default 170), KILL_AFTER (default 15:
# how long a run cut with SIGINT may take to write its results before it is killed). WORKERS sets the suite's processes (default:
# half the cores, at most 8); each gets cores/WORKERS threads. BENCH_ARGS is passed on to the benchmark (e.g.
# BENCH_ARGS="--batch 4" on a GPU with less memory than an H100's 80 GB).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
out="${1:-$repo/gpu_check_results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
logs="$out/logs"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

wheels="${WHEELS_DIR:-$repo/.whl}"
if compgen -G "$wheels/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    echo "== installing $(ls "$wheels"/*.whl | wc -l) wheel(s) from $wheels into $site"
    # A wheel that does not install costs the tests that need it, not the verdict: the check goes on.
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$site"
    else
        echo "gpu_check: the wheels in $wheels did not install; going on without them" >&2
    fi
fi

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch.cuda.is_available() is False under $python: no GPU to check" >&2
    exit 2
fi
"$python" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' \
    > "$logs/machine.txt" 2>&1
# The host's speed (scripts/host_speed.py): two checks' O2/O5 figures differ with it (docs/gpu.md, fourteenth session).
"$python" scripts/host_speed.py >> "$logs/machine.txt" 2>&1 || echo "host speed: not measured" >> "$logs/machine.txt"
nvidia-smi >> "$logs/machine.txt" 2>&1 || true
head -n 2 "$logs/machine.txt"

# nproc counts the cores this process may use, but would echo an OMP_NUM_THREADS already set.
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
default_workers=$((cores / 2 > 8 ? 8 : cores / 2))
workers="${WORKERS:-$((default_workers > 0 ? default_workers : 1))}"
threads=$((cores / workers > 0 ? cores / workers : 1))
# torch sizes its intra-op pool from these: without them every worker takes all the cores.
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
kill_after="${KILL_AFTER:-15}"

suite_limit="${SUITE_TIMEOUT:-230}"
echo "== 1/2 the suite on cuda: $workers workers x $threads threads, at most ${suite_limit} s (log: pytest.txt)"
# SIGINT, not SIGTERM: pytest stops as on Ctrl-C and still writes the JUnit file of the tests that ran.
# pytest-benchmark's notice under xdist is filtered in pyproject.toml, so its plugin may stay loaded.
start=$SECONDS
timeout -s INT -k "$kill_after" "$suite_limit" "$python" -m pytest -q -p no:cacheprovider --device cuda \
    -n "$workers" --dist loadfile --timeout "${TEST_TIMEOUT:-120}" -rfE --tb=short --durations=25 \
    --junitxml="$logs/pytest.xml" > "$logs/pytest.txt" 2>&1
suite_rc=$?
suite_s=$((SECONDS - start))
tail -n 5 "$logs/pytest.txt"

bench_limit="${BENCH_TIMEOUT:-170}"
echo "== 2/2 train-step benchmark, at most ${bench_limit} s (log: benchmark.txt)"
start=$SECONDS
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout -s INT -k "$kill_after" "$bench_limit" "$python" -m benchmarks.gpu_train_step --device cuda --profile \
    --out "$logs" ${BENCH_ARGS:-} > "$logs/benchmark.txt" 2>&1
bench_rc=$?
bench_s=$((SECONDS - start))
tail -n 5 "$logs/benchmark.txt"
# Outside the archive: it goes into benchmarks/README.md by hand.
if [ -f "$logs/gpu_train_step_profile.txt" ]; then
    cp "$logs/gpu_train_step_profile.txt" "$out/profile.txt"
fi

cast_limit="${CAST_TIMEOUT:-35}"
# Informational (cast_policy="auto"'s measured set, ampinit/_casting/lists.py, is decided from it by hand): its
# exit status does not enter the verdict. A cut run keeps what it finished (the JSON and Markdown are rewritten
# after each entry of the op level and after each phase). bf16 is O4's dtype, fp16 O1's.
for dtype in bf16 fp16; do
    echo "== cast-list effect on cuda, $dtype, at most ${cast_limit} s (log: cast_list_effect_$dtype.txt)"
    timeout -s INT -k 5 "$cast_limit" "$python" -m benchmarks.cast_list_effect --device cuda --dtype "$dtype" \
        --steps 3 --out "$logs" > "$logs/cast_list_effect_$dtype.txt" 2>&1
    tail -n 2 "$logs/cast_list_effect_$dtype.txt"
done

"$python" scripts/gpu_check_summary.py "$out" "$suite_rc" "$bench_rc" \
    --limits "suite=$suite_limit,bench=$bench_limit" --seconds "suite=$suite_s,bench=$bench_s"
summary_rc=$?
tar -czf "$out/gpu_check_logs.tar.gz" -C "$out" logs && rm -rf "$logs"
if [ -f "$out/verdict.txt" ]; then
    cat "$out/verdict.txt"
else
    echo "gpu_check verdict: FAIL (the summary could not be written: exit $summary_rc)"
    summary_rc=1
fi
exit "$summary_rc"
