"""The pieces of scripts/gpu_check.sh, smoke-run on CPU: the train-step benchmark at a tiny size, its verdicts
against the targets of docs/gpu.md, the summary, and the script's refusal without a GPU."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import ampinit
from ampinit._casting import fused_gelu
from benchmarks import gpu_train_step as bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_summary  # noqa: E402
import host_speed  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


CPU = torch.device("cpu")


@pytest.mark.slow
def test_tiny_benchmark_measures_every_pass_and_calls_nothing_a_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gelu decisions are the process's: under --device cuda an earlier test of this worker may have made one
    # (the H100 check of 2026-11-27 failed here on {'cuda:0 float16': 'unfused'}). This run's own are asserted.
    monkeypatch.setattr(fused_gelu, "_choices", {})
    only = "native autocast bf16,O4,O5 AdamW fused,O2 sync_free"
    args = ["--tiny", "--device", "cpu", "--only", only, "--profile", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    assert ampinit.current_session() is None and not torch.is_autocast_enabled("cpu")  # O4's turns closed
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    rows = report["rows"]
    assert list(rows) == only.split(",")
    for name in ("native autocast bf16", "O4", "O5 AdamW fused"):
        assert len(rows[name]["rounds_ms"]) == 2 and rows[name]["ms_per_step"] > 0  # --tiny: 2 rounds
        assert rows[name]["peak_mib"] is None and rows[name]["syncs_per_step"] is None  # CUDA-only figures
    assert "ms_per_step" not in rows["O2 sync_free"]  # counted for host syncs, never timed
    assert rows["O4"]["params"] == sum(p.numel() for p in bench.GPT(bench.TINY).parameters())
    assert set(report["master_step"]) == {"plain fused AdamW (fp32)", "O2", "O5"}
    verdicts = {v["target"]: v for v in report["verdicts"]}
    assert list(verdicts) == [t.name for t in bench.TARGETS]
    assert all(v["status"] == "not measured" for v in verdicts.values())  # a CPU run judges nothing
    o5 = verdicts["O5 AdamW fused speed >= 1.08x native autocast bf16"]
    assert o5["why"] == bench.SMOKE_NOTE and o5["figure"].endswith(" ms)")  # its figures are still shown
    markdown = (tmp_path / "gpu_train_step.md").read_text()
    assert f"**{bench.SMOKE_NOTE}.**" in markdown and "| O4 | " in markdown
    profile = (tmp_path / "gpu_train_step_profile.txt").read_text()
    assert "== O5 AdamW fused" in profile and "== native autocast bf16" in profile
    assert "aten::mm" in profile  # the top of the trace: the matrix products lead on CPU too
    # The master step alone's iteration, profiled per variant on both sides: what its host does per step.
    assert set(report["profile_master_step"]) == {"plain fused AdamW (fp32)", "O2", "O5"}
    assert "== master step: O5 (host)" in profile and "aten::_fused_adamw_" in profile
    # And the Python functions by their own time (what the host's time outside any operator is made of).
    assert "== master step: O5 (Python, cProfile: own time per step)" in profile
    assert "== O5 AdamW fused (Python, cProfile: own time per step)" in profile
    o5_python = report["profile_master_step"]["O5"]["python"]
    assert len(o5_python) == 12 and all(row["own_us_per_step"] >= 0 for row in o5_python)
    assert any(row["function"].startswith("_masters/") for row in o5_python), o5_python  # amp's step is in it
    assert report["fused_gelu"] == {}  # no Apex-list run here, and the fused gelu never runs on the CPU
    # The master step's host time by phase, every variant (the plain one has no scale_loss exit to time).
    phases = report["master_step_phases_us"]
    assert set(phases) == {"plain fused AdamW (fp32)", "O2", "O5"}
    for name, row in phases.items():
        assert list(row) == list(bench.MASTER_PHASES) and all(us > 0 for us in row.values()), (name, row)
    assert "== master step: host time per phase" in profile
    # Which side sets each master-step iteration: the timed figure beside the host's and the device's.
    assert "== master step: which side sets the iteration" in profile
    bound = profile.split("== master step: which side sets the iteration")[1].split("\n\n")[0]
    assert all(f"{name}  " in bound for name in ("plain fused AdamW (fp32)", "O2", "O5")), bound
    assert report["profile_master_step"]["O5"]["device"]["busy_us_per_step"] > 0
    # The launch costs are CUDA's: every piece named, none measured on the CPU.
    pieces = ("torch add", "check_finite_", "storage key", "kernel[grid]", "amp launch", "compiled[grid]")
    assert report["launch_costs_us"] == dict.fromkeys((*pieces, "compiled[grid] ran"))
    assert "== master step: launch costs" in profile and "    compiled[grid]       n/a\n" in profile


def test_the_powers_in_launch_variants_step_with_it_on_and_leave_it_as_it_was(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Timed on CUDA only (where the setting acts), beside O2 and O5: each step of such a variant runs with the
    # powers in the launch, and the setting is the process's again after it (the other variants alternate with it).
    from ampinit._masters import kernel_step

    assert bench.master_names(torch.device("cpu")) == (bench.PLAIN_ADAMW, "O2", "O5")
    assert bench.master_names(torch.device("cuda")) == (bench.PLAIN_ADAMW, "O2", "O5", *bench.POWERS_VARIANTS)
    seen: list[bool] = []
    scalars = kernel_step._scalars

    def watched(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kernel_step.POWERS_IN_LAUNCH)
        return scalars(*args, **kwargs)

    monkeypatch.setattr(kernel_step, "_scalars", watched)
    for name, level in [("O5 powers in launch", "O5"), ("O2 powers in launch", "O2"), ("O5", "O5")]:
        variant = bench._master_variant(name, [64, 64, 32], torch.device("cpu"))
        try:
            session = ampinit.current_session()
            assert session is not None and session.properties.opt_level == level
            seen.clear()
            variant.step()
            variant.step()
            assert seen == [name in bench.POWERS_VARIANTS] * 2 and kernel_step.POWERS_IN_LAUNCH is False
        finally:
            variant.close()


def test_the_launch_probe_runs_on_the_tensors_own_device(
    kernels_on_cpu: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """The launch-cost probe runs its pieces where amp's launches run, on the grads' own device: given one that names
    an index the tensors' device does not (the benchmark's "cuda" against the grads' "cuda:0" on the GPU, which
    raised in the tables' check and cost the fifteenth session's second check its whole profile; "cpu:0" against
    "cpu" here), every piece the interpreter can run is measured and nothing is logged as failed. The interpreter
    compiles nothing, so the direct call of a compiled kernel is not measured."""
    with caplog.at_level(logging.ERROR):
        costs = bench.launch_costs(torch.device("cpu", 0), 3, repeats=1, calls=2)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    measured = [name for name, us in costs.items() if us is not None]
    assert measured == ["torch add", "check_finite_", "storage key", "kernel[grid]", "amp launch"]
    assert all(us is not None and us > 0 for us in costs.values() if us is not None)


def test_a_failing_launch_probe_is_logged_and_leaves_its_figures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A piece that raises ends the probe with what it measured, logged, never the benchmark's report."""
    from ampinit._masters import kernel_step

    class Broken:
        def check_finite_(self, grads: list[torch.Tensor], flag: torch.Tensor) -> None:
            raise RuntimeError("broken launch")

    monkeypatch.setattr(kernel_step, "kernels_for", lambda device: Broken())
    with caplog.at_level(logging.ERROR):
        costs = bench.launch_costs(CPU, 3, repeats=1, calls=2)
    assert costs["torch add"] is not None and costs["check_finite_"] is None
    assert "measuring the launch costs failed" in caplog.text and "broken launch" in caplog.text


