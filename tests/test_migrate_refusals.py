"""The refusals of ``migrate --to torch`` as a table (torch's ``OptimizerInfo``/``ErrorOptimizerInput`` shape):
every row carries a file it refuses, and each row's file is refused for exactly that row's reason through the
public ``migrate_source``. The rows are named here too, so that a refusal dropped from the table fails.

Below the table's tests: whole files in which defects of the rewrite were found, each refused today by a row, run
end to end with ``_same_or_refused`` (refused, or the rewrite trains as the original did)."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper

from ampinit.migrate import migrate_source
from ampinit.migrate._to_torch import _examples
from ampinit.migrate._to_torch._analysis import Analysis
from ampinit.migrate._to_torch._refusals import REFUSALS, Refusal, run
from tests.test_migrate_edges import _same_or_refused

#: Every reason --to torch refuses a file for, in the table's order (the order of the reasons on one line).
ROWS = [
    "initialize_twice",
    "no_initialize",
    "initialize_not_called",
    "initialize_star_args",
    "initialize_not_one_model",
    "initialize_without_optimizer",
    "opt_level_half",
    "opt_level_unknown",
    "initialize_cast_model_type",
    "initialize_patch_torch_functions",
    "initialize_keep_batchnorm_fp32",
    "initialize_master_weights",
    "initialize_cast_model_outputs",
    "initialize_min_loss_scale",
    "initialize_max_loss_scale",
    "num_losses",
    "static_loss_scale",
    "initialize_in_expression",
    "initialize_not_alone",
    "initialize_not_unpacked",
    "initialize_on_some_paths",
    "flag_assigned_again",
    "apex_import_guarded",
    "amp_use_unreachable",
    "amp_as_object",
    "amp_use_not_native",
    "scale_loss_not_in_with",
    "scale_loss_without_as",
    "scale_loss_one_line",
    "scale_loss_star_args",
    "scale_loss_other_optimizer",
    "loss_id",
    "delay_unscale",
    "delay_overflow_check",
    "master_params_outside_clipping",
    "master_params_other_optimizer",
    "master_params_not_alone",
    "master_params_in_scale_loss",
    "amp_call_not_called",
    "load_state_dict_arguments",
    "amp_state_internals",
    "loss_scale_read_before_step",
    "no_step",
    "step_with_closure",
    "step_in_expression",
    "step_not_alone",
    "step_in_scale_loss",
    "step_unreachable",
    "scaler_attribute_slots",
    "optimizer_assigned_again",
    "flag_differs_elsewhere",
    "flag_assigned_elsewhere",
    "scaler_created_late",
    "step_before_initialize",
    "step_without_scale_loss",
    "backward_outside_scale_loss",
    "clipping_not_through_amp",
    "grad_used_by_hand",
    "master_params_twice",
    "master_params_without_step",
    "master_params_helper_unproven",
]

#: Rows whose file cannot be refused for them alone: a step that cannot mean the initialized optimizer sits in a
#: function that scales no loss (a scale_loss there could not reach the GradScaler either).
ALSO = {"step_unreachable": {"step_without_scale_loss"}}


def _row(name: str) -> Refusal:
    found = [row for row in REFUSALS if row.name == name]
    assert len(found) == 1, f"the table has {len(found)} rows named {name!r}"
    return found[0]


def _refusals(source: str) -> list[str]:
    analysis = Analysis(MetadataWrapper(cst.parse_module(source)), "amp")
    return [found.refusal.name for found in run(analysis, REFUSALS)]


def test_the_table_holds_every_refusal_once() -> None:
    assert [row.name for row in REFUSALS] == ROWS


def test_the_loop_the_examples_change_migrates() -> None:
    result = migrate_source(_examples.LOOP, "torch")
    assert not result.refused and not result.needs_human
    assert "scaler.scale(loss).backward()" in result.migrated and "apex" not in result.migrated


@pytest.mark.parametrize("name", ROWS)
def test_each_row_refuses_its_example_for_its_reason(name: str) -> None:
    row = _row(name)
    assert sorted(set(_refusals(row.example))) == sorted({name} | ALSO.get(name, set()))
    result = migrate_source(row.example, "torch")
    assert result.refused and not result.changed
    messages = [site.message for site in result.needs_human]
    static = row.reason.split("{")[0]  # the reason's text up to its first filled-in value
    assert any(message.startswith(static) for message in messages), messages
    assert len(messages) == 1 + len(ALSO.get(name, ()))


def test_a_reason_is_reported_where_its_node_is() -> None:
    """The site's line is the refused statement's line in the original file, not the file's first line."""
    result = migrate_source(_examples.DELAY_UNSCALE, "torch")
    line = next(i for i, text in enumerate(_examples.DELAY_UNSCALE.splitlines(), 1) if "delay_unscale" in text)
    assert [site.line for site in result.needs_human] == [line]


def test_rows_of_one_chain_report_the_first_that_applies() -> None:
    """``optimizer.step(closure); x = 1`` has a closure and shares its line: one reason, the first row's."""
    source = _examples.edit(_examples.STEP, "        optimizer.step(closure); ready = True\n")
    assert _refusals(source) == ["step_with_closure"]


