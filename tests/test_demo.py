"""ampinit demo: the --quick run writes a table, JSON, Markdown and a PNG that agree, and its numbers make sense."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ampinit.demo import cli
from ampinit.demo.config import OPT_LEVELS, DemoConfig, quick_config
from ampinit.demo.interleaved import train_interleaved
from ampinit.demo.machine import busy_reasons, cpu_flags, relative_spread
from ampinit.demo.output import format_verdict, write_outputs
from ampinit.demo.plot import _loss_axis_scale, write_png
from ampinit.demo.progress import Eta, make_progress
from ampinit.demo.results import DemoReport, RunResult, TaskReport, _fill_speedups
from ampinit.demo.run import judge, run_demo
from ampinit.demo.tasks import make_classifier
from ampinit.demo.verdict import LevelOutcome, choose_level
from ampinit.demo.workloads import _LEARNING_RATES, _make_task

STEPS = 12  # a fixed step count: nothing here depends on how fast the machine is
# The module's one --quick demo runs in the first test that needs it, inside that test's timeout (pytest-timeout):
# about a minute on a busy 2-core machine.
pytestmark = pytest.mark.timeout(600)

COMPUTE = {"O0": "float32", "O1": "float16", "O2": "float16", "O3": "float16", "O4": "bfloat16", "O5": "bfloat16"}
WEIGHTS = {
    "O0": "float32",
    "O1": "float32",
    "O2": "float16 + fp32 masters",
    "O3": "float16",
    "O4": "float32",
    "O5": "bfloat16 + fp32 masters",
}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoReport, Path, str, str]:
    """One --quick run of the whole demo (all levels, both tasks), with progress bars on."""
    out = tmp_path_factory.mktemp("demo")
    stdout, progress = io.StringIO(), io.StringIO()
    config = quick_config(out=out, steps=STEPS, block=4, time_budget_s=None)
    report = run_demo(config, stream=stdout, progress_stream=progress)
    return report, out, stdout.getvalue(), progress.getvalue()


@pytest.fixture(scope="module")
def saved(quick: tuple[DemoReport, Path, str, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((quick[1] / "results.json").read_text(encoding="utf-8"))
    return data


def runs_of(saved: dict[str, Any], task: str) -> dict[str, dict[str, Any]]:
    (entry,) = [t for t in saved["tasks"] if t["name"] == task]
    return {run["level"]: run for run in entry["runs"]}


def test_demo_writes_every_file(quick: tuple[DemoReport, Path, str, str]) -> None:
    _, out, stdout, _ = quick
    assert (out / "results.json").is_file() and (out / "results.md").is_file()
    if HAS_MATPLOTLIB:
        assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote png      {out / 'demo.png'}" in stdout
    else:
        assert "matplotlib is not installed: no PNG" in stdout


def test_json_says_what_ran(saved: dict[str, Any]) -> None:
    env = saved["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["threads"] >= 1
    assert saved["config"]["levels"] == list(OPT_LEVELS) and saved["config"]["quick"] is True
    assert saved["memory_method"].startswith("CPU: growth of the process RSS")
    assert [task["name"] for task in saved["tasks"]] == ["checkerboard", "mlp"]
    for task in ("checkerboard", "mlp"):
        runs = runs_of(saved, task)
        assert list(runs) == list(OPT_LEVELS)
        for level, run in runs.items():
            assert (run["compute_dtype"], run["weight_dtype"]) == (COMPUTE[level], WEIGHTS[level].split(" +")[0])
            assert run["master_weights"] == (level in ("O2", "O5"))
            assert run["steps"] == run["planned_steps"] == STEPS == len(run["losses"])
            assert run["stopped_by_budget"] is False
            assert 0 <= run["skipped_steps"] <= run["steps"]
            assert run["peak_memory_mib"] >= 0
            assert run["step_time_spread"] >= 0
        assert runs["O0"]["speedup_vs_o0"] == 1.0
    # None: the noise check rejected a figure the verdict would rest on (a busy machine)
    assert saved["verdict"]["level"] in (*OPT_LEVELS, None) and saved["verdict"]["reason"]
    assert saved["load_average"].keys() == {"before", "after"}


def plain_fp32_losses(task_name: str) -> list[float]:
    """The reference: the same task trained in plain fp32 torch, without ampinit."""
    task = _make_task(task_name, True, torch.device("cpu"))
    model = task.build(0, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATES[task_name])
    batches, losses = task.batches(0), []
    for _ in range(STEPS):
        inputs, target = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_numbers_make_sense(saved: dict[str, Any]) -> None:
    for task in ("checkerboard", "mlp"):
        runs = runs_of(saved, task)
        reference = plain_fp32_losses(task)
        assert runs["O0"]["losses"] == pytest.approx(reference, rel=1e-5), "O0 is plain fp32 training"
        assert reference[-1] < reference[0]
        for level in ("O1", "O2", "O4", "O5"):
            # Same start, same batches: the mixed-precision levels follow the fp32 curve closely.
            assert runs[level]["losses"] == pytest.approx(reference, rel=0.02, abs=2e-3), level
        for level in ("O1", "O2"):
            assert runs[level]["final_loss_scale"] == 65536.0  # Apex's initial 2**16; no overflow in 12 steps
            assert runs[level]["skipped_steps"] == 0
        for level in ("O0", "O3", "O4", "O5"):
            assert runs[level]["final_loss_scale"] == 1.0


def markdown_rows(text: str, task: str) -> list[list[str]]:
    section = text.split(f"## {task}\n", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines() if line[:2] == "| "]


def half_unit(decimals: int) -> float:
    """Half a unit in the last printed digit, plus room for the float error of the parsed cell."""
    return 0.5 * 10.0**-decimals * (1 + 1e-9) + 1e-12


def test_markdown_and_printed_tables_match_the_json(
    quick: tuple[DemoReport, Path, str, str], saved: dict[str, Any]
) -> None:
    _, out, stdout, _ = quick
    markdown = (out / "results.md").read_text(encoding="utf-8")
    for task in ("checkerboard", "mlp"):
        runs = runs_of(saved, task)
        header, *rows = markdown_rows(markdown, task)
        assert header[4:9] == ["final loss", "accuracy", "ms/step", "spread", "vs O0"]
        assert [row[0] for row in rows] == list(OPT_LEVELS)
        for row in rows:
            run = runs[row[0]]
            assert row[1:3] == [run["compute_dtype"], WEIGHTS[run["level"]]]
            assert row[3] == str(run["steps"])
            # A printed cell is within half a unit of its last digit; a value exactly on the half
            # (1.25 printed with one decimal) rounds to even, so allow the half unit plus float noise.
            assert float(row[4]) == pytest.approx(run["final_loss"], abs=half_unit(4), nan_ok=True)
            assert float(row[5].rstrip("%")) == pytest.approx(100 * run["accuracy"], abs=half_unit(1))
            assert float(row[6]) == pytest.approx(run["ms_per_step"], abs=half_unit(1))
            assert float(row[7].rstrip("%")) == pytest.approx(100 * run["step_time_spread"], abs=half_unit(0))
            assert float(row[8].rstrip("x")) == pytest.approx(run["speedup_vs_o0"], abs=half_unit(2))
            assert float(row[9]) == pytest.approx(run["peak_memory_mib"], abs=half_unit(1))
            assert int(row[10]) == run["skipped_steps"]
            assert float(row[11]) == run["final_loss_scale"]
            printed = [line for line in stdout.splitlines() if line.startswith(row[0] + " ")]
            assert len(printed) == 2, "one row per task"
            assert row in [re.split(r"\s{2,}", line.strip()) for line in printed]
    level = saved["verdict"]["level"]
    head = f"Verdict: use {level} on this machine" if level else "Verdict: no recommendation"
    assert head in stdout and head in markdown
    assert ("THIS MACHINE WAS BUSY" in stdout) == bool(saved["busy"])


def test_progress_bars_ran(quick: tuple[DemoReport, Path, str, str]) -> None:
    progress = quick[3]
    levels = ",".join(OPT_LEVELS)
    assert f"checkerboard {levels}" in progress and f"mlp {levels}" in progress


def test_line_progress_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    stream = io.StringIO()
    bar = make_progress(True, "mlp O5", 8, stream)
    for step in range(1, 9):
        bar.update(step, 1.0 / step)
    bar.close()
    assert stream.getvalue().splitlines() == [
        "mlp O5: step 1/8  loss 1.0000",
        "mlp O5: step 2/8  loss 0.5000",
        "mlp O5: step 4/8  loss 0.2500",
        "mlp O5: step 6/8  loss 0.1667",
        "mlp O5: step 8/8  loss 0.1250",
    ]


def test_png_skipped_with_a_message_without_matplotlib(
    quick: tuple[DemoReport, Path, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    stream = io.StringIO()
    write_outputs(quick[0], tmp_path, plot=True, stream=stream)
    assert "matplotlib is not installed: no PNG (pip install 'ampinit[demo]' to get one)" in stream.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]


def test_cli_runs_a_small_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--levels", "o0, O5", "--tasks", "mlp", "--out", str(tmp_path), "--no-plot", "--no-progress"]
    assert cli.main([*argv, "--steps", "6", "--time-budget", "none"]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^O0 +float32 +float32 +6 ", stdout, re.M)
    assert re.search(r"^O5 +bfloat16 +bfloat16 \+ fp32 masters +6 ", stdout, re.M)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["levels"] == ["O0", "O5"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--levels", "O7"], "argument --levels: unknown opt level 'O7'; allowed: O0, O1, O2, O3, O4, O5"),
        (["--levels", "01"], "unknown opt level '01' (the prefix is the letter O, not the number zero)"),
        (["--tasks", "mnist"], "argument --tasks: unknown task 'mnist'; allowed: checkerboard, mlp"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["--time-budget", "soon"], "argument --time-budget: expected a number of seconds, got 'soon'"),
        (["--block", "0"], "argument --block: expected an integer >= 1, got '0'"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_cuda_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda, but CUDA is not available" in capsys.readouterr().err


def test_the_demo_registers_on_any_subparsers(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="ampinit")
    commands = parser.add_subparsers(dest="command")
    cli.add_demo_parser(commands)

    args = parser.parse_args(["demo", "--quick", "--levels", "O0,O4", "--out", str(tmp_path), "--steps", "7"])
    assert args.func is cli.demo_command
    assert cli.demo_config(args) == quick_config(levels=("O0", "O4"), out=tmp_path, steps=7)
    args = parser.parse_args(["demo", "--time-budget", "none", "--block", "3"])
    assert cli.demo_config(args) == DemoConfig(time_budget_s=None, block=3)
    assert cli.demo_config(parser.parse_args(["demo"])) == DemoConfig()


def test_the_demo_points_to_the_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m ampinit.demo doctor`` ran the doctor while its parser lived in the demo; the doctor is
    ``ampinit doctor`` now, and the old spelling says so instead of running anything."""
    assert cli.main(["doctor", "--budget", "0.1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "the doctor is not part of the demo: run `ampinit doctor` (or `python -m ampinit doctor`)" in captured.err


def test_config_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown opt level 'O6'; allowed: O0, O1, O2, O3, O4, O5")):
        DemoConfig(levels=("O0", "O6"))
    with pytest.raises(ValueError, match=re.escape("unknown task 'cifar'; allowed: checkerboard, mlp")):
        DemoConfig(tasks=("cifar",))
    with pytest.raises(ValueError, match=re.escape("device must be one of cpu, cuda, got 'mps'")):
        DemoConfig(device="mps")
    with pytest.raises(ValueError, match=re.escape("steps must be >= 3, got 2")):
        DemoConfig(steps=2)


def test_speedups_are_o0_time_over_each_time() -> None:
    def run(level: str, ms: float) -> RunResult:
        return RunResult("mlp", level, "", "", False, 3, 3, False, 1.0, 1.0, 1.0, ms, 0.0, None, None, 0, 1.0, [])

    runs = [run("O0", 10.0), run("O4", 5.0), run("O1", 40.0)]
    _fill_speedups(runs)
    assert [r.speedup_vs_o0 for r in runs] == [1.0, 2.0, 0.25]
    alone = [run("O5", 5.0)]
    _fill_speedups(alone)
    assert alone[0].speedup_vs_o0 is None


def outcomes(table: dict[str, tuple[float, float, float]]) -> list[LevelOutcome]:
    """Two tasks with the same (loss, accuracy, speedup) per level."""
    return [LevelOutcome(task, level, *row) for task in ("a", "b") for level, row in table.items()]


def test_verdict_picks_the_fastest_level_that_trains_like_fp32() -> None:
    table = {
        "O0": (1.0, 0.90, 1.0),
        "O1": (1.0, 0.90, 0.05),  # emulated fp16: far slower
        "O3": (float("nan"), 0.10, 3.0),  # fast but diverged
        "O4": (1.02, 0.90, 1.3),
        "O5": (1.04, 0.89, 1.4),
    }
    verdict = choose_level(outcomes(table), busy=False)
    assert verdict.level == "O5" and not verdict.tentative
    assert "1.40x as fast as O0" in verdict.reason and "O3 (non-finite loss on a)" in verdict.reason
    table["O5"] = (1.2, 0.89, 1.4)  # 20% worse loss than fp32: not acceptable
    assert choose_level(outcomes(table), busy=True).level == "O4"
    assert choose_level(outcomes(table), busy=True).tentative
    table["O4"] = (1.0, 0.90, 1.05)  # within noise of O0
    verdict = choose_level(outcomes(table), busy=False)
    assert verdict.level == "O0" and "not clearly faster than O0: O1 (0.05x), O4 (1.05x)" in verdict.reason
    assert choose_level([LevelOutcome("a", "O5", 1.0, 1.0, None)], busy=False).level is None


def test_busy_machine_is_detected_from_load_and_spread() -> None:
    assert busy_reasons(0.1, 2.2, cpus=2, threads=2, spreads={"mlp O0": 0.05}) == []
    (load,) = busy_reasons(1.5, 2.0, cpus=2, threads=2, spreads={"mlp O0": 0.05})
    assert "about 1.5 of 2 CPUs busy" in load
    (spread,) = busy_reasons(0.0, 2.0, cpus=2, threads=2, spreads={"mlp O0": 0.05, "mlp O1": 0.6})
    assert "in 1 of 2 runs, up to 60% in mlp O1" in spread
    assert relative_spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(3.0 / 3.0)  # quartiles 1.5, 4.5


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    text = "model name\t: Some Xeon\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert cpu_flags(text) == {"avx512_bf16": True, "amx_bf16": True, "avx512_fp16": False, "amx_fp16": False}
    assert cpu_flags("") == {}


def test_classifier_dataset_is_deterministic_and_uses_every_class() -> None:
    a, b = make_classifier(3, train_size=512, test_size=128), make_classifier(3, train_size=512, test_size=128)
    assert torch.equal(a.train_inputs, b.train_inputs) and torch.equal(a.test_target, b.test_target)
    assert a.train_inputs.shape == (512, 16) and a.test_inputs.shape == (128, 16)
    assert set(a.train_target.tolist()) == set(range(10))
    assert not torch.equal(a.train_inputs, make_classifier(4, train_size=512, test_size=128).train_inputs)


def test_benchmarks_import_the_package_tasks() -> None:
    from ampinit.demo import tasks
    from benchmarks import models

    assert models.make_mlp is tasks.make_mlp and models.make_checkerboard is tasks.make_checkerboard


def test_loss_axis_is_log_only_over_a_decade_of_positive_losses() -> None:
    assert _loss_axis_scale([0.53, 0.70, 0.61]) == "linear"  # within a decade: log would label crowded minor ticks
    assert _loss_axis_scale([2.26, 0.0001]) == "log"
    assert _loss_axis_scale([float("nan")] * 3) == "linear"  # every level diverged: nothing positive to log
    assert _loss_axis_scale([0.0, float("inf"), 1.0]) == "linear"


def test_png_is_drawn_when_every_level_runs_at_the_same_speed(
    quick: tuple[DemoReport, Path, str, str], tmp_path: Path
) -> None:
    """A busy machine evens out step times; a log time axis over one decade then collapsed the layout (a warning,
    an error under this suite's filterwarnings) and one task of NaN losses could not be log-scaled at all."""
    report = copy.deepcopy(quick[0])
    report.busy = ["the test says so"]
    for task in report.tasks:
        for run in task.runs:
            run.ms_per_step = 1.5
    for run in report.tasks[0].runs:
        run.losses = [float("nan")] * len(run.losses)
    if HAS_MATPLOTLIB:
        write_png(report, tmp_path / "demo.png")
        assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        stream = io.StringIO()
        write_outputs(report, tmp_path, plot=True, stream=stream)
        assert "matplotlib is not installed" in stream.getvalue()


# -- one verdict with the doctor; bars that move and ETAs that hold (timings injected, never real time) --------
def _judged(spreads: dict[str, float], load: float) -> dict[str, Any]:
    """``judge`` on a one-task table where O5 ran 1.4x as fast as O0 and trained like it."""
    speed = {"O0": 10.0, "O5": 10.0 / 1.4}
    runs = [
        RunResult(
            "mlp",
            level,
            "",
            "",
            False,
            3,
            3,
            False,
            1.0,
            1.0,
            0.9,
            ms,
            spreads.get(level, 0.05),
            None,
            None,
            0,
            1.0,
            [1.0, 1.0, 1.0],
        )
        for level, ms in speed.items()
    ]
    _fill_speedups(runs)
    env = {"cpus": 2, "threads": 2}
    report = DemoReport(env, {}, "", [TaskReport("mlp", "", "test accuracy", runs)], load_average={"before": load})
    judge(report)
    return report.verdict


def test_demo_verdict_is_tentative_on_a_loaded_machine_and_absent_on_rejected_figures() -> None:
    quiet = _judged({}, load=0.0)
    assert quiet["level"] == "O5" and not quiet["tentative"] and "1.40x as fast as O0" in quiet["reason"]
    assert _judged({}, load=6.0)["level"] == "O5" and _judged({}, load=6.0)["tentative"]
    for noisy in ("O0", "O5"):  # either side of the 1.4x the verdict would rest on
        verdict = _judged({noisy: 0.6}, load=0.0)
        assert verdict["level"] is None and f"mlp {noisy}" in verdict["reason"]
    # Too few timed steps to measure a spread (a budget cut the run short): no figure to rest a verdict on.
    assert relative_spread([1.0, 1.0, 1.0]) == math.inf
    assert _judged({"O5": relative_spread([1.0, 1.0])}, load=0.0)["level"] is None
    report = DemoReport({}, {}, "", [], verdict={"level": None, "reason": "noisy", "tentative": False})
    assert format_verdict(report).startswith("Verdict: no recommendation")


class _Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_eta_counts_only_the_steps_the_time_budget_lets_run() -> None:
    # The full demo on a busy machine: 300 steps in rounds of 10, 120 s for this task; 20 steps took 188 s.
    clock = _Clock(0.0)
    eta = Eta(300, 10, 120.0, 3, clock)
    clock.now = 188.0
    assert eta.end_step(20) == 20 and eta.remaining_s(20) == 0.0  # tqdm said 43:48 left here
    # 2 s per step after 20 steps: 40 more fit in the 80 s left, so the run ends at step 60.
    clock.now = 40.0
    assert eta.end_step(20) == 60 and eta.remaining_s(20) == pytest.approx(80.0)
    assert eta.text(20) == "about 1:20 left (the time budget stops it at step 60)"
    # A round in progress always finishes, and without a budget the run goes to the end.
    clock.now = 200.0
    assert eta.end_step(25) == 30
    free = Eta(300, 10, None, 3, clock)
    clock.now += 30.0
    assert free.end_step(30) == 300 and free.remaining_s(30) == pytest.approx(270.0)
    assert free.text(0) == "time left: measuring"


class _Recorder:
    def __init__(self) -> None:
        self.done: list[float] = []
        self.closed = False

    def update(self, done: float, loss: float) -> None:
        self.done.append(done)

    def close(self) -> None:
        self.closed = True


def test_bars_move_after_every_level_and_the_budget_is_never_overrun() -> None:
    task = _make_task("mlp", True, torch.device("cpu"))
    bar, etas = _Recorder(), []

    def progress(eta: Eta) -> _Recorder:
        etas.append(eta)
        return bar

    clock = _Clock(1.0)  # every reading advances one second: a round (2 levels x 2 steps) takes 10 s
    runs = train_interleaved(
        task,
        ("O0", "O5"),
        steps=40,
        block=2,
        seconds=25.0,
        seed=0,
        device=torch.device("cpu"),
        progress=progress,
        clock=clock,
    )
    for run in runs:
        run.shutdown()
    # Two rounds fit in 25 s; a third would end at 30 s, so it is not started (it used to be, past the budget).
    assert [len(run.losses) for run in runs] == [4, 4]
    assert etas[0].deadline is not None and clock.now <= etas[0].deadline
    # The bar moved after each level's block of 2 steps (1 step of the whole run each), not once per round.
    assert bar.done == [1.0, 2.0, 3.0, 4.0] and bar.closed


def test_every_public_name_of_the_demo_package_is_the_object_its_module_defines() -> None:
    """``ampinit.demo`` loads its names lazily from the module each lives in: each of ``__all__`` must resolve,
    to the object that module defines (a name added to one list and not the other fails here)."""
    import ampinit.demo as package

    expected = {
        "DemoConfig": DemoConfig,
        "quick_config": quick_config,
        "DemoReport": DemoReport,
        "RunResult": RunResult,
        "TaskReport": TaskReport,
        "run_demo": run_demo,
    }
    assert sorted(package.__all__) == sorted(expected)
    for name, obj in expected.items():
        assert getattr(package, name) is obj, name