def test_hand_written_masters_train_exactly_as_o5() -> None:
    """The baseline a user writes by hand (bf16 model, fp32 masters, fused AdamW on them, copy back) does O5's
    work: after a few steps its bf16 weights equal O5's bit for bit."""
    variants = [bench.build(name, CPU, bench.TINY, 2) for name in (bench.BY_HAND, "O5 AdamW fused")]
    try:
        for variant in variants:
            for _ in range(3):
                variant.step()
        by_hand, o5 = (list(v.model.parameters()) for v in variants)
        assert all(p.dtype == torch.bfloat16 for p in by_hand)
        start = list(bench.make_workload(CPU, bench.TINY, 2)[0].bfloat16().parameters())
        assert any(not torch.equal(p, q) for p, q in zip(by_hand, start))  # it trained
        assert all(torch.equal(p, q) for p, q in zip(by_hand, o5))
    finally:
        for variant in variants:
            variant.close()


def test_tiny_transformer_is_gpt2_shaped_and_trains() -> None:
    model, x, y = bench.make_workload(CPU, bench.TINY, batch=2)
    assert model.head.weight is model.tok.weight  # tied, as in GPT-2
    assert bench.GPTShape() == bench.GPTShape(layers=12, d_model=768, heads=12, seq=1024, vocab=50257)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(20):
        opt.zero_grad()
        loss = bench.lm_loss(model(x), y)
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


