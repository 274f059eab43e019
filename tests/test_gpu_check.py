"""The pieces of scripts/gpu_check.sh, smoke-run on CPU: the train-step benchmark at a tiny size, its verdicts
against the targets of docs/gpu.md, the summary, and the script's refusal without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_train_step as bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_summary  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.slow
def test_tiny_benchmark_writes_json_and_markdown(tmp_path: Path) -> None:
    assert bench.main(["--tiny", "--device", "cpu", "--variants", "native fp32,O2,O5", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    for workload in ("mlp", "transformer"):
        rows = report["workloads"][workload]
        assert list(rows) == ["native fp32", "O2", "O5"]
        assert all(r["ms_per_step"] > 0 and r["peak_mib"] is None for r in rows.values())  # no CUDA peak on CPU
    assert set(report["master_step"]) == {"plain fused AdamW (fp32)", "O2", "O5"}
    assert report["targets"] == []  # judged on a full CUDA run only
    assert "| O2 |" in (tmp_path / "gpu_train_step.md").read_text()


def test_tiny_transformer_is_gpt2_shaped_and_trains() -> None:
    model, x, y, loss_fn = bench.make_workload("transformer", torch.device("cpu"), tiny=True, batch=2)
    assert isinstance(model, bench.GPT) and model.head.weight is model.tok.weight  # tied, as in GPT-2
    assert bench.GPTShape() == bench.GPTShape(layers=12, d_model=768, heads=12, seq=1024, vocab=50257)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(20):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


def row(ms: float, mib: float) -> dict[str, float | None]:
    return {"ms_per_step": ms, "peak_mib": mib}


def test_verdicts_follow_the_issue_targets() -> None:
    rows = {
        bench.AUTOCAST_FP16: row(100.0, 1000.0),
        bench.AUTOCAST_BF16: row(100.0, 1000.0),
        "O2": row(86.0, 990.0),  # 1.163x faster than native fp16: met; less memory: met
        "O5": row(88.0, 900.0),  # 1.136x: not met
        "O1": row(103.0, 5000.0),  # 1.03x: met (memory not judged for O1/O4)
        "O4": row(103.5, 900.0),  # over 1.03x: not met
    }
    verdicts = {v["level"]: v for v in bench.judge(rows)}
    assert [verdicts[k]["time_met"] for k in ("O2", "O5", "O1", "O4")] == [True, False, True, False]
    assert verdicts["O2"]["peak_memory_met"] is True and verdicts["O1"]["peak_memory_met"] is None
    rows["O2"] = row(86.0, 1001.0)
    assert bench.judge(rows)[0]["peak_memory_met"] is False


def write_run(out: Path, failures: int, time_met: bool) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "pytest.xml").write_text(
        f'<testsuites><testsuite tests="10" failures="{failures}" errors="0" skipped="2">'
        + "".join(
            f'<testcase classname="tests.test_x" name="test_{i}"><failure message="assert {i} == 0"/></testcase>'
            for i in range(failures)
        )
        + "</testsuite></testsuites>"
    )
    (logs / "pytest.txt").write_text("8 workers [10 items]\n")
    targets = [
        {"level": level, "baseline": baseline, "time_ratio": 0.8, "max_time_ratio": ratio, "time_met": time_met,
         "peak_memory_met": True if memory else None}
        for level, baseline, ratio, memory in bench.TARGETS
    ]  # fmt: skip
    (logs / "gpu_train_step.json").write_text(json.dumps({"targets": targets, "complete": True, "workloads": {}}))
    (logs / "machine.txt").write_text("2.11.0 13.0 NVIDIA H100 80GB HBM3\n")


@pytest.mark.parametrize(
    ("suite_rc", "failures", "time_met", "ok"), [(0, 0, True, True), (1, 1, True, False), (0, 0, False, False)]
)
def test_summary_passes_only_a_green_suite_with_every_target_met(
    tmp_path: Path, suite_rc: int, failures: int, time_met: bool, ok: bool
) -> None:
    write_run(tmp_path, failures, time_met)
    assert gpu_check_summary.main([str(tmp_path), str(suite_rc), "0"]) == (0 if ok else 1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is ok
    suite = summary["suite"]
    assert (suite["tests"], suite["passed"], suite["failures"], suite["skipped"]) == (10, 8 - failures, failures, 2)
    assert ("overall: PASS" in (tmp_path / "summary.md").read_text()) is ok
    if failures:
        assert "- FAILURE tests.test_x::test_0: assert 0 == 0" in (tmp_path / "summary.md").read_text()
    verdict = (tmp_path / "verdict.txt").read_text()
    assert verdict.startswith(f"gpu_check verdict: {'PASS' if ok else 'FAIL'} | suite: {8 - failures} passed, ")
    assert verdict.count("time met" if time_met else "time NOT met") == 4


def test_summary_lists_targets_as_not_met_when_the_benchmark_wrote_nothing(tmp_path: Path) -> None:
    write_run(tmp_path, 0, True)
    (tmp_path / "logs" / "gpu_train_step.json").unlink()
    assert gpu_check_summary.main([str(tmp_path), "0", "124"]) == 1
    verdict = (tmp_path / "verdict.txt").read_text()
    assert verdict.count("NOT met (no benchmark results)") == 4 and "FAIL" in verdict


def test_a_failing_variant_is_a_row_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One variant raising (an unsupported kernel, out of memory) costs its own row, not the run; the target
    that needs it is not met and says why."""
    real = bench.make_step

    def make_step(variant: str, *args: object) -> object:
        if variant == "O2":
            raise NotImplementedError("no kernel for BFloat16")
        return real(variant, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "make_step", make_step)
    args = ["--tiny", "--device", "cpu", "--variants", "native fp32,O2,O5", "--out", str(tmp_path)]
    assert bench.main(args) == 1
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    assert report["complete"] is True
    for rows in report["workloads"].values():
        assert (
            rows["O2"]["ms_per_step"] is None and rows["O2"]["error"] == "NotImplementedError: no kernel for BFloat16"
        )
        assert rows["native fp32"]["ms_per_step"] > 0 and rows["O5"]["ms_per_step"] > 0
    assert (
        "| O2 | failed: NotImplementedError: no kernel for BFloat16 |" in (tmp_path / "gpu_train_step.md").read_text()
    )
    rows = {bench.AUTOCAST_FP16: row(100.0, 1000.0), "O2": {"ms_per_step": None, "peak_mib": None, "error": "boom"}}
    (o2, *others) = bench.judge(rows)
    assert o2["time_met"] is False and o2["peak_memory_met"] is False and o2["error"] == "O2: boom"
    assert all(v["time_met"] is False and "not run" in v["error"] for v in others)


