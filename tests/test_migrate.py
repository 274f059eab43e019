"""``ampinit migrate``: golden before/after pairs for every rule, idempotence, the report and the CLI, and
migrated scripts that actually run and train."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampinit.cli import main
from ampinit.migrate import migrate_paths, migrate_source
from tests._device import subprocess_env
from tests.test_compat_run import assert_losses_match_fp32

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
CASES = sorted(p.name[: -len(".before.txt")] for p in GOLDEN.glob("*.before.txt"))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _report(result: object) -> str:
    sites = getattr(result, "sites")  # noqa: B009
    state = "refused" if getattr(result, "refused") else "ok"  # noqa: B009
    return "\n".join([state, *(site.render() for site in sites)]) + "\n"


@pytest.mark.parametrize("to", ["ampinit", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_golden(case: str, to: str) -> None:
    before = (GOLDEN / f"{case}.before.txt").read_text(encoding="utf-8")
    result = migrate_source(before, to, f"{case}.py")  # type: ignore[arg-type]
    after_path, report_path = GOLDEN / f"{case}.{to}.txt", GOLDEN / f"{case}.{to}.report.txt"
    assert result.migrated == after_path.read_text(encoding="utf-8")
    assert _report(result) == report_path.read_text(encoding="utf-8")
    again = migrate_source(result.migrated, to)  # type: ignore[arg-type]
    assert not again.changed, "migrating twice must change nothing"
    compile(result.migrated, f"{case}.{to}", "exec")


def test_every_rule_has_a_golden_site() -> None:
    reports = "".join(p.read_text(encoding="utf-8") for p in GOLDEN.glob("*.report.txt"))
    for rule in [
        "apex.amp -> ampinit.amp",
        "apex.amp -> ampinit.compat.apex.amp",
        "-> torch.nn.parallel.DistributedDataParallel",
        "(delay_allreduce -> find_unused_parameters)",
        "dropped Apex-only gradient_predivide_factor",
        "apex convert_syncbn_model -> torch",
        "dropped Apex-only channel_last",
        "to_python_float(x) -> x.item()",
        "to_python_float (as a value) -> torch.Tensor.item",
        "apex.optimizers.FusedAdam -> ampinit.optimizers.FusedAdam",
        "-> ampinit.multi_tensor.multi_tensor_applier",
        "amp_C -> ampinit.multi_tensor.amp_C",
        "amp.stats().loss_scales[i]",
        "amp._amp_state.loss_scalers[i] field -> amp.stats()",
        "FP16_Optimizer is kept through ampinit's Apex layer",
        "kept through ampinit's Apex layer (ampinit.compat.apex)",
        "import apex -> import ampinit.amp",
        "amp (O1) -> torch.autocast + torch.amp.GradScaler",
        "scale_loss block -> scaler.scale(loss).backward()",
        "optimizer.step() -> scaler.step(optimizer); scaler.update()",
        "scaler.load_state_dict(grad_scaler_state(s)): loads either format",
        "opt_level='O2' keeps a half-precision model",
        "num_losses > 1",
        "loss_id selects one of several loss scalers",
        "delay_unscale=True",
        "opt_level is not a literal",
        "amp.init has no native torch.amp equivalent",
        "apex.amp is used through `import apex`",
    ]:
        assert rule in reports, rule
    torch_after = (GOLDEN / "o1_loop.torch.txt").read_text(encoding="utf-8")
    for text in [
        "scaler.unscale_(optimizer)",
        'clip_grad_norm_((p for group in optimizer.param_groups for p in group["params"])',
        "scaler.state_dict()",
        "with torch.autocast(amp_device, dtype=torch.float16, enabled=bool(args.amp)):",
        "torch.autocast(amp_device, enabled=False)",
        "# the loss in fp32, as Apex's lists would",
    ]:
        assert text in torch_after, text


@pytest.mark.parametrize("to", ["ampinit", "torch"])
def test_apex_ddp_positional_delay_allreduce_is_mapped(to: str) -> None:
    """Apex's DDP signature is (module, message_size, delay_allreduce, ...): `DDP(model, 10000000, True)` passes
    delay_allreduce=True, which the keyword form maps to find_unused_parameters=True. Positionally it was dropped
    as "an Apex-only option", so torch's DDP failed on the second iteration for a model with unused parameters.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    source = textwrap.dedent(
        """
        from apex.parallel import DistributedDataParallel as DDP
        model = DDP(model, 10000000, True)
        """
    )
    result = migrate_source(source, to)  # type: ignore[arg-type]
    assert result.refused or "find_unused_parameters=True" in result.migrated, result.migrated


