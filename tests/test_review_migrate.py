"""Review of ``ampinit migrate --to torch``: inputs for which the codemod wrote a file that is broken or does
something else than the original did under Apex (run here under ampinit's Apex aliases). Each case either is
refused or, run on the CPU, ends with the same weights as the original."""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import pytest
import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

DATA = """
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
RESULT = train(model, optimizer, data).weight.detach().clone()
"""


def _run(source: str, aliases: bool) -> torch.Tensor:
    """Execute ``source`` (as plain ``python`` would, or with ``from apex import amp`` resolving to ampinit's Apex
    aliases) and return its ``RESULT``."""
    with warnings.catch_warnings(), as_apex_code(aliases):
        warnings.simplefilter("ignore")
        namespace = exec_source(source, "<original>" if aliases else "<migrated>")
    result = namespace["RESULT"]
    assert isinstance(result, torch.Tensor)
    return result


def _same_or_refused(body: str, data: str = DATA) -> None:
    source = textwrap.dedent(body) + data
    result = migrate_source(source, "torch")
    if result.refused:
        assert any(site.needs_human for site in result.sites)
        return
    assert result.changed
    compile(result.migrated, "<migrated>", "exec")
    want = _run(source, aliases=True)
    got = _run(result.migrated, aliases=False)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-3), (result.migrated, got, want)
    again = migrate_source(result.migrated, "torch")
    assert not again.changed, again.migrated


def test_harness_accepts_a_plain_o1_loop() -> None:
    """Control: the shape the codemod is built for migrates, and matches the original."""
    _same_or_refused(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
            for x, y in data:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            return model
        """
    )


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


def test_one_line_scale_loss_block_keeps_its_backward() -> None:
    """`with amp.scale_loss(loss, opt) as s: s.backward()` on one line (a SimpleStatementSuite body): the rewrite
    dropped the body and wrote `scaled_loss = scaler.scale(loss)` alone, so no backward ran at all."""
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()
        optimizer.step()
    return model
"""
    )


def test_step_in_one_line_if_goes_through_the_scaler() -> None:
    """`if i % 2 == 0: optimizer.step()` (gradient accumulation on one line) was reported as rewritten but kept as
    `optimizer.step()`: the optimizer stepped on gradients scaled by 65536 and the GradScaler never updated."""
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
    rewritten), so the optimizer stepped on scaled gradients and the GradScaler was never stepped."""
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step(); optimizer.zero_grad()
    return model
"""
    )


def test_master_params_clipping_in_one_line_if_is_unscaled_first() -> None:
    """`if clip: clip_grad_norm_(amp.master_params(optimizer), 0.5)`: master_params became model.parameters() but
    no `scaler.unscale_(optimizer)` was inserted (it is only added before a SimpleStatementLine), so the scaled
    gradients were clipped to 0.5 and the step that followed was ~65536 times too small."""
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


def test_clipping_model_parameters_after_scale_loss() -> None:
    """Under O1, Apex unscales the model's gradients when the scale_loss block exits, so
    `clip_grad_norm_(model.parameters(), 0.5)` after it clips true gradients (the common spelling under O1, where
    the model's parameters are the master parameters). After the rewrite the gradients are still scaled there:
    clipped to 0.5 at scale 65536, then unscaled by scaler.step, the update was ~65536 times too small."""
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


def test_initialize_followed_by_a_semicolon() -> None:
    """`model, optimizer = amp.initialize(...); print(...)`: the line was left as it was while the Apex import was
    removed, and nothing created `scaler`/`amp_device`: the output raised NameError."""
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


def test_amp_imported_under_a_short_alias() -> None:
    """`from apex import amp as A`: the autocast region walked back over `A.initialize(...)` (its stop test looked
    for the text "amp."), so the GradScaler and `amp_device` were created inside
    `with torch.autocast(amp_device, ...)`: UnboundLocalError."""
    _same_or_refused(
        """
        import torch
        from apex import amp as A

        def train(model, optimizer, data):
            model, optimizer = A.initialize(model, optimizer, opt_level="O1", verbosity=0)
            x, y = data[0]
            loss = torch.nn.functional.mse_loss(model(x), y)
            with A.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            return model
        """
    )


def _autocast_bodies(source: str) -> list[str]:
    """The source of each ``with torch.autocast(...)`` body in ``source``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.With) and any("autocast" in ast.unparse(i.context_expr) for i in node.items):
            out.append("\n".join(ast.unparse(s) for s in node.body))
    return out


def test_two_scale_loss_blocks_of_one_optimizer_share_one_autocast() -> None:
    """Two losses computed first, then one scale_loss block each (same optimizer, loss_id 0): the two forward
    ranges overlapped ((out, loss1) and (out, loss1, loss2)), and wrapping one after the other nested a second
    autocast and pulled the first `scaler.scale(loss1).backward()` under autocast (torch: backward passes under
    autocast are not recommended; Apex ran them outside any cast context)."""
    source = textwrap.dedent(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
            for x, y in data:
                optimizer.zero_grad()
                out = model(x)
                loss1 = torch.nn.functional.mse_loss(out, y)
                loss2 = out.abs().mean()
                with amp.scale_loss(loss1, optimizer) as scaled_loss:
                    scaled_loss.backward(retain_graph=True)
                with amp.scale_loss(loss2, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            return model
        """
    )
    result = migrate_source(source, "torch")
    if result.refused:
        return
    for body in _autocast_bodies(result.migrated):
        assert "backward" not in body and "autocast" not in body, result.migrated
    _same_or_refused(source)


