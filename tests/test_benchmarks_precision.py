"""Smoke runs of the precision-dial benchmarks (``benchmarks/precision_quality.py``, ``precision_memory.py``,
``stuck_report.py``): every setting gives a row (a result, or the error of an option this ampinit lacks), the
memory accounting counts what each setting is documented to keep, and the JSON names the machine."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path
from typing import Any

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


# Student's t, one-sided 95% quantiles, from a printed table (NIST/SEMATECH e-Handbook, 1.3.6.7.2).
T_TABLE_95 = {1: 6.314, 2: 2.920, 4: 2.132, 9: 1.833, 30: 1.697}


@pytest.mark.parametrize("df", sorted(T_TABLE_95))
def test_the_t_quantile_matches_the_printed_table(df: int) -> None:
    assert precision_quality.t_quantile(0.95, df) == pytest.approx(T_TABLE_95[df], abs=6e-4)


def seed_rows(ratios: dict[str, float], targets: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """One seed's rows as ``run`` gives them: a reference loss of 2.0 and each setting's loss at its ratio."""
    return {
        name: {"loss": 2.0 * ratio, "seconds": 1.0, "target": targets[name], "ratio": ratio}
        for name, ratio in ratios.items()
    }


def test_the_seeds_aggregate_to_a_mean_ratio_a_standard_error_and_a_one_sided_verdict() -> None:
    # Three seeds whose ratios are 1.000, 1.002 and 1.004: mean 1.002, sample standard deviation 0.002, standard
    # error 0.002 / sqrt(3) = 0.0011547, t(0.95, 2) = 2.920, so the one-sided 95% bounds are 1.002 -+ 0.0033717.
    targets = {"reference": None, "loose": 1.01, "tight": 1.003, "missed": 0.998, "broken": 1.01}
    per_seed = []
    for ratio in (1.000, 1.002, 1.004):
        rows = seed_rows({"reference": 1.0, "loose": ratio, "tight": ratio, "missed": ratio, "broken": 1.0}, targets)
        per_seed.append(rows)
    per_seed[1]["broken"] = {"error": "ValueError: no such option", "target": 1.01}
    rows = precision_quality.aggregate(per_seed)

    tight = rows["tight"]
    assert tight["seeds"] == 3 and tight["ratios"] == [1.000, 1.002, 1.004]
    assert tight["ratio"] == pytest.approx(1.002, abs=1e-12)
    assert tight["stderr"] == pytest.approx(0.0011547, abs=1e-7)
    assert (tight["min"], tight["max"]) == (1.000, 1.004)
    assert tight["interval"] == pytest.approx([0.9986283, 1.0053717], abs=2e-6)
    assert tight["loss"] == pytest.approx(2.004) and tight["seconds"] == 3.0
    assert [rows[name]["verdict"] for name in ("loose", "tight", "missed")] == ["met", "not resolved", "not met"]
    assert (
        rows["reference"]["ratio"] == 1.0 and rows["reference"]["stderr"] == 0.0 and "verdict" not in rows["reference"]
    )
    assert rows["broken"] == {"error": "ValueError: no such option", "target": 1.01, "seeds": 3}
    table = precision_quality.seeds_markdown(rows)
    assert (
        "| tight | 3 | 1.0020 | 0.0012 | 1.0000 - 1.0040 | 0.9986 - 1.0054 | <= 1.003 | not resolved at 3 seeds |"
        in table
    )


def test_one_seed_is_not_a_verdict() -> None:
    rows = precision_quality.aggregate(
        [seed_rows({"reference": 1.0, "lossy": 1.0001}, {"reference": None, "lossy": 1.01})]
    )
    assert rows["lossy"]["verdict"] == "not resolved" and "stderr" not in rows["lossy"]


def test_seed_zero_of_a_multi_seed_run_is_the_single_seed_run(tmp_path: Path) -> None:
    names = [precision_quality.REFERENCE, "O5 remainder + 8bit"]
    common = ["--quick", "--steps", "2", "--only", ",".join(names)]
    single = precision_quality.main([*common, "--json", str(tmp_path / "one.json")])
    several = precision_quality.main([*common, "--seeds", "2", "--json", str(tmp_path / "two.json")])
    seed_zero, seed_one = several["per_seed"]
    assert {n: r["loss"] for n, r in seed_zero.items()} == {n: r["loss"] for n, r in single["rows"].items()}
    # seed 1 draws other weights and batches: its reference ends elsewhere
    assert seed_one[precision_quality.REFERENCE]["loss"] != seed_zero[precision_quality.REFERENCE]["loss"]
    lossy = several["rows"]["O5 remainder + 8bit"]
    ratios = [
        seed["O5 remainder + 8bit"]["loss"] / seed[precision_quality.REFERENCE]["loss"] for seed in several["per_seed"]
    ]
    assert lossy["ratios"] == pytest.approx(ratios) and lossy["ratio"] == pytest.approx(sum(ratios) / 2)
    saved = json.loads((tmp_path / "two.json").read_text())
    assert saved["seeds"] == saved["seeds_done"] == 2 and saved["rows"].keys() == several["rows"].keys()


def test_several_seeds_need_the_reference_row(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="add it to --only"):
        precision_quality.main(
            ["--quick", "--seeds", "2", "--only", "O5 remainder", "--json", str(tmp_path / "q.json")]
        )


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


def test_seeds_run_apart_combine_into_the_run_of_all_of_them(tmp_path: Path) -> None:
    """``--first-seed 1`` trains seed 1 as a run of seeds 0-1 does, and ``--combine`` of seed 0's part and that run
    reports what the run of both seeds reports; a seed twice, or another configuration, is refused by name."""
    names = [precision_quality.REFERENCE, "O5 remainder + 8bit"]
    common = ["--quick", "--steps", "2", "--only", ",".join(names)]
    both = precision_quality.main([*common, "--seeds", "2", "--json", str(tmp_path / "both.json")])
    second = precision_quality.main([*common, "--first-seed", "1", "--json", str(tmp_path / "b.json")])
    assert second["seed_numbers"] == [1]
    assert {n: r["loss"] for n, r in second["per_seed"][0].items()} == {
        n: r["loss"] for n, r in both["per_seed"][1].items()
    }
    zero = {**both, "per_seed": both["per_seed"][:1], "seed_numbers": [0], "seeds": 1, "seeds_done": 1}
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    combined = precision_quality.main(
        ["--combine", str(tmp_path / "zero.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "c.json")]
    )
    assert combined["seed_numbers"] == [0, 1]
    for name in names:
        assert combined["rows"][name]["losses"] == pytest.approx(both["rows"][name]["losses"])
    lossy = "O5 remainder + 8bit"
    assert combined["rows"][lossy]["ratio"] == pytest.approx(both["rows"][lossy]["ratio"])
    assert combined["rows"][lossy]["verdict"] == both["rows"][lossy]["verdict"]
    twice = ["--combine", str(tmp_path / "b.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "d.json")]
    with pytest.raises(SystemExit, match=r"seeds \[1\] appear in more than one file"):
        precision_quality.main(twice)
    other = {**second, "config": {**second["config"], "steps": 3}, "seed_numbers": [7]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    mixed = ["--combine", str(tmp_path / "b.json"), str(tmp_path / "other.json"), "--json", str(tmp_path / "e.json")]
    with pytest.raises(SystemExit, match="another configuration"):
        precision_quality.main(mixed)
