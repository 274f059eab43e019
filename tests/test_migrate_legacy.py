"""``ampinit migrate`` on the shapes real legacy Apex code has: a ``--to torch`` rewrite is either equivalent on
every path through the function or refused with the reason, and no migration emits an import that does not
resolve."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

# Tacotron2/WaveGlow style: amp only when a flag is set, a plain backward otherwise.
FP16_RUN_SWITCH = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, fp16_run):
        if fp16_run:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if fp16_run:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()
    """
)

# The flag that guards initialize changes afterwards: enabled=<flag> at the GradScaler could not follow it.
FLAG_CHANGES = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, fp16_run):
        if fp16_run:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        fp16_run = False
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if fp16_run:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()
    """
)

# initialize under `try`: the other path (the except) has no GradScaler.
INIT_UNDER_TRY = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data):
        try:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        except RuntimeError:
            pass
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """
)

# a plain backward on the path where amp is on: scaler.step() would see unscaled gradients.
PLAIN_BACKWARD_WHEN_ON = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, fp16_run):
        if fp16_run:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if fp16_run:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            loss.backward()
            optimizer.step()
    """
)

# Availability guard: without Apex the script trains in fp32.
TRY_IMPORT_GUARD = textwrap.dedent(
    """
    import torch

    try:
        from apex import amp

        mixed_precision = True
    except ImportError:
        mixed_precision = False


    def train(model, optimizer, data):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", enabled=mixed_precision)
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """
)

# initialize unconditional, but scale_loss only on one branch: the other branch steps unscaled gradients.
CONDITIONAL_SCALE = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, use_amp):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if use_amp:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            optimizer.step()
    """
)

