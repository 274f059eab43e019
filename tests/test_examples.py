"""Every example runs and shows what it claims, checked against a reference run (fp32, or the same data another way).

All example runs share one subprocess (one torch import): each script runs there as ``__main__`` with its own
``sys.argv``, as ``python examples/NAME.py ARGS`` would. One example also runs on its own, to prove that works.
(``o2_master_weights.py`` is tested in test_docs.py.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ampinit import amp
from tests._device import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
RUNS_BUDGET_S = 1800  # every example in one subprocess, on a busy 2-core machine
# A per-test timeout (pytest-timeout) also counts the module fixture's runs in the first test that needs them.
pytestmark = pytest.mark.timeout(RUNS_BUDGET_S + 60)

RUNS: dict[str, list[str]] = {
    "o1 O1": ["o1_basic.py", "--steps", "60"],
    "o1 O0": ["o1_basic.py", "--steps", "60", "--opt-level", "O0"],
    "o5": ["o5_bf16.py", "--steps", "150"],
    "accumulate O0 4x16": ["gradient_accumulation.py", "--opt-level", "O0", "--steps", "20"],
    "accumulate O0 1x64": [
        "gradient_accumulation.py",
        "--opt-level",
        "O0",
        "--steps",
        "20",
        "--accumulate",
        "1",
        "--micro-batch",
        "64",
    ],
    "accumulate O2 4x16": ["gradient_accumulation.py", "--opt-level", "O2", "--steps", "20"],
    "clip O0": ["gradient_clipping.py", "--opt-level", "O0", "--steps", "20"],
    "clip O2": ["gradient_clipping.py", "--opt-level", "O2", "--steps", "20"],
    "clip O5 apex": ["gradient_clipping.py", "--opt-level", "O5", "--steps", "20", "--apex-pattern"],
    "clip O5": ["gradient_clipping.py", "--opt-level", "O5", "--steps", "20"],
    "gan O0": ["multiple_losses_gan.py", "--opt-level", "O0", "--steps", "300"],
    "gan O2": ["multiple_losses_gan.py", "--opt-level", "O2", "--steps", "300"],
    "resume O2": ["checkpoint_resume.py", "--opt-level", "O2", "--steps", "10"],
    "resume O5": ["checkpoint_resume.py", "--opt-level", "O5", "--steps", "10"],
    "custom O4": ["custom_functions.py", "--opt-level", "O4"],
}

RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for key, (script, *args) in json.loads(sys.argv[1]).items():
    out = io.StringIO()
    sys.argv = [script, *args]
    error = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:
            error = traceback.format_exc()
    results[key] = {"stdout": out.getvalue(), "error": error}
sys.stdout.write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    runs = {key: [f"examples/{script}", *args] for key, (script, *args) in RUNS.items()}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(runs)],
        cwd=ROOT,
        env=subprocess_env(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=RUNS_BUDGET_S,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    return {key: result["stdout"] + (result["error"] or "") for key, result in results.items()}


def number(text: str, pattern: str) -> float:
    found = re.search(pattern, text)
    assert found is not None, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


def test_every_example_is_tested() -> None:
    scripts = {path.name for path in (ROOT / "examples").glob("*.py")}
    assert scripts == {script for script, *_ in RUNS.values()} | {"o2_master_weights.py"}


@pytest.mark.parametrize("key", list(RUNS))
def test_example_ran(outputs: dict[str, str], key: str) -> None:
    assert "Traceback" not in outputs[key], outputs[key]


def test_o1_casts_matmuls_to_fp16_and_learns_like_fp32(outputs: dict[str, str]) -> None:
    o1, o0 = outputs["o1 O1"], outputs["o1 O0"]
    assert "weights: torch.float32, logits: torch.float16, loss: torch.float32" in o1
    assert "weights: torch.float32, logits: torch.float32, loss: torch.float32" in o0
    assert number(o1, r"train accuracy ([0-9.]+)") > 0.95
    final = r"final loss ([0-9.]+)"
    assert number(o1, final) == pytest.approx(number(o0, final), rel=0.1)


def test_o5_follows_fp32_where_plain_bf16_stalls(outputs: dict[str, str]) -> None:
    text = outputs["o5"]
    assert "O5 weights: torch.bfloat16, master weights: torch.float32" in text
    fp32, o5 = number(text, r"O0 +final loss ([0-9.]+)"), number(text, r"O5 +final loss ([0-9.]+)")
    plain = number(text, r"pure bf16 final loss ([0-9.]+)")
    assert o5 == pytest.approx(fp32, rel=0.01)
    assert plain > 1.1 * fp32


def test_accumulated_steps_equal_full_batch_steps(outputs: dict[str, str]) -> None:
    final = r"final loss ([0-9.]+)"
    reference = number(outputs["accumulate O0 1x64"], final)
    assert number(outputs["accumulate O0 4x16"], final) == pytest.approx(reference, rel=1e-5)
    assert number(outputs["accumulate O2 4x16"], final) == pytest.approx(reference, rel=1e-3)
    assert "optimizer steps 20, skipped 0, loss scale 65536" in outputs["accumulate O2 4x16"]


def test_clipping_sees_the_unscaled_norm(outputs: dict[str, str]) -> None:
    # Skipped steps leave the weights alone, so O2's first applied step starts where O0's first step did.
    pattern = r"first applied step \(\d+\): ([0-9.]+)"
    assert number(outputs["clip O2"], pattern) == pytest.approx(number(outputs["clip O0"], pattern), rel=1e-3)
    # The fp16 scale settles first: from Apex's initial 2**16, each skipped step halves it, and no growth happens
    # within 20 steps (growth interval 2000), so the skips are exactly the halvings.
    skipped, scale = number(outputs["clip O2"], r"skipped (\d+) steps"), number(outputs["clip O2"], r"loss scale (\d+)")
    assert skipped >= 1 and 2.0**16 / scale == 2.0**skipped
    assert number(outputs["clip O0"], r"skipped (\d+) steps") == 0


def test_amp_clip_grad_norm_prints_what_apexs_pattern_prints(outputs: dict[str, str]) -> None:
    assert "clipped 20 of 20 applied steps" in outputs["clip O5"]
    assert outputs["clip O5"] == outputs["clip O5 apex"]


def test_gan_keeps_one_scale_per_loss_and_learns_like_fp32(outputs: dict[str, str]) -> None:
    pattern = r"loss scales \(D real, D fake, G\): (\S+), (\S+), (\S+)"
    o2, o0 = re.search(pattern, outputs["gan O2"]), re.search(pattern, outputs["gan O0"])
    assert o2 is not None and o0 is not None, outputs["gan O2"]
    assert [float(scale) for scale in o0.groups()] == [1.0, 1.0, 1.0]  # O0: no loss scaling
    for scale in map(float, o2.groups()):
        # Dynamic scales start at 2**16 and only halve (overflow) or double (growth): powers of two.
        assert 1 <= scale <= 2.0**24 and math.log2(scale).is_integer(), o2.groups()
    steps = r"optimizer steps (\d+), skipped (\d+)"
    found_o2, found_o0 = re.search(steps, outputs["gan O2"]), re.search(steps, outputs["gan O0"])
    assert found_o2 is not None and found_o0 is not None
    assert found_o0.groups() == (found_o2.group(1), "0")  # the same loop, and fp32 never skips
    assert int(found_o2.group(2)) <= 10, "a handful of skips while the three fp16 scales settle"
    mean = r"generated mean \((\S+), (\S+)\)"
    o2_mean = [float(v) for v in re.search(mean, outputs["gan O2"]).groups()]  # type: ignore[union-attr]
    o0_mean = [float(v) for v in re.search(mean, outputs["gan O0"]).groups()]  # type: ignore[union-attr]
    assert o0_mean == pytest.approx([2.0, -1.0], abs=0.4), "the fp32 reference learns the target"
    assert o2_mean == pytest.approx(o0_mean, abs=0.25), (o2_mean, o0_mean)


def sha256_of(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for value in state.values():
        digest.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_resume_is_bitwise(outputs: dict[str, str], level: str) -> None:
    text = outputs[f"resume {level}"]
    weights = r"weights ([0-9a-f]{64}), "
    scales = r"loss scales (\(.*?\))"
    uninterrupted = re.search(r"uninterrupted: +" + weights + scales, text)
    resumed = re.search(r"resumed: +" + weights + scales, text)
    checkpoint = re.search(r"checkpoint: +" + weights, text)
    assert uninterrupted is not None and resumed is not None and checkpoint is not None, text
    # The reference: the same 2 x 10 steps, uninterrupted, trained here with the example's own model and data.
    example = runpy.run_path(str(ROOT / "examples" / "checkpoint_resume.py"))
    model, optimizer = example["build"](level)
    try:
        example["train"](model, optimizer, 0, 20)
        expected_weights, expected_scales = sha256_of(model.state_dict()), str(amp.stats().loss_scales)
    finally:
        amp.deinitialize()
    assert resumed.groups() == uninterrupted.groups() == (expected_weights, expected_scales)
    assert checkpoint.group(1) != expected_weights  # the resumed half trained


def test_custom_functions_under_o4(outputs: dict[str, str]) -> None:
    under, after = outputs["custom O4"].split("after amp.deinitialize()")
    assert "mylib.normalize_rows got torch.float32" in under
    assert "mylib.mix got torch.bfloat16, torch.bfloat16" in under
    assert "gated (decorated with half_function) got torch.bfloat16, torch.bfloat16" in under
    assert "(originals restored: True, no policy)" in after
    assert "bfloat16" not in after


def test_an_example_runs_on_its_own() -> None:
    done = subprocess.run(
        [sys.executable, "examples/custom_functions.py"],
        cwd=ROOT,
        env=subprocess_env(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "mylib.mix got torch.float16, torch.float16" in done.stdout


def test_ddp_example_under_plain_python_says_to_use_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "examples/distributed/train_ddp.py", "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert "launch it with torchrun" in done.stderr and "RANK expected" not in done.stderr


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "distributed" / "train_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("gpus", "local_rank", "ranks", "expected"),
    [(1, 1, 2, ("cuda:0", "gloo")), (2, 1, 2, ("cuda:1", "nccl")), (1, 0, 1, ("cuda:0", "nccl"))],
)
def test_ddp_example_maps_ranks_onto_the_gpus_there_are(
    monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, ranks: int, expected: tuple[str, str]
) -> None:
    """The torchrun example maps local ranks onto the GPUs there are, and picks gloo where ranks share a GPU.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    example = load_example()
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    device, backend = example.pick_device()
    assert (str(device), backend) == expected
    assert chosen == [device]
    sys.modules.pop("train_ddp", None)