# -- interleaving, with stand-in variants whose steps write a log ----------------------------------------------------
class Log:
    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.calls: list[str] = []
        self.built: list[str] = []
        self.fail = fail or {}  # name -> the step (counted from 1) at which it raises

    def build(self, name: str, *args: object) -> bench.Variant:
        self.built.append(name)
        steps = 0

        def step() -> None:
            nonlocal steps
            steps += 1
            if steps == self.fail.get(name):
                raise torch.OutOfMemoryError(f"{name} ran out")
            self.calls.append(name)

        return bench.Variant(
            step,
            torch.nn.Linear(1, 1),
            1,
            enter=lambda: self.calls.append(f"enter {name}"),
            leave=lambda: self.calls.append(f"leave {name}"),
            close=lambda: self.calls.append(f"close {name}"),
        )


def passes(names: list[str], rounds: int) -> bench.Passes:
    return bench.Passes(CPU, bench.TINY, 2, warmup=1, steps=2, rounds=rounds, rows={n: {} for n in names})


def test_variants_are_built_once_and_timed_round_by_round_in_rotating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    monkeypatch.setattr(bench, "build", log.build)
    run = passes(["a", "b", "c"], rounds=4)
    bench.time_pass(["a", "b", "c"], run)
    assert log.built == ["a", "b", "c"]
    warmups = [item for name in "abc" for item in (f"enter {name}", name, f"leave {name}")]
    turns = [
        item
        for order in ("abc", "bca", "cab", "abc")
        for name in order
        for item in (f"enter {name}", name, name, f"leave {name}")
    ]
    assert log.calls == warmups + turns + ["close a", "close b", "close c"]
    assert run.orders == [list(order) for order in ("abc", "bca", "cab", "abc")]
    assert all(len(run.rows[name]["rounds_ms"]) == 4 for name in "abc")


def test_a_variant_failing_mid_run_keeps_its_error_and_the_others_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log(fail={"b": 4})  # b's warm-up step and first round pass, its second round raises
    monkeypatch.setattr(bench, "build", log.build)
    run = passes(["a", "b", "c"], rounds=3)
    bench.time_pass(["a", "b", "c"], run)
    b = run.rows["b"]
    assert b["error"] == "OutOfMemoryError: b ran out" and "OutOfMemoryError" in b["traceback"]
    assert len(b["rounds_ms"]) == 1  # its measured round stays, and it left the rounds
    closed = log.calls.index("close b")  # once, right after its failed turn, before the next variant's turn
    assert log.calls[closed - 2 : closed + 2] == ["enter b", "leave b", "close b", "enter c"]
    assert log.calls.count("close b") == 1
    assert all(len(run.rows[name]["rounds_ms"]) == 3 and "error" not in run.rows[name] for name in "ac")
    assert run.orders == [["a", "b", "c"], ["b", "c", "a"], ["a", "c"]]  # the rounds go on over what is left


def test_a_variant_that_fails_to_build_is_a_row_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bench.build

    def build(name: str, *args: object) -> bench.Variant:
        if name == "O5 AdamW fused":
            raise NotImplementedError("no kernel for BFloat16")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "build", build)
    only = "native autocast bf16,O5 AdamW fused"
    args = ["--tiny", "--device", "cpu", "--only", only, "--rounds", "1", "--out", str(tmp_path)]
    assert bench.main(args) == 1
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    assert report["complete"] is True
    o5, native = report["rows"]["O5 AdamW fused"], report["rows"]["native autocast bf16"]
    assert o5["error"] == o5["memory_error"] == "NotImplementedError: no kernel for BFloat16"
    assert "ms_per_step" not in o5 and native["ms_per_step"] > 0
    assert "| O5 AdamW fused | n/a |" in (tmp_path / "gpu_train_step.md").read_text()
    verdict = next(v for v in report["verdicts"] if v["target"].startswith("O5 AdamW fused speed"))
    assert verdict["status"] == "not met" and "no kernel for BFloat16" in verdict["why"]