# The equivalent shape: everything on one path, step after the scaled backward (gradient accumulation included).
ONE_PATH = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, accumulate):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            if (i + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
    """
)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (FLAG_CHANGES, "the flag `fp16_run` that guards amp.initialize is assigned again later"),
        (INIT_UNDER_TRY, "amp.initialize runs only on some paths (it sits under `try`"),
        (PLAIN_BACKWARD_WHEN_ON, "a backward() outside amp.scale_loss"),
        (TRY_IMPORT_GUARD, "the Apex import sits under `try`"),
        (CONDITIONAL_SCALE, "optimizer.step() can run on a path without amp.scale_loss before it"),
    ],
)
def test_to_torch_refuses_what_is_not_equivalent_on_every_path(source: str, reason: str) -> None:
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    assert any(reason in site.message for site in result.needs_human), [s.message for s in result.sites]


def test_to_torch_rewrites_the_one_path_shape() -> None:
    result = migrate_source(ONE_PATH, "torch")
    assert not result.refused and not result.needs_human, [s.message for s in result.sites]
    assert "scaler.scale(loss).backward()" in result.migrated
    assert "scaler.step(optimizer)" in result.migrated
    assert "apex" not in result.migrated and "ampinit" not in result.migrated


def _train(source: str, fp16_run: bool, apex_aliases: bool = False) -> torch.Tensor:
    """Run ``train`` of ``source`` on a fixed problem; returns the trained weight. ``apex_aliases``: the original
    file as ``ampinit run`` runs it (``apex`` resolves to ampinit's Apex layer)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with as_apex_code(apex_aliases):
        exec_source(source, "fp16_run.py")["train"](model, optimizer, data, fp16_run)  # type: ignore[operator]
    return model.weight.detach().clone()


def _fp32(fp16_run: bool) -> torch.Tensor:
    """The same training in plain fp32: the reference for both paths."""
    del fp16_run
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.weight.detach().clone()


def test_to_torch_rewrites_initialize_under_a_flag_with_enabled_flag() -> None:
    """Tacotron2/WaveGlow's `if fp16_run: amp.initialize(...)`: the GradScaler is created before the `if` with
    enabled=bool(fp16_run), so the rewritten calls hold on both paths (this used to be refused, and before that
    rewritten into an UnboundLocalError)."""
    result = migrate_source(FP16_RUN_SWITCH, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "    scaler = torch.amp.GradScaler(amp_device, enabled=bool(fp16_run))\n" in result.migrated
    assert "    if fp16_run:\n        model, optimizer" not in result.migrated
    assert "apex" not in result.migrated and "ampinit" not in result.migrated
    # fp16 off: bitwise the fp32 loop, as the original was
    torch.testing.assert_close(_train(result.migrated, False), _fp32(False), rtol=0, atol=0)
    # fp16 on: the original under the Apex aliases and the native rewrite train alike, and like fp32
    native, original = _train(result.migrated, True), _train(FP16_RUN_SWITCH, True, apex_aliases=True)
    torch.testing.assert_close(native, original, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(native, _fp32(True), rtol=1e-2, atol=1e-2)


# -- no emitted import that does not resolve --------------------------------------------------------------------------


def test_a_name_ampinit_does_not_provide_is_left_for_a_human_with_the_reason() -> None:
    source = "from apex.contrib.xentropy import SoftmaxCrossEntropyLoss\nfrom apex import amp\n"
    result = migrate_source(source, "ampinit")
    assert "from apex.contrib.xentropy import SoftmaxCrossEntropyLoss" in result.migrated
    assert "from ampinit import amp" in result.migrated
    [site] = result.needs_human
    assert "ampinit provides no apex.contrib.xentropy.SoftmaxCrossEntropyLoss" in site.message
    package = migrate_source("import apex\nmlp = apex.mlp.MLP([4, 2])\nnorm = apex.normalization.FusedLayerNorm(4)\n")
    assert package.migrated.startswith("import apex\nimport ampinit.compat.apex\n"), package.migrated
    assert "mlp = apex.mlp.MLP([4, 2])" in package.migrated
    assert "norm = ampinit.compat.apex.normalization.FusedLayerNorm(4)" in package.migrated
    assert any("ampinit provides no apex.mlp" in s.message for s in package.needs_human)


@pytest.mark.parametrize(
    ("source", "emitted"),
    [
        ("from apex.optimizers import FP16_Optimizer\n", "from ampinit.compat.apex.fp16_utils import FP16_Optimizer"),
        (
            "from apex.parallel.distributed import flat_dist_call\n",
            "from ampinit.compat.apex.parallel.distributed import flat_dist_call",
        ),
        (
            "from apex.normalization import FusedLayerNorm, MixedFusedRMSNorm\n",
            "from ampinit.compat.apex.normalization import FusedLayerNorm\n"
            "from ampinit.compat.apex.normalization import MixedFusedRMSNorm",
        ),
        (
            "from apex.normalization.fused_layer_norm import FusedLayerNorm as BertLayerNorm\n",
            "from ampinit.compat.apex.normalization.fused_layer_norm import FusedLayerNorm as BertLayerNorm",
        ),
        ("from amp_C import multi_tensor_l2norm\n", "from ampinit.compat.apex.amp_C import multi_tensor_l2norm"),
        ("import apex_C\n", "from ampinit.compat.apex import apex_C"),
    ],
)
def test_names_real_code_imports_are_rewritten_to_homes_that_exist(source: str, emitted: str) -> None:
    """--to ampinit rewrites them to ampinit's Apex layer; --to torch leaves no dependency, so it refuses them
    (torch has no counterpart), unchanged, with the reason."""
    from ampinit.migrate._resolve import unresolved_imports

    result = migrate_source(source, "ampinit")
    assert not result.refused and not result.needs_human, [s.message for s in result.sites]
    assert emitted in result.migrated
    assert unresolved_imports(result.migrated, source) == []
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "migrated.py", "exec"), namespace)
    native = migrate_source(source, "torch")
    assert native.refused and not native.changed
    assert all("has no native torch equivalent" in site.message for site in native.needs_human)


def test_the_codemod_refuses_its_own_rewrite_to_a_missing_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last check, independent of the rules: a rule pointing at a name that does not exist (a bug in the
    table) gives a refused, unchanged file, never a broken one."""
    from ampinit.migrate import _rules

    monkeypatch.setitem(_rules.TARGETS, "apex.optimizers.FusedAdam", _rules.Target("ampinit.optimizers", "NoSuch"))
    monkeypatch.setattr(_rules.Target, "resolves", property(lambda self: True))
    source = "from apex.optimizers import FusedAdam\n"
    result = migrate_source(source, "ampinit")
    assert result.refused and not result.changed
    [site] = result.needs_human
    assert "import that does not resolve (ampinit.optimizers.NoSuch)" in site.message


def test_every_golden_output_imports_only_names_that_exist() -> None:
    from pathlib import Path

    from ampinit.migrate._resolve import unresolved_imports

    golden = Path(__file__).resolve().parent / "golden"
    for before in sorted(golden.glob("*.before.txt")):
        for to in ("ampinit", "torch"):
            after = before.with_name(before.name.replace(".before.", f".{to}."))
            assert unresolved_imports(after.read_text(encoding="utf-8"), "") == [], after.name


# -- optimizer wrappers: LARC keeps amp on the Apex-compatible path ---------------------------------------------------

LARC_SCRIPT = textwrap.dedent(
    """
    import torch
    from apex import amp
    from apex.parallel.LARC import LARC


    def train(model, data, opt_level):
        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.02)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        return model
    """
)


def test_a_larc_wrapped_optimizer_keeps_amp_on_the_apex_path_and_trains(session_cleanup: None) -> None:
    """--to ampinit used to send LARC(optimizer) to the native initialize, which raises TypeError; the file now
    keeps amp on ampinit's Apex layer and trains exactly like the plain fp32 LARC loop under O0."""
    import torch

    from ampinit.compat.apex.parallel.LARC import LARC

    result = migrate_source(LARC_SCRIPT, "ampinit")
    assert not result.needs_human
    assert "from ampinit.compat.apex import amp" in result.migrated
    torch_result = migrate_source(LARC_SCRIPT, "torch")
    assert torch_result.refused or "ampinit" not in torch_result.migrated
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "larc.py", "exec"), namespace)
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
    model, reference = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    namespace["train"](model, data, "O0")  # type: ignore[operator]
    optimizer = LARC(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.02)
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(model.weight, reference.weight)