def test_an_alone_row_stays_silent_beside_another_reason() -> None:
    """The clipping with no step after it in its block is refused only in a file no other row refuses."""
    source = _examples.edit(_examples.STEP, "        optimizer.step(closure)\n", _examples.MASTER_PARAMS_WITHOUT_STEP)
    assert _refusals(source) == ["step_with_closure"]


def _messages(source: str) -> list[str]:
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    return [site.message for site in result.needs_human]


def test_another_apex_name_under_if_is_refused_for_itself_not_as_a_guarded_amp_import() -> None:
    """FastSpeech's shape, ``if profiling: from apex import pyprof``, with a pyprof use that has no native
    equivalent (its ``nvtx.init()`` alone is removed: tests/test_migrate_pyprof.py): what stops the file is that
    use, not the import under ``if``."""
    use = "pyprof.nvtx.wrap(torch, 'matmul')"
    source = _examples.LOOP + f"\n\nif profiling:\n    from apex import pyprof\n\n    {use}\n"
    messages = _messages(source)
    assert [m.split(":")[0] for m in messages] == [
        f"apex.pyprof ({use}) has no native torch equivalent (nor an ampinit one)"
    ]


def _importing(line: str, use: str = "", source: str = _examples.LOOP) -> str:
    """``source`` with ``line`` added to its imports and ``use`` appended."""
    return _examples.edit("from apex import amp\n", f"from apex import amp\n{line}\n", source) + use


@pytest.mark.parametrize(
    ("source", "reason", "named"),
    [
        (
            "import torch\nimport apex\n\nmodel = torch.nn.Linear(2, 2)\n"
            "model = apex.amp.initialize(model, opt_level='O1')\n",
            "apex.amp is used through `import apex`: use --to ampinit",
            "apex.amp.",
        ),
        (
            _importing("from apex import amp as apex_amp", "\napex_amp.init()\n"),
            "apex.amp is imported under several names: use --to ampinit",
            "import amp as apex_amp",
        ),
        (
            _importing("from apex.optimizers import FusedLAMB", "\nlamb = FusedLAMB(model.parameters())\n"),
            "apex.optimizers.FusedLAMB has no native torch equivalent: torch.optim has no LAMB; use --to ampinit "
            "(or replace it by hand)",
            "FusedLAMB(",
        ),
        (
            _importing("from apex.fp16_utils import FP16_Optimizer", "\nwrapped = FP16_Optimizer(optimizer)\n"),
            "apex.fp16_utils.FP16_Optimizer has no native torch equivalent: use --to ampinit (or replace it by hand)",
            "FP16_Optimizer(",
        ),
        (
            _importing("from apex.contrib.group_norm import GroupNorm", "\nnorm = GroupNorm(2, 4)\n"),
            "apex.contrib.group_norm.GroupNorm has no native torch equivalent (nor an ampinit one)",
            "GroupNorm(",
        ),
    ],
    ids=["import-apex", "several-names", "fused-lamb", "fp16-optimizer", "contrib"],
)
def test_a_file_is_refused_for_the_apex_name_it_uses(source: str, reason: str, named: str) -> None:
    """The reasons outside the table (an Apex name --to torch has no counterpart for, or amp reached in a way the
    rewrite does not read): exactly that reason, and what it names is in the file."""
    assert _messages(source) == [reason]
    assert named in source


def test_an_opt_level_parameter_is_named_as_one() -> None:
    """ignite's ``def main(..., opt="O1")``: not "not assigned once in this function", but a parameter."""
    source = _examples.edit(
        "def train(batches):\n",
        "def train(batches, level):\n    global model, optimizer\n"
        "    model, optimizer = amp.initialize(model, optimizer, opt_level=level)\n",
        _examples.edit(_examples.INIT, ""),
    )
    reason = "opt_level is not a literal: the native equivalent exists only for O0 and O1 (`level` is a parameter "
    assert _messages(source) == [reason + "of train(): its callers may pass any level)"]


def test_scale_loss_is_not_said_to_get_another_optimizer_when_initialize_could_not_be_read() -> None:
    """With ``amp.initialize([a, b], ...)`` the initialized optimizer is unknown: the one reason is that call."""
    source = _examples.INITIALIZE_LISTS + "\n\ndef check(loss):\n    with amp.scale_loss(loss, optimizer) as s:\n"
    source += "        s.backward()\n"
    assert _messages(source) == ["amp.initialize needs exactly one model and one optimizer (no lists) for --to torch"]