def test_a_cut_benchmark_keeps_the_rounds_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.time_steps
    calls = 0

    def time_steps(*args: object) -> float:
        nonlocal calls
        calls += 1
        if calls == 3:  # the first variant's second round
            raise KeyboardInterrupt  # what `timeout -s INT` does to the run
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "time_steps", time_steps)
    with pytest.raises(KeyboardInterrupt):
        args = ["--tiny", "--device", "cpu", "--only", "native fp32,O2 AdamW fused", "--out", str(tmp_path)]
        bench.main(args)
    assert ampinit.current_session() is None  # the live O2 session was closed on the way out
    report = json.loads((tmp_path / "gpu_train_step.json").read_text())
    assert report["complete"] is False and report["orders"] == [["native fp32", "O2 AdamW fused"]]
    assert all(len(row["rounds_ms"]) == 1 for row in report["rows"].values())


# -- verdicts against hand-written figures ---------------------------------------------------------------------
def figures() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """A full run's figures, each target met exactly at or just inside its bound."""
    rows: dict[str, dict[str, Any]] = {
        bench.AUTOCAST_BF16: {"ms_per_step": 108.0, "peak_mib": 1000.0, "syncs_per_step": 0.0},
        bench.AUTOCAST_FP16: {"ms_per_step": 108.0, "peak_mib": 1000.0, "syncs_per_step": 1.0},
        bench.PURE_BF16: {"ms_per_step": 90.0, "peak_mib": 800.0, "syncs_per_step": 0.0},
        "O5 remainder": {"ms_per_step": 102.8, "peak_mib": 800.0 + 6 * 2**20 / 2**20, "params": 2**20,
                         "syncs_per_step": 0.0},
        "O5 remainder + bf16 state": {"peak_mib": 800.0 + 2 * 2**20 / 2**20, "params": 2**20,
                                      "syncs_per_step": 0.0},
        "O2 host decision": {"ms_per_step": 110.0, "syncs_per_step": 1.0},
        "O1": {"ms_per_step": 111.24, "syncs_per_step": 0.0},
        "O4": {"ms_per_step": 111.24, "syncs_per_step": 0.0},
        "O1 Apex lists": {"ms_per_step": 118.8},
        "O4 Apex lists": {"ms_per_step": 118.8},
        "O1 sync_free": {"syncs_per_step": 0.0},
        "O2 sync_free": {"syncs_per_step": 0.0},
        "O4 AdamW foreach": {"syncs_per_step": 0.0},
        bench.AUTOCAST_BF16_CLIP: {"ms_per_step": 108.0},
        "O5 AdamW fused + clip": {"ms_per_step": 100.0, "syncs_per_step": 0.0},
        "O5 remainder + clip": {"ms_per_step": 102.8, "peak_mib": 800.0 + 6 * 2**20 / 2**20, "params": 2**20,
                                "syncs_per_step": 0.0},
    }  # fmt: skip
    for name in (*bench.O2_VARIANTS, *bench.O5_VARIANTS):
        rows[name] = {"ms_per_step": 100.0, "peak_mib": 1000.0, "syncs_per_step": 0.0, "params": 2**20}
    for name in bench.DIAL_VARIANTS:
        rows[name] = {"ms_per_step": 105.0}  # 1.05x the 100 ms of "O5 AdamW fused"
    master = {bench.PLAIN_ADAMW: 1.0, "O2": 1.1, "O5": 1.05}
    return rows, master


def statuses(rows: dict[str, dict[str, Any]], master: dict[str, Any], measured: bool = True) -> dict[str, str]:
    return {v["target"]: v["status"] for v in bench.judge(rows, master, measured)}