# -- detection gaps and the minor items -------------------------------------------------------------------------------

GUARDS = textwrap.dedent(
    """
    import importlib.util
    import sys

    from transformers.file_utils import is_apex_available

    if "apex" in sys.modules:
        fused = True
    HAS_APEX = importlib.util.find_spec("apex") is not None
    if is_apex_available():
        fused = True
    """
)


def test_availability_guards_are_rewritten_to_ask_for_ampinit() -> None:
    """--to ampinit: after the migration the file's Apex names come from ampinit, so each check asks for ampinit
    (`'ampinit' in sys.modules`, `find_spec("ampinit")`) or holds (`is_apex_available()` -> True), and the guarded
    code takes the path it took where Apex was installed."""
    import ampinit  # noqa: F401  (the migrated file's own imports load it)

    result = migrate_source(GUARDS, "ampinit")
    assert not result.needs_human, [s.render() for s in result.sites]
    assert 'if "ampinit" in sys.modules:' in result.migrated
    assert 'importlib.util.find_spec("ampinit") is not None' in result.migrated
    assert "if True:" in result.migrated
    namespace: dict[str, object] = {}
    runnable = result.migrated.replace("from transformers.file_utils import is_apex_available\n", "")
    exec(compile(runnable, "guards.py", "exec"), namespace)
    assert namespace["HAS_APEX"] is True and namespace["fused"] is True


def test_availability_guards_stay_flagged_under_to_torch_and_local_helpers_are_migrated_with_their_body() -> None:
    result = migrate_source(GUARDS, "torch")
    assert sorted(site.line for site in result.needs_human) == [7, 9, 10], [s.render() for s in result.sites]
    assert all("an Apex availability guard" in site.message for site in result.needs_human)
    assert result.migrated.count("# ampinit: an Apex availability guard") == 3
    local = "def is_apex_available():\n    return True\n\n\nif is_apex_available():\n    from apex import amp\n"
    migrated = migrate_source(local, "ampinit")
    assert "if is_apex_available():\n    from ampinit import amp" in migrated.migrated
    assert not migrated.needs_human


def test_star_import_from_fp16_utils_is_rewritten_to_a_module_that_has_the_names() -> None:
    result = migrate_source("from apex.fp16_utils import *\nopt = FP16_Optimizer\n", "ampinit")
    assert result.migrated.startswith("from ampinit.compat.apex.fp16_utils import *\n")
    assert not result.needs_human
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "star.py", "exec"), namespace)
    assert namespace["opt"].__name__ == "FP16_Optimizer"  # type: ignore[attr-defined]


def test_trailing_comments_on_rewritten_imports_are_kept() -> None:
    source = "from apex import amp  # noqa: F401\nfrom apex.optimizers import FusedAdam  # type: ignore\n"
    result = migrate_source(source, "ampinit")
    assert "from ampinit import amp  # noqa: F401\n" in result.migrated
    assert "from ampinit.optimizers import FusedAdam  # type: ignore\n" in result.migrated


