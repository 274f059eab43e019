"""ampinit doctor: the report is measured here, as the demo measures, and the recommendation is the demo's verdict
on it: tentative on a loaded machine, none where the noise check rejected a figure it would rest on.

The verdict tests drive the timings with a fake clock (every reading advances it by a set amount), never with
real time: what is checked is what the doctor concludes from given step times, not how fast this machine is."""

from __future__ import annotations

import argparse
import ast
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

import ampinit.demo
from ampinit.cli import add_doctor_parser, main
from ampinit.demo.config import OPT_LEVELS
from ampinit.doctor import DeviceReport, Report, diagnose, format_report, recommend


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The doctor trains real steps (only their timing is faked): on one thread they cost a fraction of what two
    threads do on a shared machine, where OpenMP's workers wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class FakeClock:
    """Each reading advances the time by the next of ``increments`` (cycled): a step, timed by two readings,
    lasts one increment."""

    def __init__(self, increments: Sequence[float]) -> None:
        self.now = 0.0
        self._increments = itertools.cycle(increments)

    def __call__(self) -> float:
        self.now += next(self._increments)
        return self.now


def measured(speedup: dict[str, float], spread: dict[str, float], probe: float = 1.0) -> DeviceReport:
    """What the doctor measured on one device: the same loss and accuracy at every level (all train like fp32),
    O0 at 10 ms/step, each other level at 10 ms / its speedup."""
    levels = ["O0", *speedup]
    return DeviceReport(
        device="cpu",
        name="test",
        autocast_dtypes=["float16", "bfloat16"],
        steps=20,
        step_ms={level: 10.0 / speedup.get(level, 1.0) for level in levels},
        step_spread={level: spread.get(level, 0.05) for level in levels},
        speedup_vs_o0={"O0": 1.0, **speedup},
        loss=dict.fromkeys(levels, 1.0),
        accuracy=dict.fromkeys(levels, 0.9),
        fp16_probe={"matmul": 1.0, "conv fwd+bwd": probe},
        fused_optimizers={},
    )


def test_recommendation_follows_quiet_measurements() -> None:
    verdict = recommend(measured({"O4": 1.3, "O5": 1.4}, {}), loaded=False)
    assert verdict.level == "O5" and not verdict.tentative
    assert "1.40x as fast as O0" in verdict.reason
    verdict = recommend(measured({"O4": 1.05, "O5": 1.02}, {}), loaded=False)
    assert verdict.level == "O0" and "not clearly faster than O0" in verdict.reason
    verdict = recommend(measured({"O1": 2.5}, {}, probe=48.0), loaded=False)
    assert verdict.level == "O1" and "conv fwd+bwd 48.0x" in verdict.reason and "avoid O1-O3" in verdict.reason


@pytest.mark.parametrize("noisy_level", ["O0", "O5", "O4"])
def test_no_recommendation_rests_on_a_figure_the_noise_check_rejected(noisy_level: str) -> None:
    # O5 looks 1.4x as fast, but one of the figures that comparison reads (O0's time, O5's, or O4's, which
    # decides whether O5 is the fastest) varied by 40%: the doctor must not recommend a level on it.
    verdict = recommend(measured({"O4": 1.3, "O5": 1.4}, {noisy_level: 0.4}), loaded=False)
    assert verdict.level is None
    assert f"mlp {noisy_level}" in verdict.reason and "noise check rejected" in verdict.reason


def test_a_noisy_level_that_did_not_train_like_fp32_does_not_block_the_verdict() -> None:
    device = measured({"O3": 3.0, "O5": 1.4}, {"O3": 0.9})
    device.loss["O3"] = float("nan")  # diverged: out of the comparison, so its noisy time is not read
    verdict = recommend(device, loaded=False)
    assert verdict.level == "O5" and "O3 (non-finite loss on mlp)" in verdict.reason


def test_a_loaded_machine_makes_the_recommendation_tentative() -> None:
    verdict = recommend(measured({"O4": 1.3, "O5": 1.4}, {}), loaded=True)
    assert verdict.level == "O5" and verdict.tentative