def test_verdicts_meet_figures_at_the_issue_bounds() -> None:
    rows, master = figures()
    assert set(statuses(rows, master).values()) == {"met"}
    by_name = {v["target"]: v for v in bench.judge(rows, master)}
    o5 = by_name["O5 AdamW foreach speed >= 1.08x native autocast bf16"]
    assert o5["value"] == pytest.approx(1.08) and o5["figure"] == "1.080x (100.00 vs 108.00 ms)"
    remainder = by_name["O5 remainder + bf16 state peak memory <= pure bf16 + 2 B/param"]
    assert remainder["figure"] == "802 vs 802 MiB allowed (800 MiB + 2 B x 1048576 params)"


def test_a_memory_figure_shows_the_requested_bytes_beside_the_allocated_blocks_it_is_judged_on() -> None:
    # The caching allocator's blocks (judged) are over the bound, the bytes the tensors asked for are within it: the
    # verdict stays "not met" and the figure says both.
    rows, master = figures()
    rows["O5 remainder"].update(peak_mib=820.0, requested_peak_mib=805.0)
    rows[bench.PURE_BF16]["requested_peak_mib"] = 799.0
    verdict = next(
        v for v in bench.judge(rows, master) if v["target"] == "O5 remainder peak memory <= pure bf16 + 6 B/param"
    )
    assert verdict["status"] == "not met"
    assert verdict["figure"] == (
        "820 vs 806 MiB allowed (800 MiB + 6 B x 1048576 params); requested bytes 805 vs 805 MiB"
    )


@pytest.mark.parametrize(
    ("variant", "key", "value", "target"),
    [
        ("O5 FusedAdam", "ms_per_step", 100.1, "O5 FusedAdam speed >= 1.08x native autocast bf16"),
        ("O5 remainder", "ms_per_step", 103.0, "O5 remainder speed >= 1.05x native autocast bf16"),
        ("O2 AdamW foreach", "ms_per_step", 100.1, "O2 AdamW foreach speed >= 1.08x native autocast fp16 + GradScaler"),
        ("O1", "ms_per_step", 111.3, "O1 time <= 1.03x native autocast fp16 + GradScaler"),
        ("O4 Apex lists", "ms_per_step", 118.9, "O4 Apex lists time <= 1.1x native autocast bf16"),
        ("O5 AdamW fused", "peak_mib", 1000.5, "O5 AdamW fused peak memory <= native autocast bf16"),
        (
            "O5 remainder + bf16 state",
            "peak_mib",
            802.5,
            "O5 remainder + bf16 state peak memory <= pure bf16 + 2 B/param",
        ),
        ("O5 remainder", "peak_mib", 806.5, "O5 remainder peak memory <= pure bf16 + 6 B/param"),
        ("O5 AdamW foreach", "syncs_per_step", 1 / 3, "O5 AdamW foreach host syncs per step <= 0"),
        ("O2 sync_free", "syncs_per_step", 1 / 3, "O2 sync_free host syncs per step <= 0"),
        ("O4 AdamW foreach", "syncs_per_step", 1.0, "O4 AdamW foreach host syncs per step <= 0"),
        ("O2 AdamW fused", "syncs_per_step", 1 / 3, "O2 AdamW fused host syncs per step <= 0"),
        ("O2 host decision", "syncs_per_step", 4 / 3, "O2 host decision host syncs per step <= 1"),
        ("O5 stochastic + 8bit", "ms_per_step", 105.1, "O5 stochastic + 8bit time <= 1.05x O5 AdamW fused"),
        (
            "O5 AdamW fused + clip",
            "ms_per_step",
            100.1,
            "O5 AdamW fused + clip speed >= 1.08x native autocast bf16 + clip",
        ),
        ("O5 remainder + clip", "peak_mib", 806.5, "O5 remainder + clip peak memory <= pure bf16 + 6 B/param"),
        ("O5 remainder + clip", "ms_per_step", 103.0, "O5 remainder + clip speed >= 1.05x native autocast bf16 + clip"),
    ],
)
def test_a_figure_past_its_bound_is_not_met_and_only_its_target(
    variant: str, key: str, value: float, target: str
) -> None:
    rows, master = figures()
    rows[variant][key] = value
    assert {name for name, status in statuses(rows, master).items() if status != "met"} == {target}


def test_master_step_verdicts() -> None:
    rows, master = figures()
    master["O2"] = 1.11
    master["O5"] = "RuntimeError: boom"
    verdicts = {v["target"]: v for v in bench.judge(rows, master)}
    o2, o5 = (verdicts[f"{level} master step <= 1.1x plain fused AdamW (fp32)"] for level in ("O2", "O5"))
    assert (o2["status"], o2["figure"]) == ("not met", "1.110x (1.110 vs 1.000 ms)")
    assert (o5["status"], o5["why"]) == ("not met", "O5 failed: RuntimeError: boom")


