"""The pieces of scripts/gpu_check.sh, smoke-run on CPU: the train-step benchmark at a tiny size, its verdicts
against the targets of docs/gpu.md, the summary, and the script's refusal without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "pytest.xml").write_text(
        f'<testsuites><testsuite tests="10" failures="{failures}" errors="0" skipped="2"/></testsuites>'
    )
    target = {"level": "O2", "baseline": bench.AUTOCAST_FP16, "time_ratio": 0.8, "max_time_ratio": 1 / 1.15}
    (out / "gpu_train_step.json").write_text(
        json.dumps({"targets": [{**target, "time_met": time_met, "peak_memory_met": True}]})
    )
    (out / "machine.txt").write_text("2.11.0 13.0 NVIDIA H100 80GB HBM3\n")


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
    assert summary["suite"] == {"exit_status": suite_rc, "tests": 10, "failures": failures, "errors": 0, "skipped": 2}
    assert ("overall: PASS" in (tmp_path / "summary.md").read_text()) is ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