def test_with_statements_are_not_branches_of_the_path_to_the_step() -> None:
    """A scale_loss block and the step in two ``with`` bodies (FastSpeech's ``with Nvtx("backward"):``) run on
    one path: the step is not "on a path without amp.scale_loss"."""
    source = _examples.edit(
        _examples.BLOCK + _examples.STEP,
        "        with timer('backward'):\n"
        + _examples.BLOCK.replace("\n        ", "\n            ").replace("        with amp", "            with amp")
        + "        with timer('step'):\n            optimizer.step()\n",
    )
    result = migrate_source(source, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert "            scaler.step(optimizer)\n            scaler.update()\n" in result.migrated


# -- whole files the rows stand for: refused, or trained as the original -----------------------------------------------
# Each file below is refused today, by these rows in this order: initialize_not_alone, scale_loss_one_line (with
# backward_outside_scale_loss and step_without_scale_loss, which follow from it), master_params_not_alone,
# step_not_alone (twice), step_in_scale_loss, clipping_not_through_amp, grad_used_by_hand, master_params_twice,
# master_params_without_step. test_each_row_refuses_its_example_for_its_reason checks each row on its own example,
# so these overlap it; they keep the file each defect was found in, run end to end, and hold as well for a rewrite
# that made the file equivalent instead of refusing it.

HEAD = """
import pytest
import torch
from apex import amp

def train(model, optimizer, data):
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
"""


def test_initialize_followed_by_a_semicolon() -> None:
    """`model, optimizer = amp.initialize(...); print(...)`: the line was left as it was while the Apex import was
    removed, and nothing created `scaler`/`amp_device`: the output raised NameError.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0); print("amp on")
            for x, y in data:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            return model
        """
    )


def test_one_line_scale_loss_block_keeps_its_backward() -> None:
    """`with amp.scale_loss(loss, opt) as s: s.backward()` on one line (a SimpleStatementSuite body): the rewrite
    dropped the body and wrote `scaled_loss = scaler.scale(loss)` alone, so no backward ran at all.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()
        optimizer.step()
    return model
"""
    )


def test_master_params_clipping_in_one_line_if_is_unscaled_first() -> None:
    """`if clip: clip_grad_norm_(amp.master_params(optimizer), 0.5)`: master_params became model.parameters() but
    no `scaler.unscale_(optimizer)` was inserted (it is only added before a SimpleStatementLine), so the scaled
    gradients were clipped to 0.5 and the step that followed was ~65536 times too small.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if True: torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
        optimizer.step()
    return model
"""
    )


def test_step_in_one_line_if_goes_through_the_scaler() -> None:
    """`if i % 2 == 0: optimizer.step()` (gradient accumulation on one line) was reported as rewritten but kept as
    `optimizer.step()`: the optimizer stepped on gradients scaled by 65536 and the GradScaler never updated.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if i % 2 == 1: optimizer.step()
    return model
"""
    )


def test_step_followed_by_a_semicolon_goes_through_the_scaler() -> None:
    """`optimizer.step(); optimizer.zero_grad()`: a line with two statements was left as it was (reported as
    rewritten), so the optimizer stepped on scaled gradients and the GradScaler was never stepped.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step(); optimizer.zero_grad()
    return model
"""
    )


def test_step_inside_the_scale_loss_block() -> None:
    """`optimizer.step()` inside `with amp.scale_loss(...)`: Apex unscales (and checks for overflow) when the block
    exits, so that step ran on the scaled gradients (a bug of the original, but its behaviour); the rewrite's
    `scaler.step()` unscales first, so the migrated run trains differently. It must be refused.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()
    return model
"""
    )


def test_clipping_model_parameters_after_scale_loss() -> None:
    """Under O1, Apex unscales the model's gradients when the scale_loss block exits, so
    `clip_grad_norm_(model.parameters(), 0.5)` after it clips true gradients (the common spelling under O1, where
    the model's parameters are the master parameters). After the rewrite the gradients are still scaled there:
    clipped to 0.5 at scale 65536, then unscaled by scaler.step, the update was ~65536 times too small.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return model
"""
    )


def test_gradients_changed_by_hand_between_scale_loss_and_step() -> None:
    """`p.grad.data.clamp_(-0.01, 0.01)` between the scale_loss block and the step (RL code's hand-rolled
    clipping): Apex had unscaled the gradients when the block exited; after the rewrite they are still scaled
    there, so the clamp cut gradients 65536 times too large and the update was ~65536 times too small.

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        for p in model.parameters():
            p.grad.data.clamp_(-0.01, 0.01)
        optimizer.step()
    return model
"""
    )


def test_master_params_clipped_twice_before_one_step() -> None:
    """Two clippings of `amp.master_params(optimizer)` before one step (a norm measured, then a clip): each got a
    `scaler.unscale_(optimizer)` in front, and GradScaler raises on the second ("unscale_() has already been
    called on this optimizer since the last update()").

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        total = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), float("inf"))
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
        optimizer.step()
    return model
"""
    )


def test_master_params_clipped_on_iterations_that_do_not_step() -> None:
    """Gradient accumulation that clips on every micro-batch and steps every second one: the rewrite's
    `scaler.unscale_(optimizer)` runs twice before the `scaler.update()` of the stepping iteration, and GradScaler
    raises on the second. (Unscaled accumulated gradients would also get the next micro-batch's scaled ones added.)

    Found by: the review of ``ampinit migrate --to torch`` (files it wrote that broke, or trained otherwise).
    """
    _same_or_refused(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
            for i, (x, y) in enumerate(data):
                loss = torch.nn.functional.mse_loss(model(x), y) / 2
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
                if i % 2 == 1:
                    optimizer.step()
                    optimizer.zero_grad()
            return model
        """
    )