def test_failed_missing_and_smoke_figures_are_not_met_or_not_measured() -> None:
    rows, master = figures()
    rows["O1"]["error"] = "RuntimeError: boom"  # failed while timed: its timing targets are not met
    rows["O4"]["memory_error"] = "OutOfMemoryError: full"  # failed in the memory pass: its syncs are not met
    del rows["O4 Apex lists"]  # filtered out with --only
    rows[bench.PURE_BF16]["peak_mib"] = None  # a device with no peak memory
    verdicts = {v["target"]: v for v in bench.judge(rows, master)}
    o1 = verdicts["O1 time <= 1.03x native autocast fp16 + GradScaler"]
    assert (o1["status"], o1["why"]) == ("not met", "O1 failed: RuntimeError: boom")
    assert verdicts["O1 host syncs per step <= 0"]["status"] == "met"  # the memory pass went well
    o4 = verdicts["O4 host syncs per step <= 0"]
    assert (o4["status"], o4["why"]) == ("not met", "O4 failed: OutOfMemoryError: full")
    assert verdicts["O4 time <= 1.03x native autocast bf16"]["status"] == "met"
    apex = verdicts["O4 Apex lists time <= 1.1x native autocast bf16"]
    assert (apex["status"], apex["why"]) == ("not measured", "O4 Apex lists: not run")
    remainder = verdicts["O5 remainder + bf16 state peak memory <= pure bf16 + 2 B/param"]
    assert (remainder["status"], remainder["why"]) == ("not measured", "pure bf16: no peak_mib on this device")
    smoke = bench.judge(*figures(), measured=False)
    assert {v["status"] for v in smoke} == {"not measured"} and all(v["why"] == bench.SMOKE_NOTE for v in smoke)


def test_idle_time_between_activities_counts_overlaps_once() -> None:
    activities = [
        bench.Activity("a", 0.0, 10.0, 10.0),
        bench.Activity("b", 18.0, 30.0, 12.0),
        bench.Activity("c", 15.0, 20.0, 5.0),  # recorded out of order, overlapping b (another stream)
        bench.Activity("a", 40.0, 41.0, 1.0),
    ]
    assert bench.idle_between(activities) == 5.0 + 10.0
    summary = bench.trace_summary(activities, steps=2, top=2)
    assert summary["activities_per_step"] == 2.0 and summary["idle_us_per_step"] == 7.5
    assert summary["busy_us_per_step"] == (41.0 - 15.0) / 2  # from the first start to the last end, less the idle
    assert summary["top"] == [
        {"name": "b", "us_per_step": 6.0, "calls_per_step": 0.5, "share": 12 / 28},
        {"name": "a", "us_per_step": 5.5, "calls_per_step": 1.0, "share": 11 / 28},
    ]


def test_the_master_steps_bound_is_the_side_that_took_longer() -> None:
    profile = {
        "plain": {"device": {"busy_us_per_step": 1400.0}},
        "O2": {"device": {"busy_us_per_step": 1450.0}},
        "O5": {"error": "RuntimeError: boom"},
    }
    phases = {
        "plain": {"zero_grad": 100.0, "step": 900.0},  # 1.0 ms of host time against 1.4 of device time
        "O2": {"zero_grad": 150.0, "exit": 900.0, "step": 950.0},  # 2.0 against 1.45
        "O5": "RuntimeError: boom",
    }
    lines = bench.bound_lines(profile, phases, {"plain": 1.732, "O2": 2.457, "O5": "RuntimeError: boom"})
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if line.strip()}
    assert rows["plain"] == ["1.732", "1.000", "1.400", "device"]
    assert rows["O2"] == ["2.457", "2.000", "1.450", "host"]
    assert rows["O5"][0] == "not"


# -- the summary ----------------------------------------------------------------------------------------------
def test_summary_knows_every_target_of_the_benchmark() -> None:
    assert tuple(t.name for t in bench.TARGETS) == gpu_check_summary.TARGET_NAMES


