"""ampinit demo: the --quick run writes a table, JSON, Markdown and a PNG that agree, and its numbers make sense."""

from __future__ import annotations

import argparse
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
from ampinit.demo.run import (
    FP16_LEVELS,
    OPT_LEVELS,
    DemoConfig,
    DemoReport,
    fp16_matmul_slowdown,
    make_progress,
    plan_steps,
    quick_config,
    run_demo,
    write_outputs,
)
from ampinit.demo.tasks import make_classifier

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
    report = run_demo(quick_config(out=out), stream=stdout, progress_stream=progress)
    return report, out, stdout.getvalue(), progress.getvalue()


@pytest.fixture(scope="module")
def saved(quick: tuple[DemoReport, Path, str, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((quick[1] / "results.json").read_text(encoding="utf-8"))
    return data


def runs_of(saved: dict[str, Any], task: str) -> dict[str, dict[str, Any]]:
    (entry,) = [t for t in saved["tasks"] if t["name"] == task]
    return {run["level"]: run for run in entry["runs"]}


def test_quick_run_is_quick_and_writes_every_file(quick: tuple[DemoReport, Path, str, str]) -> None:
    report, out, stdout, _ = quick
    assert report.wall_seconds < 30
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
            emulated_fp16 = level in FP16_LEVELS and env["fp16_emulated"]
            assert run["planned_steps"] == (10 if emulated_fp16 else 100)
            assert run["steps"] == len(run["losses"]) and 3 <= run["steps"] <= run["planned_steps"]
            assert run["stopped_by_budget"] == (run["steps"] < run["planned_steps"])
            assert 0 <= run["skipped_steps"] <= run["steps"]
            assert run["peak_memory_mib"] >= 0
            assert run["speedup_vs_o0"] == pytest.approx(runs["O0"]["ms_per_step"] / run["ms_per_step"])


def test_numbers_make_sense(saved: dict[str, Any]) -> None:
    for task in ("checkerboard", "mlp"):
        runs = runs_of(saved, task)
        o0 = runs["O0"]
        assert o0["final_loss"] < 0.8 * o0["initial_loss"], "O0 must learn: fp32 is the reference"
        common = min(run["steps"] for run in runs.values())
        for level in ("O1", "O2", "O4", "O5"):
            # Same start, same batches: the mixed-precision levels follow the fp32 curve closely.
            assert runs[level]["losses"][common - 1] == pytest.approx(o0["losses"][common - 1], rel=0.25), level
        for level in ("O1", "O2"):
            scale = runs[level]["final_loss_scale"]
            assert 1 <= scale <= 2.0**16 and math.log2(scale).is_integer(), (level, scale)
        for level in ("O0", "O3", "O4", "O5"):
            assert runs[level]["final_loss_scale"] == 1.0
    assert runs_of(saved, "checkerboard")["O0"]["accuracy"] > 0.9


def markdown_rows(text: str, task: str) -> list[list[str]]:
    section = text.split(f"## {task}\n", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines() if line[:2] == "| "]


def test_markdown_and_printed_tables_match_the_json(
    quick: tuple[DemoReport, Path, str, str], saved: dict[str, Any]
) -> None:
    _, out, stdout, _ = quick
    markdown = (out / "results.md").read_text(encoding="utf-8")
    for task in ("checkerboard", "mlp"):
        runs = runs_of(saved, task)
        common = min(run["steps"] for run in runs.values())
        header, *rows = markdown_rows(markdown, task)
        assert header[5] == f"loss @ {common}"
        assert [row[0] for row in rows] == list(OPT_LEVELS)
        for row in rows:
            run = runs[row[0]]
            assert row[1:3] == [run["compute_dtype"], WEIGHTS[run["level"]]]
            assert row[3].split()[0] == str(run["steps"])
            assert float(row[4]) == pytest.approx(run["final_loss"], abs=5e-5, nan_ok=True)
            assert float(row[5]) == pytest.approx(run["losses"][common - 1], abs=5e-5, nan_ok=True)
            assert float(row[6].rstrip("%")) == pytest.approx(100 * run["accuracy"], abs=0.05)
            assert float(row[7]) == pytest.approx(run["ms_per_step"], abs=0.05)
            assert float(row[8].rstrip("x")) == pytest.approx(run["speedup_vs_o0"], abs=0.005)
            assert float(row[9]) == pytest.approx(run["peak_memory_mib"], abs=0.05)
            assert int(row[10]) == run["skipped_steps"]
            assert float(row[11]) == run["final_loss_scale"]
            printed = [line for line in stdout.splitlines() if line.startswith(row[0] + " ")]
            assert len(printed) == 2, "one row per task"
            assert row in [re.split(r"\s{2,}", line.strip()) for line in printed]


def test_progress_bars_ran(quick: tuple[DemoReport, Path, str, str]) -> None:
    progress = quick[3]
    for level in OPT_LEVELS:
        assert f"checkerboard {level}" in progress and f"mlp {level}" in progress


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
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^O0 +float32 +float32 +100 ", stdout, re.M)
    assert re.search(r"^O5 +bfloat16 +bfloat16 \+ fp32 masters +100 ", stdout, re.M)
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


def test_subcommands_register_on_any_subparsers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="ampinit")
    commands = parser.add_subparsers(dest="command")
    cli.add_demo_parser(commands)
    cli.add_doctor_parser(commands)

    args = parser.parse_args(["demo", "--quick", "--levels", "O0,O4", "--out", str(tmp_path), "--steps", "7"])
    assert args.func is cli.demo_command
    assert cli.demo_config(args) == quick_config(levels=("O0", "O4"), out=tmp_path, steps=7)
    assert cli.demo_config(parser.parse_args(["demo"])) == DemoConfig()

    args = parser.parse_args(["doctor", "--budget", "0.2", "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__ and report["recommendation"] in OPT_LEVELS


def test_config_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown opt level 'O6'; allowed: O0, O1, O2, O3, O4, O5")):
        DemoConfig(levels=("O0", "O6"))
    with pytest.raises(ValueError, match=re.escape("unknown task 'cifar'; allowed: checkerboard, mlp")):
        DemoConfig(tasks=("cifar",))
    with pytest.raises(ValueError, match=re.escape("device must be one of cpu, cuda, got 'mps'")):
        DemoConfig(device="mps")
    with pytest.raises(ValueError, match=re.escape("steps must be >= 3, got 2")):
        DemoConfig(steps=2)


@pytest.mark.parametrize(
    ("level", "emulated", "fp16_steps", "expected"),
    [("O0", True, None, 300), ("O1", True, None, 30), ("O2", False, None, 300), ("O3", True, 40, 40)],
)
def test_fp16_levels_run_fewer_steps_only_where_fp16_is_emulated(
    level: str, emulated: bool, fp16_steps: int | None, expected: int
) -> None:
    assert plan_steps(DemoConfig(fp16_steps=fp16_steps), level, emulated) == expected


def test_fp16_probe_matches_the_cpu_flags() -> None:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    has_fp16 = " avx512_fp16" in flags or " amx_fp16" in flags
    slowdown = fp16_matmul_slowdown(torch.device("cpu"))
    assert (slowdown > 2.0) != has_fp16, slowdown


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