@pytest.mark.parametrize("to", ["ampinit", "torch"])
def test_apex_ddp_double_star_arguments_are_named_in_the_note(to: str) -> None:
    """`DDP(model, **ddp_kwargs)`: the `**ddp_kwargs` was dropped with the note "dropped positional argument 2 (an
    Apex-only option)", which names neither what was dropped nor why (its options cannot be read).

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    source = textwrap.dedent(
        """
        from apex.parallel import DistributedDataParallel as DDP
        ddp_kwargs = dict(delay_allreduce=True)
        model = DDP(model, **ddp_kwargs)
        """
    )
    result = migrate_source(source, to)  # type: ignore[arg-type]
    if result.refused:
        return
    notes = [site.message for site in result.sites if site.needs_human]
    assert any("**ddp_kwargs" in note for note in notes), notes


def test_write_report_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text((GOLDEN / "o2_refused.before.txt").read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["migrate", str(tmp_path), "--to", "torch"]) == 1  # a refused file is no success
    captured = capsys.readouterr()
    out = captured.out
    assert "1 file(s) scanned, 0 would change, 0 site(s) rewritten, 4 site(s) need a human, 1 file(s) refused" in out
    assert f"ampinit migrate: {script}: refused, left unchanged: " in captured.err
    assert "from apex import amp" in script.read_text(encoding="utf-8")
    assert main(["migrate", str(script), "--write", "--diff"]) == 0
    out = capsys.readouterr().out
    assert "-from apex import amp\n+from ampinit import amp" in out and "1 changed" in out
    assert "from ampinit import amp" in script.read_text(encoding="utf-8")
    report = migrate_paths([str(script)], write=True)
    assert not report.files[0].changed  # idempotent on disk too
    with pytest.raises(FileNotFoundError, match=re.escape("No such file or directory: 'nowhere.py'")):
        migrate_paths(["nowhere.py"])
    with pytest.raises(ValueError, match=re.escape("to must be 'ampinit' or 'torch', got 'jax'")):
        migrate_source("", "jax")  # type: ignore[arg-type]


@pytest.mark.slow
def test_migrated_scripts_run_and_train(tmp_path: Path) -> None:
    """The legacy examples, migrated both ways, run with plain `python` (no alias) and train as fp32 torch does."""
    source = (ROOT / "examples" / "legacy_apex" / "distributed_data_parallel.py").read_text(encoding="utf-8")
    for to in ("torch", "ampinit"):
        result = migrate_source(source, to)  # type: ignore[arg-type]
        assert result.changed and not result.refused and not result.needs_human
        script = tmp_path / f"ddp_{to}.py"
        script.write_text(result.migrated, encoding="utf-8")
        if to == "torch":
            imports = [line for line in result.migrated.splitlines() if line.startswith(("import ", "from "))]
            assert not [line for line in imports if "apex" in line or "ampinit" in line], imports
        run = subprocess.run(
            [sys.executable, str(script), "--iterations", "150"],
            capture_output=True,
            text=True,
            env=subprocess_env(ENV),
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        # The same training in plain fp32 torch is the reference, to fp16's precision, in both directions.
        assert_losses_match_fp32(run.stdout, 150)


O1_TRAIN = """
import torch
from apex import amp


def train(model, optimizer, data):
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    dtypes = []
    for x, y in data:
        optimizer.zero_grad()
        output = model(x)
        dtypes.append(output.dtype)
        loss = torch.nn.functional.mse_loss(output.float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return dtypes
"""


@pytest.mark.usefixtures("pretend_gpu")
def test_migrated_autocast_runs_on_the_models_device(device: torch.device) -> None:
    """On a GPU machine a model may still live elsewhere: the migrated file autocasts where the model is, as
    native torch.autocast on that device would."""
    result = migrate_source(O1_TRAIN, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    data = [(torch.randn(8, 4).to(device), torch.randn(8, 2).to(device)) for _ in range(2)]
    with torch.autocast(device.type, dtype=torch.float16):
        native = model(data[0][0]).dtype
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "train.py", "exec"), namespace)
    dtypes = namespace["train"](model, torch.optim.SGD(model.parameters(), lr=0.1), data)  # type: ignore[operator]
    assert native == torch.float16 and dtypes == [native, native]


HELPER_MODULE = """
import torch
from apex import amp


def head(x, weight):
    with amp.disable_casts():
        return x @ weight
"""


@pytest.mark.usefixtures("pretend_gpu")
def test_migrated_disable_casts_switches_off_the_callers_autocast(device: torch.device) -> None:
    """A helper module has no model: its disable_casts turns off the autocast its caller runs under, on any
    machine, as Apex's did."""
    result = migrate_source(HELPER_MODULE, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "helpers.py", "exec"), namespace)
    x, w = torch.randn(2, 3).to(device), torch.randn(3, 2).to(device)
    with torch.autocast(device.type, dtype=torch.float16):
        assert (x @ w).dtype == torch.float16  # autocast is on here
        assert namespace["head"](x, w).dtype == torch.float32  # type: ignore[operator]