def test_forward_in_a_branch_before_the_loss_is_autocast_or_flagged() -> None:
    """Under O1 Apex casts every op after initialize, the model's forward included. Here the forward sits in an
    `if`/`else` just before the loss line: the autocast range stopped at the `if` and covered only the loss, so
    the model ran in fp32 after the migration, reported as fully migrated (no note). Either the forward goes under
    autocast, or the site is reported with the autocast note."""
    source = textwrap.dedent(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data, distill=False):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
            for x, y in data:
                optimizer.zero_grad()
                if distill:
                    out = model(x) * 2
                else:
                    out = model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            return model
        """
    )
    result = migrate_source(source, "torch")
    if result.refused or any(site.needs_human and "autocast" in site.message for site in result.sites):
        return
    assert any("model(x)" in body for body in _autocast_bodies(result.migrated)), result.migrated


def test_master_params_of_an_optimizer_over_part_of_the_model() -> None:
    """`amp.master_params(optimizer)` is the optimizer's parameters (under O1, its param_groups' tensors), not the
    model's: with an optimizer over the head only (a frozen-in-practice backbone that still gets gradients), the
    rewrite to `model.parameters()` clipped the norm over every parameter, so the head's gradients were scaled
    down by the backbone's norm as well."""
    _same_or_refused(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
            for x, y in data:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.1)
                optimizer.step()
            return model[1]

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
        data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(20)]
        RESULT = train(model, optimizer, data).weight.detach().clone()
        """,
        data="",
    )


@pytest.mark.parametrize("to", ["ampinit", "torch"])
def test_apex_ddp_positional_delay_allreduce_is_mapped(to: str) -> None:
    """Apex's DDP signature is (module, message_size, delay_allreduce, ...): `DDP(model, 10000000, True)` passes
    delay_allreduce=True, which the keyword form maps to find_unused_parameters=True. Positionally it was dropped
    as "an Apex-only option", so torch's DDP failed on the second iteration for a model with unused parameters."""
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
    Apex-only option)", which names neither what was dropped nor why (its options cannot be read)."""
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


def test_comments_on_rewritten_lines_are_kept() -> None:
    """The docs promise comments are kept. The comment above an `amp.initialize` removed from its `if fp16:`, the
    trailing comment of `amp.initialize` and of the `with amp.scale_loss(...)` header, and a comment line inside
    the scale_loss block were deleted."""
    source = textwrap.dedent(
        """
        import torch
        from apex import amp

        def train(model, optimizer, data, fp16):
            if fp16:
                # mixed precision, see NVIDIA docs
                model, optimizer = amp.initialize(model, optimizer, opt_level="O1")  # O1 is the safe level
            for x, y in data:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                if fp16:
                    with amp.scale_loss(loss, optimizer) as scaled_loss:  # TODO(alice): drop apex
                        # NOTE: retain_graph not needed here
                        scaled_loss.backward()
                else:
                    loss.backward()
                optimizer.step()
        """
    )
    result = migrate_source(source, "torch")
    assert not result.refused, result.sites
    for comment in [
        "# mixed precision, see NVIDIA docs",
        "# O1 is the safe level",
        "# TODO(alice): drop apex",
        "# NOTE: retain_graph not needed here",
    ]:
        assert comment in result.migrated, (comment, result.migrated)
    assert not migrate_source(result.migrated, "torch").changed


@pytest.mark.parametrize("extra", ["", "from apex.optimizers import FusedAdam\n"])
def test_torch_imported_under_another_name(extra: str) -> None:
    """`import torch as th` (guided-diffusion's style): the rewrite took it for `import torch` and wrote
    `torch.amp.GradScaler(...)`/`torch.autocast(...)` (and `torch.optim.AdamW`) with no `torch` bound: NameError."""
    _same_or_refused(
        "import torch as th\n"
        + extra
        + """
from apex import amp

def train(model, optimizer, data):
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    for x, y in data:
        optimizer.zero_grad()
        loss = th.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model
""",
        data=DATA.replace("torch.", "th.")
        + ("opt = FusedAdam(th.nn.Linear(1, 1).parameters(), lr=1e-3)\n" if extra else ""),
    )


def test_step_inside_the_scale_loss_block() -> None:
    """`optimizer.step()` inside `with amp.scale_loss(...)`: Apex unscales (and checks for overflow) when the block
    exits, so that step ran on the scaled gradients (a bug of the original, but its behaviour); the rewrite's
    `scaler.step()` unscales first, so the migrated run trains differently. It must be refused."""
    _same_or_refused(
        HEAD
        + """
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()
    return model
"""
    )


def test_gradients_changed_by_hand_between_scale_loss_and_step() -> None:
    """`p.grad.data.clamp_(-0.01, 0.01)` between the scale_loss block and the step (RL code's hand-rolled
    clipping): Apex had unscaled the gradients when the block exited; after the rewrite they are still scaled
    there, so the clamp cut gradients 65536 times too large and the update was ~65536 times too small."""
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
    called on this optimizer since the last update()")."""
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
    raises on the second. (Unscaled accumulated gradients would also get the next micro-batch's scaled ones added.)"""
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


@pytest.mark.parametrize("where", ["if TYPE_CHECKING:\n    import torch\n", "def g():\n    import torch\n"])
def test_float_function_helper_needs_a_module_level_torch(where: str) -> None:
    """A helper module that imports torch only under `if TYPE_CHECKING:` or inside a function: the written
    `amp_float_function` decorator uses `torch` at module level, but `import torch` was not added (any `import torch`
    in the file counted): calling the decorated function raised NameError."""
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