def test_a_second_pass_counts_the_notes_the_first_pass_left() -> None:
    source = "from apex.parallel import DistributedDataParallel as DDP\nm = DDP(net, gradient_predivide_factor=4.0)\n"
    first = migrate_source(source, "ampinit")
    assert len(first.needs_human) == 1
    second = migrate_source(first.migrated, "ampinit")
    assert not second.changed
    [site] = second.needs_human
    assert "left by an earlier migration: dropped Apex-only gradient_predivide_factor" in site.message


# -- --to torch: try-guards, helper modules, unused imports, checkpoints ---------------------------------------------


def test_a_guard_that_only_raises_is_dropped_and_a_fallback_is_kept() -> None:
    """`except ImportError: raise ...` could only turn a missing Apex into a crash: the body stays; a guard whose
    handler is the code's own no-Apex path keeps that path (what the file did where Apex was not installed)."""
    raises = (
        "try:\n    from apex.parallel import DistributedDataParallel as DDP\n"
        'except ImportError:\n    raise ImportError("install apex")\n'
    )
    result = migrate_source(raises, "torch")
    assert result.migrated == "from torch.nn.parallel import DistributedDataParallel as DDP\n", result.migrated
    fallback = (
        "try:\n    from apex.normalization import FusedLayerNorm\n\n    fused = True\n"
        "except ImportError:\n    fused = False\n"
    )
    kept = migrate_source(fallback, "torch")
    assert kept.migrated == "fused = False\n" and not kept.needs_human
    assert "the code's own fallback is kept" in kept.sites[0].message
    namespace: dict[str, object] = {}
    exec(compile(kept.migrated, "fallback.py", "exec"), namespace)
    assert namespace["fused"] is False
    # --to ampinit keeps the guard: ampinit provides the name, so the body runs
    assert "from ampinit.compat.apex.normalization import FusedLayerNorm" in migrate_source(fallback).migrated


def test_an_unused_amp_import_is_removed() -> None:
    source = "import torch\nfrom apex import amp\n\nscaler = torch.amp.GradScaler('cpu')\n"
    result = migrate_source(source, "torch")
    assert result.migrated == "import torch\n\nscaler = torch.amp.GradScaler('cpu')\n"
    assert not result.refused and not result.needs_human


HELPER_MODULE = textwrap.dedent(
    """
    import torch
    from apex import amp


    @amp.float_function
    def upsample(x, scale=2):
        return torch.nn.functional.interpolate(x, scale_factor=scale, mode="nearest")


    def head(x, weight):
        with amp.disable_casts():
            return x @ weight
    """
)


def test_a_helper_module_of_float_function_and_disable_casts_migrates_natively(session_cleanup: None) -> None:
    """The written decorator casts like Apex's float_function under ampinit's aliases (O1): fp32 in, whatever the
    caller's autocast; outside autocast nothing changes."""
    from ampinit.compat import apex

    result = migrate_source(HELPER_MODULE, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "@amp_float_function\n" in result.migrated and "apex" not in result.migrated
    native: dict[str, object] = {}
    exec(compile(result.migrated, "helpers.py", "exec"), native)
    x = torch.randn(1, 1, 2, 2).half()
    assert native["upsample"](x).dtype == torch.float16  # type: ignore[operator]  # no autocast: no cast
    apex.install()
    try:
        original: dict[str, object] = {}
        exec(compile(HELPER_MODULE, "helpers_apex.py", "exec"), original)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        import ampinit.compat.apex.amp as amp

        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        with torch.autocast("cpu", dtype=torch.float16):
            got = native["upsample"](x)  # type: ignore[operator]
            weight = torch.randn(2, 2)
            plain = native["head"](torch.randn(2, 2), weight)  # type: ignore[operator]
        want = original["upsample"](x)  # type: ignore[operator]
    finally:
        apex.uninstall()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert plain.dtype == torch.float32  # disable_casts: no fp16 matmul inside


@pytest.mark.parametrize("where", ["if TYPE_CHECKING:\n    import torch\n", "def g():\n    import torch\n"])
def test_float_function_helper_needs_a_module_level_torch(where: str) -> None:
    """A helper module that imports torch only under `if TYPE_CHECKING:` or inside a function: the written
    `amp_float_function` decorator uses `torch` at module level, but `import torch` was not added (any `import torch`
    in the file counted): calling the decorated function raised NameError.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    source = (
        "from typing import TYPE_CHECKING\nfrom apex import amp\n"
        + where
        + textwrap.dedent(
            """

        @amp.float_function
        def f(x):
            return x * 2
        """
        )
    )
    result = migrate_source(source, "torch")
    if result.refused:
        return
    namespace: dict[str, Any] = {}
    exec(compile(result.migrated, "<migrated>", "exec"), namespace)
    assert torch.equal(namespace["f"](torch.ones(2)), torch.full((2,), 2.0))


def test_load_state_dict_takes_checkpoints_of_either_format() -> None:
    """The helper written for amp.load_state_dict gives GradScaler the state ampinit.migrate.grad_scaler_state
    computes from an Apex checkpoint, and passes GradScaler's own state through."""
    from ampinit.migrate import grad_scaler_state

    source = textwrap.dedent(
        """
        import torch
        from apex import amp


        def train(model, optimizer, data, checkpoint):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
            amp.load_state_dict(checkpoint["amp"])
            for x, y in data:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            return amp.state_dict()
        """
    )
    result = migrate_source(source, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert 'scaler.load_state_dict(grad_scaler_state(checkpoint["amp"]))' in result.migrated
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "resume.py", "exec"), namespace)
    apex_state = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}
    assert namespace["grad_scaler_state"](apex_state) == grad_scaler_state(apex_state)  # type: ignore[operator]
    model = torch.nn.Linear(2, 2)
    state = namespace["train"](  # type: ignore[operator]
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(torch.randn(4, 2), torch.randn(4, 2))],
        {"amp": apex_state},
    )
    assert state["scale"] == 1024.0 and state["_growth_tracker"] == 8
    again = namespace["grad_scaler_state"](state)  # type: ignore[operator]
    assert again is state