def test_diagnose_declines_when_its_own_step_times_are_noisy() -> None:
    # Every third reading jumps 20 ms: a third of the steps take 20x the others, in every level.
    report = diagnose(budget_s=0.01, clock=FakeClock([0.001, 0.001, 0.020]), load=lambda: 0.0)
    cpu = report.devices[0]
    assert all(spread > 0.25 for spread in cpu.step_spread.values()), cpu.step_spread
    assert report.recommendation is None and "noise check rejected" in report.reason
    text = format_report(report)
    assert "Recommended opt level: none" in text and "THIS MACHINE IS BUSY" in text


@pytest.mark.parametrize(("load", "tentative"), [(0.0, False), (12.0, True)])
def test_diagnose_marks_a_verdict_from_a_loaded_machine_tentative(load: float, tentative: bool) -> None:
    # Steady 1 ms steps at every level: no level is faster than O0, and the figures pass the noise check.
    report = diagnose(budget_s=0.01, clock=FakeClock([0.001]), load=lambda: load)
    assert all(spread == 0.0 for spread in report.devices[0].step_spread.values())
    assert report.recommendation == "O0" and report.tentative is tentative
    assert ("TENTATIVE" in format_report(report)) is tentative


def test_diagnose_measures_this_machine() -> None:
    report = diagnose(budget_s=0.1)
    assert report.torch == torch.__version__
    cpu = report.devices[0]
    assert cpu.device == "cpu" and "bfloat16" in cpu.autocast_dtypes  # CPU autocast accepts bf16 since 1.10
    assert {"O0", "O4", "O5"} <= set(cpu.step_ms) <= {"O0", "O1", "O2", "O4", "O5"}
    assert set(cpu.speedup_vs_o0) == set(cpu.step_ms)
    assert cpu.steps >= 20 and set(cpu.fp16_probe) == {"matmul", "conv fwd+bwd"}
    assert all(ms > 0 for ms in cpu.step_ms.values())
    assert cpu.fused_optimizers["AdamW"] is True  # CPU fused AdamW exists in torch >= 2.4
    text = format_report(report)
    assert f"Recommended opt level: {report.recommendation or 'none'}" in text
    assert "training step   : O0" in text and "fp16 time / fp32: matmul" in text
    if report.cpu_flags:
        assert "avx512_bf16" in text and "amx_bf16" in text and "avx512_fp16" in text and "amx_fp16" in text
    assert ("THIS MACHINE IS BUSY" in text) == bool(report.busy)


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--budget", "0.1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["cpu_flags"]) <= {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}
    assert data["recommendation"] in ("O0", "O1", "O2", "O4", "O5", None)
    assert isinstance(data["tentative"], bool)


def test_the_doctor_registers_on_any_subparsers(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="ampinit")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--budget", "0.1", "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__ and report["recommendation"] in (*OPT_LEVELS, None)


def test_the_demo_imports_nothing_of_the_doctor() -> None:
    """The doctor is built on the demo's measurement (``ampinit.demo.interleaved``, ``verdict``); the demo, its command
    line included, does not reach back up to it, at any depth (a lazy import counts)."""
    demo = Path(ampinit.demo.__file__).parent
    reached: dict[str, int] = {}
    for path in sorted(demo.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name == "ampinit.doctor" or name.startswith("ampinit.doctor.") for name in names):
                reached[path.name] = node.lineno
    assert reached == {}


def test_the_report_says_where_apexs_fp32_gelu_runs_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU the fused gelu never runs: no line. Where it may (CUDA; here the CPU made to stand in for it), the
    # line gives the check's decision per half dtype.
    from ampinit import doctor
    from ampinit._casting import fused_gelu

    assert doctor._fused_gelu("cpu") == {}
    assert "Apex's fp32 gelu" not in format_report(Report("x", "y", "z", "cpu", 1, devices=[measured({}, {})]))
    monkeypatch.setattr(fused_gelu, "ON_CPU", True)
    exact = {torch.bfloat16: fused_gelu.Choice((0, True), (0, True)), torch.float16: None}
    monkeypatch.setattr(fused_gelu, "_check", lambda device, dtype, reference=None: exact[dtype])
    fused_gelu.forget()
    try:
        decided = doctor._fused_gelu("cpu")
    finally:
        fused_gelu.forget()
    assert decided == {"bfloat16": "fused", "float16": "unfused"}
    device = measured({}, {})
    device.fused_gelu = decided
    text = format_report(Report("x", "y", "z", "cpu", 1, devices=[device]))
    assert "  Apex's fp32 gelu: bfloat16 fused, float16 unfused" in text