def test_a_cut_benchmark_keeps_the_variants_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.run_variant

    def run_variant(variant: str, *args: object) -> object:
        if variant == "O5":
            raise KeyboardInterrupt  # what `timeout -s INT` does to the run
        return real(variant, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "run_variant", run_variant)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--device", "cpu", "--variants", "native fp32,O2,O5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    assert report["complete"] is False and list(report["workloads"]["mlp"]) == ["native fp32", "O2"]
    assert all(r["ms_per_step"] > 0 for r in report["workloads"]["mlp"].values())


# -- the script itself, on CPU, with a fake interpreter -----------------------------------------------------------
# It stands in for python wherever the script runs one, except for the summary (the real interpreter): it says a
# GPU is there, and runs pytest and the benchmark as FAKE_SUITE / FAKE_BENCH say.
FAKE_PYTHON = r"""#!PYTHON_EXE
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
if args[:1] == ["-c"]:
    if "get_device_name" in args[1]:
        print("2.11.0 13.0 Fake GPU")
    sys.exit(0)  # torch.cuda.is_available(): yes
if args[:2] == ["-m", "pytest"]:
    junit = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml=")))
    Path(os.environ["FAKE_LOG"]).write_text(" ".join(args) + "\n" + os.environ.get("OMP_NUM_THREADS", "") + "\n")
    print("8 workers [40 items]", flush=True)
    mode = os.environ["FAKE_SUITE"]
    if mode == "crash":
        print("Fatal Python error: Segmentation fault", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "hang":
        def interrupted(*_):
            # pytest on SIGINT: the tests so far go into the JUnit file, the summary line is printed
            junit.write_text(
                '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
                '<testcase classname="tests.test_a" name="test_slow"><failure message="AssertionError: no"/>'
                "</testcase></testsuite></testsuites>"
            )
            print("!!! KeyboardInterrupt !!!\n1 failed, 2 passed in 2.00s", flush=True)
            sys.exit(2)
        signal.signal(signal.SIGINT, interrupted)
    if mode in ("hang", "hang-deaf"):
        if mode == "hang-deaf":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("..F", flush=True)
        time.sleep(600)
    sys.exit(0)
if args[:2] == ["-m", "benchmarks.gpu_train_step"]:
    out = Path(args[args.index("--out") + 1])
    if os.environ["FAKE_BENCH"] == "partial":
        rows = {"native autocast fp16 + GradScaler": {"ms_per_step": 100.0, "peak_mib": 10.0},
                "O2": {"ms_per_step": 80.0, "peak_mib": 9.0}}
        targets = [{"level": "O2", "baseline": "native autocast fp16 + GradScaler", "time_ratio": 0.8,
                    "max_time_ratio": 1 / 1.15, "time_met": True, "peak_memory_met": True}]
        report = {"workloads": {"transformer": rows}, "targets": targets, "complete": False}
        (out / "gpu_train_step.json").write_text(json.dumps(report))
    raise SystemExit(os.environ.get("FAKE_BENCH_RC", "1"))
os.execv(PYTHON_REPR, [PYTHON_REPR, *args])
"""