def test_the_codemod_reads_apex_signatures_from_the_apex_layer() -> None:
    """One source: the parameter names the codemod matches arguments by are those of the Apex layer's functions,
    which are Apex's (shared/reference/apex-amp.md §1.1, §1.2)."""
    from ampinit.migrate._to_torch import APEX_SIGNATURE, SCALE_LOSS_SIGNATURE

    assert APEX_SIGNATURE[:4] == ("models", "optimizers", "enabled", "opt_level")
    assert APEX_SIGNATURE[-3:] == ("verbosity", "min_loss_scale", "max_loss_scale") and len(APEX_SIGNATURE) == 14
    assert SCALE_LOSS_SIGNATURE == ("loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check")


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("", {}),
        (", adam_w_mode=False, weight_decay=0.1", {"adam_w_mode": False, "weight_decay": 0.1}),
        (", adam_w_mode=True, weight_decay=0.1", {"adam_w_mode": True, "weight_decay": 0.1}),
    ],
)
def test_fused_adam_becomes_the_torch_optimizer_with_apex_semantics(mode: str, options: dict[str, object]) -> None:
    """FusedAdam -> torch.optim.AdamW (Apex's default decoupled decay) or Adam (adam_w_mode=False, L2): five steps
    match ampinit's FusedAdam, which implements Apex's update."""
    from ampinit.optimizers import FusedAdam

    source = (
        f"from apex.optimizers import FusedAdam\n\n\ndef make(params):\n    return FusedAdam(params, lr=0.01{mode})\n"
    )
    result = migrate_source(source, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "apex" not in result.migrated and "torch.optim.Adam" in result.migrated
    namespace: dict[str, object] = {}
    exec(compile(result.migrated, "optim.py", "exec"), namespace)
    torch.manual_seed(0)
    native_model, apex_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    apex_model.load_state_dict(native_model.state_dict())
    native = namespace["make"](native_model.parameters())  # type: ignore[operator]
    reference = FusedAdam(apex_model.parameters(), lr=0.01, **options)  # type: ignore[arg-type]
    for _ in range(5):
        x = torch.randn(8, 4)
        for model, optimizer in ((native_model, native), (apex_model, reference)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    torch.testing.assert_close(native_model.weight, apex_model.weight)


def test_fused_adam_outside_the_torch_semantics_is_refused_with_the_reason() -> None:
    for call, reason in [
        ("FusedAdam(p, bias_correction=False)", "FusedAdam(bias_correction=False)"),
        ("FusedAdam(p, amsgrad=True)", "FusedAdam(amsgrad=True)"),
        ("FusedAdam(p, set_grad_none=False)", "FusedAdam(set_grad_none=False)"),
        ("FusedAdam(p, adam_w_mode=args.w)", "FusedAdam(adam_w_mode=<not a literal>)"),
    ]:
        result = migrate_source(f"from apex.optimizers import FusedAdam\nopt = {call}\n", "torch")
        assert result.refused and not result.changed
        assert any(reason in site.message for site in result.needs_human), [s.render() for s in result.sites]
    subclass = migrate_source("from apex.optimizers import FusedAdam\n\n\nclass Mine(FusedAdam):\n    pass\n", "torch")
    assert subclass.refused


def test_fused_sgd_stays_refused_with_the_zeroed_gradients_reason(session_cleanup: None) -> None:
    """FusedSGD zeroes gradients where torch's SGD sets them to None: with momentum, a parameter that got no
    gradient in a step still moves under FusedSGD (shown here through the Apex layer) and stays under torch's SGD,
    so --to torch keeps refusing it and says why."""
    result = migrate_source("from apex.optimizers import FusedSGD\nopt = FusedSGD(p, lr=0.1, momentum=0.9)\n", "torch")
    assert result.refused and not result.changed
    assert [s.render() for s in result.needs_human] == [
        "  line 1: [needs a human] apex.optimizers.FusedSGD has no native torch equivalent: its zero_grad() zeroes the "
        "gradients (set_grad_none=False, its default) where torch.optim.SGD's sets them to None, so a parameter that "
        "gets no gradient in a step still takes weight decay and moves with its momentum under FusedSGD, and is "
        "skipped by torch's SGD; besides, FusedSGD updates only fp16 and fp32 parameters, and restarts the momentum of "
        "every parameter of a dtype when the last one's is new; use --to ampinit (or replace it by hand)"
    ]
    from ampinit.compat.apex.optimizers import FusedSGD

    moved = []
    for make in (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        optimizer = make([used, unused])
        (used.sum() + unused.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        used.sum().backward()  # `unused` gets no gradient in this step
        before = unused.detach().clone()
        optimizer.step()
        moved.append(not torch.equal(unused.detach(), before))
    assert moved == [True, False]


LEVEL_VARIABLE = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, fp16_run):
        amp_opt_level = "O1" if fp16_run else "O0"
        model, optimizer = amp.initialize(model, optimizer, opt_level=amp_opt_level)
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """
)


def test_an_opt_level_variable_that_holds_o0_or_o1_switches_the_scaler() -> None:
    """MaskRCNN's `amp_opt_level = 'O1' if fp16 else 'O0'`: O0 is a disabled GradScaler and no autocast, so
    enabled=(level == "O1") is right on both paths; a level that could be O2 is still refused."""
    result = migrate_source(LEVEL_VARIABLE, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert 'enabled=bool(amp_opt_level == "O1")' in result.migrated
    torch.testing.assert_close(_train(result.migrated, False), _fp32(False), rtol=0, atol=0)
    native, original = _train(result.migrated, True), _train(LEVEL_VARIABLE, True, apex_aliases=True)
    torch.testing.assert_close(native, original, rtol=1e-3, atol=1e-3)
    maybe_o2 = LEVEL_VARIABLE.replace('"O1" if fp16_run else "O0"', '"O2" if fp16_run else "O0"')
    refused = migrate_source(maybe_o2, "torch")
    assert refused.refused and any("opt_level is not a literal" in s.message for s in refused.needs_human)


def test_a_guarded_import_apex_in_a_file_that_uses_apex_amp_is_not_taken_as_a_fallback() -> None:
    """Taking `apex = None` would silently turn amp off where the file reaches apex.amp: refused instead."""
    source = textwrap.dedent(
        """
        try:
            import apex
        except ImportError:
            apex = None


        def setup(model, optimizer):
            if apex is not None:
                return apex.amp.initialize(model, optimizer, opt_level="O1")
            return model, optimizer
        """
    )
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    assert "apex = None" in result.migrated and "import apex" in result.migrated


def test_apex_private_attributes_ampinit_lacks_are_left_for_a_human() -> None:
    """fairseq's FusedAdam subclass checks `self.multi_tensor_adam`: until ampinit's FusedAdam has it, a clean
    rewrite would crash at construction ("Apex installation is outdated"), so the site needs a human."""
    from ampinit.migrate._rules import private_attribute_provided

    source = textwrap.dedent(
        """
        from apex.optimizers import FusedAdam


        class Mine(FusedAdam):
            def check(self):
                return hasattr(self, "multi_tensor_adam"), self._dummy_overflow_buf
        """
    )
    result = migrate_source(source, "ampinit")
    expected = [n for n in ("_dummy_overflow_buf",) if not private_attribute_provided(n)]
    flagged = [s.message for s in result.needs_human]
    assert len(flagged) == len(expected), flagged
    assert all("Apex's private `_dummy_overflow_buf`" in m for m in flagged)
