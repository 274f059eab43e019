"""Smoke runs of the precision-dial benchmarks (``benchmarks/precision_quality.py``, ``precision_memory.py``,
``stuck_report.py``): every setting gives a row (a result, or the error of an option this ampinit lacks), the
memory accounting counts what each setting is documented to keep, and the JSON names the machine."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from benchmarks import precision_memory, precision_quality, stuck_report


def test_the_quality_smoke_run_gives_every_setting_a_row(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    names = ["native fp32 AdamW", precision_quality.REFERENCE, "O5 remainder", "O5 stochastic + 8bit"]
    report = precision_quality.main(
        ["--quick", "--steps", "2", "--only", ",".join(names), "--json", str(tmp_path / "q.json")]
    )
    rows = report["rows"]
    assert list(rows) == names
    for name, row in rows.items():
        if "error" in row:
            assert name == "O5 stochastic + 8bit" and (
                "optimizer_state" in row["error"] or "stochastic" in row["error"]
            )
        else:
            assert math.isfinite(row["loss"]) and 0 < row["loss"] < math.log(256) + 1, (name, row)
    assert rows[precision_quality.REFERENCE]["ratio"] == 1.0
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["rows"].keys() == rows.keys() and saved["machine"]["cpu"] and saved["machine"]["torch"]
    assert "| O5 remainder |" in saved["markdown"]
    assert torch.get_num_threads() == threads  # the run's one thread is given back


def test_the_quality_run_refuses_an_unknown_setting(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown settings"):
        precision_quality.main(["--quick", "--only", "O6", "--json", str(tmp_path / "q.json")])


def test_the_corpus_holds_out_every_tenth_file() -> None:
    train, held_out = precision_quality.corpus(max_files=20)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
    sizes = [len(f.read_bytes()) for f in files]
    assert len(held_out) == sizes[9] + sizes[19] and len(train) == sum(sizes) - len(held_out)


# Bytes per parameter of the storages each setting keeps between steps (with grads): native autocast holds an fp32
# weight, grad and two moments; O5 a bf16 weight and grad, an fp32 master, its fp32 grad buffer (kept on CPU) and
# two fp32 moments; remainder masters a bf16 weight, grad and remainder and two fp32 moments; pure bf16 a bf16
# weight, grad and two moments. The small rest is the optimizer's step counters and the scaler's scalars.
DOCUMENTED_BYTES = {
    precision_memory.NATIVE: (16, 12),
    "O5 fp32 masters": (20, 18),
    "O5 remainder": (14, 12),
    "O5 pure bf16 (no masters or SR)": (8, 6),
}


def test_the_memory_smoke_run_counts_what_each_setting_keeps(tmp_path: Path) -> None:
    report = precision_memory.main(["--quick", "--steps", "1", "--device", "cpu", "--json", str(tmp_path / "m.json")])
    rows = report["rows"]
    assert list(rows) == [s.name for s in precision_memory.SETTINGS]
    for name, (with_grads, without) in DOCUMENTED_BYTES.items():
        assert rows[name]["bytes_per_param"] == pytest.approx(with_grads, abs=0.01), name
        assert rows[name]["bytes_per_param_without_grads"] == pytest.approx(without, abs=0.01), name
    for row in rows.values():
        assert "error" in row or row["bytes_per_param"] > 0
    assert json.loads((tmp_path / "m.json").read_text())["machine"]["device"] == "cpu"


def test_the_stuck_report_benchmark_smoke_run_measures(tmp_path: Path) -> None:
    result = stuck_report.main(["--quick", "--rounds", "1", "--json", str(tmp_path / "s.json")])
    assert result["measurements_seen"] and all(len(v) == 1 for v in result["cpu_ms_per_step"].values())
    assert result["estimate"] > 0 and set(result["ratio"]) == {"reporting", "every step"}