def run_check(
    tmp_path: Path, suite: str, bench_mode: str, **limits: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.replace("PYTHON_EXE", sys.executable).replace("PYTHON_REPR", repr(sys.executable)))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "WHEELS_DIR": str(tmp_path / "no_wheels"),
        "FAKE_SUITE": suite,
        "FAKE_BENCH": bench_mode,
        "FAKE_LOG": str(tmp_path / "pytest_args.txt"),
        "SUITE_TIMEOUT": "3",
        "BENCH_TIMEOUT": "30",
        "KILL_AFTER": "2",
        "WORKERS": "2",
        **limits,
    }
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    return result, out


def returned_files(out: Path) -> list[str]:
    """What a device call would bring back of ``out``: every file in it, no folder (at most 8 files)."""
    names = sorted(p.name for p in out.iterdir())
    assert all((out / n).is_file() for n in names) and len(names) <= 8, names
    return names


def test_a_suite_cut_by_its_limit_still_gives_counts_and_a_verdict(tmp_path: Path) -> None:
    result, out = run_check(tmp_path, "hang", "partial")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith(
        "gpu_check verdict: FAIL | suite: 2 passed, 1 failed, 0 errors, 0 skipped of 40 collected"
    )
    assert "(cut at the 3 s limit)" in verdict
    # the benchmark's partial results are judged; what it did not reach is not met
    assert "O2 vs native autocast fp16 + GradScaler: time met (0.800, target <= 0.870), memory met" in verdict
    assert "O5 vs native autocast bf16: NOT met (not judged" in verdict
    assert "- FAILURE tests.test_a::test_slow: AssertionError: no" in (out / "summary.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"]["state"] == "cut" and summary["suite"]["exit_status"] == 124
    assert returned_files(out) == ["gpu_check_logs.tar.gz", "summary.json", "summary.md", "verdict.txt"]
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        assert {"logs/pytest.xml", "logs/pytest.txt", "logs/machine.txt", "logs/gpu_train_step.json"} <= set(
            tar.getnames()
        )
    args, threads = (tmp_path / "pytest_args.txt").read_text().splitlines()
    for option in ("--device cuda", "-n 2 --dist loadfile", "--timeout 120", "-rfE --tb=short --durations=25"):
        assert option in args
    assert threads == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_a_suite_that_ignores_the_cut_is_killed_and_the_check_still_ends(tmp_path: Path) -> None:
    result, out = run_check(tmp_path, "hang-deaf", "none")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("gpu_check verdict: FAIL | suite: no counts (the suite cut, exit 137)")
    assert verdict.count("NOT met (no benchmark results)") == 4
    assert returned_files(out) == ["gpu_check_logs.tar.gz", "summary.json", "summary.md", "verdict.txt"]


def test_a_crashed_suite_is_reported_and_the_benchmark_still_runs(tmp_path: Path) -> None:
    result, out = run_check(tmp_path, "crash", "partial")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("gpu_check verdict: FAIL | suite: no counts (the suite crashed, exit 139)")
    assert "O2 vs native autocast fp16 + GradScaler: time met" in verdict
    assert "Segmentation fault" in (out / "summary.md").read_text()  # the log's last lines, with no JUnit file


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