def write_run(out: Path, failures: int, all_met: bool) -> None:
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
    verdicts = [{"target": t.name, "status": "met", "figure": "1.000x", "value": 1.0, "bound": t.bound}
                for t in bench.TARGETS]  # fmt: skip
    if not all_met:
        verdicts[0].update(status="not met", figure="0.950x (105.00 vs 100.00 ms)")
    report = {
        "verdicts": verdicts,
        "complete": True,
        "judged": True,
        "rows": {},
        "fused_gelu": {"cuda:0 bfloat16": "fused (forward (0, True), backward (0, True))"},
    }
    (logs / "gpu_train_step.json").write_text(json.dumps(report))
    (logs / "machine.txt").write_text("2.11.0 13.0 NVIDIA H100 80GB HBM3\n")


def test_the_summary_carries_the_hosts_speed_where_the_check_recorded_it(tmp_path: Path) -> None:
    write_run(tmp_path, 0, True)
    logs = tmp_path / "logs"
    host = "host speed: python 9.0 ms, cpu op 1.17 us, cuda launch 6.20 us"
    (logs / "machine.txt").write_text(f"2.11.0 13.0 NVIDIA H200\n{host}\n+---- nvidia-smi ----+\n")
    gpu_check_summary.main([str(tmp_path), "0", "0"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["machine"] == "2.11.0 13.0 NVIDIA H200" and summary["host"] == host
    assert f"\n{host} (scripts/host_speed.py" in (tmp_path / "summary.md").read_text()
    (logs / "machine.txt").write_text("2.11.0 13.0 NVIDIA H200\n")  # a check from before the probe
    gpu_check_summary.main([str(tmp_path), "0", "0"])
    assert json.loads((tmp_path / "summary.json").read_text())["host"] is None
    assert "host speed: not recorded" in (tmp_path / "summary.md").read_text()


def test_the_host_speed_probe_prints_its_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert host_speed.main(["--repeats", "1"]) == 0
    printed = capsys.readouterr().out.strip()
    figures = host_speed.measure(1)
    assert printed.startswith("host speed: python ") and " ms, cpu op " in printed
    assert figures["python_ms"] > 0 and figures["cpu_op_us"] > 0  # type: ignore[operator]
    assert (figures["cuda_launch_us"] is None) == (not torch.cuda.is_available())
    assert printed.endswith("cuda launch n/a") == (not torch.cuda.is_available())
    with pytest.raises(SystemExit):
        host_speed.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("suite_rc", "failures", "all_met", "ok"), [(0, 0, True, True), (1, 1, True, False), (0, 0, False, False)]
)
def test_summary_passes_only_a_green_suite_with_every_target_met(
    tmp_path: Path, suite_rc: int, failures: int, all_met: bool, ok: bool
) -> None:
    write_run(tmp_path, failures, all_met)
    assert gpu_check_summary.main([str(tmp_path), str(suite_rc), "0"]) == (0 if ok else 1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is ok
    suite = summary["suite"]
    assert (suite["tests"], suite["passed"], suite["failures"], suite["skipped"]) == (10, 8 - failures, failures, 2)
    assert ("overall: PASS" in (tmp_path / "summary.md").read_text()) is ok
    # Whether O4 with Apex's lists ran the fused gelu: the check's decision, where the GPU session reads first.
    assert "- cuda:0 bfloat16: fused (forward (0, True), backward (0, True))" in (tmp_path / "summary.md").read_text()
    if failures:
        assert "- FAILURE tests.test_x::test_0: assert 0 == 0" in (tmp_path / "summary.md").read_text()
    verdict = (tmp_path / "verdict.txt").read_text()
    assert verdict.startswith(f"gpu_check verdict: {'PASS' if ok else 'FAIL'} | suite: {8 - failures} passed, ")
    assert verdict.count(": met (1.000x)") == len(bench.TARGETS) - (0 if all_met else 1)
    if not all_met:
        assert "| O5 AdamW foreach speed >= 1.08x native autocast bf16: not met (0.950x (105.00 vs 100.00 ms)) |" in (
            verdict
        )


def test_summary_lists_targets_as_not_measured_when_the_benchmark_wrote_nothing(tmp_path: Path) -> None:
    write_run(tmp_path, 0, True)
    (tmp_path / "logs" / "gpu_train_step.json").unlink()
    assert gpu_check_summary.main([str(tmp_path), "0", "124"]) == 1
    verdict = (tmp_path / "verdict.txt").read_text()
    assert verdict.count(": not measured (no benchmark results)") == len(bench.TARGETS) and "FAIL" in verdict


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
        assert "--profile" in args
        verdicts = [{"target": "O2 AdamW fused speed >= 1.08x native autocast fp16 + GradScaler", "status": "met",
                     "figure": "1.250x (80.00 vs 100.00 ms)", "value": 1.25, "bound": 1.08}]
        report = {"rows": {"O2 AdamW fused": {"ms_per_step": 80.0}}, "verdicts": verdicts, "complete": False}
        (out / "gpu_train_step.json").write_text(json.dumps(report))
        (out / "gpu_train_step_profile.txt").write_text("== O5 AdamW fused\n")
    raise SystemExit(os.environ.get("FAKE_BENCH_RC", "1"))
if args[:2] == ["-m", "benchmarks.cast_list_effect"]:
    # Recorded, not run: the real one would measure on the device for up to CAST_TIMEOUT (twice per test, on a
    # GPU machine's run of the suite: these tests were its three slowest, 45-53 s each, in the ninth session).
    with open(os.environ["FAKE_LOG"] + ".cast", "a") as log:
        log.write(" ".join(args) + "\n")
    print("cast-list effect: stand-in", flush=True)
    sys.exit(0)
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
    # the benchmark's partial results are judged; what it did not reach is not measured
    assert "| O2 AdamW fused speed >= 1.08x native autocast fp16 + GradScaler: met (1.250x (80.00 vs 100.00 ms)) |" in (
        verdict
    )
    assert "| O5 AdamW fused speed >= 1.08x native autocast bf16: not measured (not in the benchmark's report) |" in (
        verdict
    )
    assert "- FAILURE tests.test_a::test_slow: AssertionError: no" in (out / "summary.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"]["state"] == "cut" and summary["suite"]["exit_status"] == 124
    assert returned_files(out) == [
        "gpu_check_logs.tar.gz", "profile.txt", "summary.json", "summary.md", "verdict.txt"
    ]  # fmt: skip
    assert (out / "profile.txt").read_text() == "== O5 AdamW fused\n"
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        assert {"logs/pytest.xml", "logs/pytest.txt", "logs/machine.txt", "logs/gpu_train_step.json"} <= set(
            tar.getnames()
        )
    args, threads = (tmp_path / "pytest_args.txt").read_text().splitlines()
    for option in ("--device cuda", "-n 2 --dist loadfile", "--timeout 120", "-rfE --tb=short --durations=25"):
        assert option in args
    assert threads == str(max(1, len(os.sched_getaffinity(0)) // 2))
    # The cast-list runs come after the benchmark, one per half dtype, on the device, their logs in the archive.
    cast_runs = (tmp_path / "pytest_args.txt.cast").read_text().splitlines()
    assert [run.split("--dtype ")[1].split()[0] for run in cast_runs] == ["bf16", "fp16"]
    assert all("--device cuda" in run and "--steps 3" in run and f"--out {out}/logs" in run for run in cast_runs)
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        assert {"logs/cast_list_effect_bf16.txt", "logs/cast_list_effect_fp16.txt"} <= set(tar.getnames())


def test_a_suite_that_ignores_the_cut_is_killed_and_the_check_still_ends(tmp_path: Path) -> None:
    result, out = run_check(tmp_path, "hang-deaf", "none")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("gpu_check verdict: FAIL | suite: no counts (the suite cut, exit 137)")
    assert verdict.count(": not measured (no benchmark results)") == len(bench.TARGETS)
    assert returned_files(out) == ["gpu_check_logs.tar.gz", "summary.json", "summary.md", "verdict.txt"]


def test_a_crashed_suite_is_reported_and_the_benchmark_still_runs(tmp_path: Path) -> None:
    result, out = run_check(tmp_path, "crash", "partial")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("gpu_check verdict: FAIL | suite: no counts (the suite crashed, exit 139)")
    assert "O2 AdamW fused speed >= 1.08x native autocast fp16 + GradScaler: met" in verdict
    assert "Segmentation fault" in (out / "summary.md").read_text()  # the log's last lines, with no JUnit file


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
