"""Every reason ``--to torch`` leaves a file to ``--to ampinit``, as a table: one :class:`Refusal` a row, run in
one loop (:func:`run`) over the facts of :class:`~._analysis.Analysis`.

A row names the nodes it applies to, a test over one of them (which says where to report it and the values its
reason text is filled with), the reason text, and a file that exactly this row refuses (``example``; the tests run
every row's example). Rows of one ``chain`` are alternatives for a node, in order: the first that applies is
reported (a call that is not there cannot also have the wrong arguments). The order of the rows is the order of
the reasons on one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from ampinit.migrate import _cst
from ampinit.migrate._report import Site
from ampinit.migrate._to_torch import _examples as ex
from ampinit.migrate._to_torch._analysis import (
    Analysis,
    literal,
)
from ampinit.migrate._to_torch._predicates import (
    Nodes,
    Test,
    all_backwards,
    all_calls,
    all_steps,
    amp_imports,
    args_unknown,
    bare_uses,
    clipping,
    file,
    flag_assigned_elsewhere,
    flag_differs,
    flag_reassigned,
    grads_by_hand,
    guarded_import,
    helper_unproven,
    hit,
    initialize,
    level_half,
    level_unknown,
    load_arguments,
    loss_scale_call,
    master_params_of_other,
    master_params_twice,
    master_params_without_step,
    no_step,
    not_called,
    not_rewritten,
    not_unpacked,
    on_some_paths,
    optimizers_given,
    option,
    other_clipping,
    other_optimizer,
    other_uses,
    readable_initialize,
    readable_scale_loss,
    reassigned,
    runs_late,
    scale_loss_argument,
    scale_loss_not_in_with,
    scale_loss_one_line,
    scale_loss_unreadable,
    scale_loss_without_as,
    scale_read_early,
    slots,
    static_scale,
    step_before_initialize,
    step_without_scale_loss,
    unreachable_step,
    unreachable_use,
    unscaled_backward,
    uses_of,
    when,
    when_shared,
)

NO_NATIVE = {
    "cast_model_type": "cast_model_type casts the model's weights (O2/O3): torch.amp has no half model",
    "patch_torch_functions": "patch_torch_functions is O1's switch: keep the default",
    "keep_batchnorm_fp32": "keep_batchnorm_fp32 describes a cast model (O2/O3): no native equivalent",
    "master_weights": "fp32 master weights (O2) have no native equivalent",
    "cast_model_outputs": "cast_model_outputs has no native equivalent: cast the outputs by hand",
    "min_loss_scale": "GradScaler has no loss-scale floor",
    "max_loss_scale": "GradScaler has no loss-scale ceiling",
}
NOT_ALONE = (
    "shares its line with other statements, or is the one-line body of an `if`/`for`/`with` "
    "(`if cond: optimizer.step()`), which the rewrite does not handle"
)


@dataclass(frozen=True)
class Refusal:
    """One reason to refuse: ``reason`` (a ``str.format`` text over the hit's fields) is reported at every node of
    ``applies_to`` that ``test`` hits. ``alone``: tested only in a file no earlier row refused (the row
    over-refuses where another reason already stands)."""

    name: str
    applies_to: Nodes
    test: Test
    reason: str
    example: str
    chain: str = ""
    alone: bool = False
    needs_initialize: bool = True  # tested only in a file with exactly one amp.initialize


@dataclass(frozen=True)
class Found:
    refusal: Refusal
    site: Site


def run(analysis: Analysis, table: Iterable[Refusal]) -> list[Found]:
    """Every row of ``table`` over ``analysis``, in order; sorted by line (stable: one line keeps the rows' order)."""
    found: list[Found] = []
    chains: set[tuple[str, int]] = set()
    for row in table:
        if (row.needs_initialize and analysis.init is None) or (row.alone and found):
            continue
        for node in row.applies_to(analysis):
            if row.chain and (row.chain, id(node)) in chains:
                continue
            result = row.test(analysis, node)
            if result is None:
                continue
            if row.chain:
                chains.add((row.chain, id(node)))
            analysis.refused.setdefault(id(node), set()).add(row.name)
            at = node if result.at is None else result.at
            found.append(Found(row, Site(analysis.line(at), row.reason.format(**result.fields), needs_human=True)))
    return sorted(found, key=lambda f: f.site.line)


REFUSALS: tuple[Refusal, ...] = (
    # -- one amp.initialize ------------------------------------------------------------------------------------------
    Refusal(
        "initialize_twice",
        lambda a: a.inits[1:2],
        when(lambda a, n: True),
        "amp.initialize is called more than once: one GradScaler per call is a human's call",
        ex.INITIALIZE_TWICE,
        needs_initialize=False,
    ),
    Refusal(
        "no_initialize",
        file,
        when(lambda a, n: not a.inits),
        "no amp.initialize call found",
        ex.NO_INITIALIZE,
        needs_initialize=False,
    ),
    # -- its arguments -----------------------------------------------------------------------------------------------
    Refusal(
        "initialize_not_called",
        initialize,
        when(lambda a, n: a.init_call is None),
        "amp.initialize is used without being called",
        ex.INITIALIZE_NOT_CALLED,
    ),
    Refusal(
        "initialize_star_args",
        initialize,
        lambda a, n: hit(a.init_call) if a.init_call is not None and args_unknown(a) else None,
        "amp.initialize(*args/**kwargs): the options cannot be read statically",
        ex.INITIALIZE_STAR_ARGS,
    ),
    Refusal(
        "initialize_not_one_model",
        initialize,
        lambda a, n: (
            hit(a.init_call)
            if a.init_call is not None and a.init_args is None and not args_unknown(a) and optimizers_given(a)
            else None
        ),
        "amp.initialize needs exactly one model and one optimizer (no lists) for --to torch",
        ex.INITIALIZE_LISTS,
    ),
    Refusal(
        "initialize_without_optimizer",
        initialize,
        lambda a, n: hit(a.init_call) if a.init_call is not None and not optimizers_given(a) else None,
        "amp.initialize without an optimizer prepares a model for inference only: there is no loop for a "
        "GradScaler; put its forward passes under torch.autocast by hand, or use --to ampinit",
        ex.INITIALIZE_WITHOUT_OPTIMIZER,
    ),
    Refusal(
        "opt_level_half",
        readable_initialize,
        level_half,
        "opt_level={level} keeps a half-precision model (and fp32 master weights for O2): no native equivalent",
        ex.OPT_LEVEL_HALF,
    ),
    Refusal(
        "opt_level_unknown",
        readable_initialize,
        level_unknown,
        "opt_level is not a literal: the native equivalent exists only for O0 and O1{why}",
        ex.OPT_LEVEL_UNKNOWN,
    ),
    *(
        Refusal(f"initialize_{name}", readable_initialize, option(name), reason, ex.initialize_with(name))
        for name, reason in NO_NATIVE.items()
    ),
    Refusal(
        "num_losses",
        readable_initialize,
        when(lambda a, n: literal((a.init_args or {}).get("num_losses")) not in (None, 1)),
        "num_losses > 1: GradScaler has one scale for all losses, not one per loss",
        ex.NUM_LOSSES,
    ),
    Refusal(
        "static_loss_scale",
        readable_initialize,
        when(static_scale),
        "a static loss_scale: GradScaler only scales dynamically (and skips steps on inf)",
        ex.STATIC_LOSS_SCALE,
    ),
    Refusal(
        "initialize_in_expression",
        readable_initialize,
        when(lambda a, n: not isinstance(a.parent(n), (cst.Assign, cst.Expr))),
        "amp.initialize inside an expression: rewrite it by hand",
        ex.INITIALIZE_IN_EXPRESSION,
    ),
    Refusal(
        "initialize_not_alone",
        readable_initialize,
        when(lambda a, n: isinstance(a.parent(n), (cst.Assign, cst.Expr)) and not a.alone_on_its_line(n)),
        f"amp.initialize {NOT_ALONE}: put it on a line of its own",
        ex.INITIALIZE_NOT_ALONE,
    ),
    Refusal(
        "initialize_not_unpacked",
        readable_initialize,
        when(not_unpacked),
        "amp.initialize's result is not unpacked into (model, optimizer)",
        ex.INITIALIZE_NOT_UNPACKED,
    ),
    # -- the `if <flag>:` around it ----------------------------------------------------------------------------------
    Refusal(
        "initialize_on_some_paths",
        initialize,
        on_some_paths,
        "amp.initialize runs only on some paths (it sits under `{guard}`, not directly under a plain "
        "`if <flag>:`): on the others the rewritten scaler.step()/scaler.scale() would have no GradScaler; "
        "create the GradScaler unconditionally with enabled=<the condition> by hand, or use --to ampinit",
        ex.INITIALIZE_ON_SOME_PATHS,
    ),
    Refusal(
        "flag_assigned_again",
        initialize,
        flag_reassigned,
        "the flag `{flag}` that guards amp.initialize is assigned again later ({changed}): the GradScaler's "
        "enabled= could not follow it; rewrite by hand, or use --to ampinit",
        ex.FLAG_ASSIGNED_AGAIN,
    ),
    Refusal(
        "apex_import_guarded",
        amp_imports,
        guarded_import,
        "the Apex import sits under `{guard}` (an availability guard or a switch): after the rewrite the "
        "import could not fail or be skipped any more, so the code's other path would change; rewrite the "
        "guard by hand, or use --to ampinit",
        ex.APEX_IMPORT_GUARDED,
    ),
    # -- each amp use ------------------------------------------------------------------------------------------------
    Refusal(
        "amp_use_unreachable",
        other_uses,
        unreachable_use,
        "amp.{name}: {why}",
        ex.AMP_USE_UNREACHABLE,
    ),
    Refusal(
        "amp_as_object",
        bare_uses,
        lambda a, n: hit(a.statement_of(n), code=_cst.code(a.statement_of(n)).strip().splitlines()[0]),
        "the amp module is used as an object (`{code}`), not through its functions: after the rewrite the name "
        "would be unbound, and no native object stands in for it; rewrite it by hand, or use --to ampinit",
        ex.AMP_AS_OBJECT,
    ),
    Refusal(
        "amp_use_not_native",
        other_uses,
        not_rewritten,
        "amp.{name} has no native torch.amp equivalent",
        ex.AMP_USE_NOT_NATIVE,
    ),
    Refusal(
        "scale_loss_not_in_with",
        uses_of("scale_loss"),
        when(scale_loss_not_in_with),
        "amp.scale_loss outside a single-item `with` statement",
        ex.SCALE_LOSS_NOT_IN_WITH,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_without_as",
        uses_of("scale_loss"),
        scale_loss_without_as,
        "`with amp.scale_loss(...)` without `as name`",
        ex.SCALE_LOSS_WITHOUT_AS,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_one_line",
        uses_of("scale_loss"),
        scale_loss_one_line,
        "`with amp.scale_loss(...) as s: s.backward()` on one line: put the body on its own line",
        ex.SCALE_LOSS_ONE_LINE,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_star_args",
        uses_of("scale_loss"),
        scale_loss_unreadable,
        "amp.scale_loss(*args/**kwargs): the arguments cannot be read statically",
        ex.SCALE_LOSS_STAR_ARGS,
        chain="scale_loss",
    ),
    Refusal(
        "scale_loss_other_optimizer",
        readable_scale_loss,
        other_optimizer,
        "amp.scale_loss is given another optimizer than the initialized one ({optimizer})",
        ex.SCALE_LOSS_OTHER_OPTIMIZER,
    ),
    Refusal(
        "loss_id",
        readable_scale_loss,
        scale_loss_argument("loss_id", (None, 0)),
        "loss_id selects one of several loss scalers: GradScaler has one scale",
        ex.LOSS_ID,
    ),
    Refusal(
        "delay_unscale",
        readable_scale_loss,
        scale_loss_argument("delay_unscale", (None, False)),
        "delay_unscale=True: with GradScaler, accumulate with scaler.scale(loss).backward() and call "
        "scaler.step()/update() only on stepping iterations",
        ex.DELAY_UNSCALE,
    ),
    Refusal(
        "delay_overflow_check",
        readable_scale_loss,
        scale_loss_argument("delay_overflow_check", (None, False)),
        "delay_overflow_check has no native equivalent",
        ex.DELAY_OVERFLOW_CHECK,
    ),
    Refusal(
        "master_params_outside_clipping",
        uses_of("master_params"),
        when(lambda a, n: clipping(a, n) is None),
        "amp.master_params outside gradient clipping: unscale with scaler.unscale_() first",
        ex.MASTER_PARAMS_OUTSIDE_CLIPPING,
        chain="master_params",
    ),
    Refusal(
        "master_params_other_optimizer",
        uses_of("master_params"),
        when(master_params_of_other),
        "amp.master_params of another optimizer than the initialized one",
        ex.MASTER_PARAMS_OTHER_OPTIMIZER,
        chain="master_params",
    ),
    Refusal(
        "master_params_not_alone",
        uses_of("master_params"),
        when(lambda a, n: not a.alone_on_its_line(n)),
        f"clipping amp.master_params {NOT_ALONE}: scaler.unscale_() could not go before it",
        ex.MASTER_PARAMS_NOT_ALONE,
        chain="master_params",
    ),
    Refusal(
        "master_params_in_scale_loss",
        uses_of("master_params"),
        when(lambda a, n: a.in_scale_loss_block(n)),
        "amp.master_params clipped inside the scale_loss block: Apex clips the still-scaled gradients there, "
        "after scaler.unscale_() they would be unscaled; move the clipping after the block by hand",
        ex.MASTER_PARAMS_IN_SCALE_LOSS,
        chain="master_params",
    ),
    Refusal(
        "amp_call_not_called",
        uses_of("state_dict", "load_state_dict", "disable_casts"),
        not_called,
        "amp.{name} used without being called",
        ex.AMP_CALL_NOT_CALLED,
    ),
    Refusal(
        "load_state_dict_arguments",
        uses_of("load_state_dict"),
        load_arguments,
        "amp.load_state_dict with other arguments than one state: rewrite it by hand",
        ex.LOAD_STATE_DICT_ARGUMENTS,
    ),
    Refusal(
        "amp_state_internals",
        uses_of("_amp_state"),
        when(lambda a, n: loss_scale_call(a, n) is None),
        "amp._amp_state has no native torch.amp equivalent (only amp._amp_state.loss_scalers[0].loss_scale() "
        "has: scaler.get_scale())",
        ex.AMP_STATE_INTERNALS,
    ),
    Refusal(
        "loss_scale_read_before_step",
        uses_of("_amp_state"),
        scale_read_early,
        "amp._amp_state.loss_scalers[0].loss_scale() read between the scale_loss block and optimizer.step(): "
        "Apex has updated the scale there, GradScaler updates it after the step; read scaler.get_scale() "
        "after scaler.update() by hand, or use --to ampinit",
        ex.LOSS_SCALE_READ_BEFORE_STEP,
    ),
    # -- the optimizer's steps ---------------------------------------------------------------------------------------
    Refusal(
        "no_step",
        file,
        no_step,
        "no {optimizer}.step() found to route through scaler.step()",
        ex.NO_STEP,
    ),
    Refusal(
        "step_with_closure",
        all_steps,
        when(lambda a, n: bool(n.args)),  # type: ignore[attr-defined]
        "optimizer.step(closure): GradScaler.step with a closure is not supported",
        ex.STEP_WITH_CLOSURE,
        chain="step",
    ),
    Refusal(
        "step_in_expression",
        all_steps,
        when(lambda a, n: not isinstance(a.parent(n), (cst.Expr, cst.Assign))),
        "optimizer.step() inside an expression: rewrite to scaler.step(...) by hand",
        ex.STEP_IN_EXPRESSION,
        chain="step",
    ),
    Refusal(
        "step_not_alone",
        all_steps,
        when(lambda a, n: not a.alone_on_its_line(n)),
        f"optimizer.step() {NOT_ALONE}: rewrite to scaler.step(...) by hand",
        ex.STEP_NOT_ALONE,
        chain="step",
    ),
    Refusal(
        "step_in_scale_loss",
        all_steps,
        when(lambda a, n: a.in_scale_loss_block(n)),
        "optimizer.step() inside the scale_loss block: Apex unscales when the block exits, so this step ran "
        "on the scaled gradients; scaler.step() would unscale them first; move the step after the block "
        "by hand (that changes the training), or use --to ampinit",
        ex.STEP_IN_SCALE_LOSS,
        chain="step",
    ),
    Refusal(
        "step_unreachable",
        all_steps,
        unreachable_step,
        "optimizer.step(): {why}",
        ex.STEP_UNREACHABLE,
        chain="step",
    ),
    # -- amp used in other functions than amp.initialize's -----------------------------------------------------------
    Refusal(
        "scaler_attribute_slots",
        when_shared,
        slots,
        "{owner} defines __slots__: the GradScaler cannot be kept as an attribute of its instances",
        ex.SCALER_ATTRIBUTE_SLOTS,
    ),
    Refusal(
        "optimizer_assigned_again",
        when_shared,
        reassigned,
        "{why}",
        ex.OPTIMIZER_ASSIGNED_AGAIN,
    ),
    Refusal(
        "flag_differs_elsewhere",
        when_shared,
        flag_differs,
        "`{base}` in {function}() is not the `{base}` of amp.initialize's `if {flag}:` in {home} (a parameter "
        "or a local there): the flag could differ",
        ex.FLAG_DIFFERS_ELSEWHERE,
        chain="flag",
    ),
    Refusal(
        "flag_assigned_elsewhere",
        when_shared,
        flag_assigned_elsewhere,
        "the flag `{flag}` that guards amp.initialize is assigned in another function ({code}): the "
        "GradScaler's enabled= could not follow it; rewrite by hand, or use --to ampinit",
        ex.FLAG_ASSIGNED_ELSEWHERE,
        chain="flag",
    ),
    Refusal(
        "scaler_created_late",
        when_shared,
        runs_late,
        "{why}",
        ex.SCALER_CREATED_LATE,
    ),
    # -- every path through a function that steps --------------------------------------------------------------------
    Refusal(
        "step_before_initialize",
        all_steps,
        when(step_before_initialize),
        "optimizer.step() comes before amp.initialize: it would run without a GradScaler",
        ex.STEP_BEFORE_INITIALIZE,
        chain="path",
    ),
    Refusal(
        "step_without_scale_loss",
        all_steps,
        when(step_without_scale_loss),
        "optimizer.step() can run on a path without amp.scale_loss before it (scale_loss is conditional, "
        "or missing): GradScaler.step needs a scaled backward on every path",
        ex.STEP_WITHOUT_SCALE_LOSS,
        chain="path",
    ),
    Refusal(
        "backward_outside_scale_loss",
        all_backwards,
        when(unscaled_backward),
        "a backward() outside amp.scale_loss in a function that steps the optimizer: on that path "
        "scaler.step() would see no scaled gradients",
        ex.BACKWARD_OUTSIDE_SCALE_LOSS,
    ),
    # -- gradients between the scale_loss block and the step --------------------------------------------------------
    Refusal(
        "clipping_not_through_amp",
        all_calls,
        other_clipping,
        "{name}() of gradients not taken through amp.master_params: Apex unscaled them when the scale_loss "
        "block exited, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) "
        "before the clipping by hand, or use --to ampinit",
        ex.CLIPPING_NOT_THROUGH_AMP,
    ),
    Refusal(
        "grad_used_by_hand",
        file,
        grads_by_hand,
        "`.grad` used between the scale_loss block and optimizer.step(): Apex had unscaled the gradients "
        "there, GradScaler keeps them scaled until scaler.step(); add scaler.unscale_(optimizer) before it "
        "by hand, or use --to ampinit",
        ex.GRAD_USED_BY_HAND,
    ),
    Refusal(
        "master_params_twice",
        file,
        master_params_twice,
        "amp.master_params clipped twice in one function: each would get a scaler.unscale_(optimizer), "
        "and GradScaler raises on the second before update(); keep one unscale_ by hand",
        ex.MASTER_PARAMS_TWICE,
    ),
    # Each clipping gets a scaler.unscale_(optimizer) before it, which must be followed by scaler.step()/update()
    # whenever it runs: a clipping on every micro-batch with a step every second one would unscale twice before
    # update(), which GradScaler refuses. It over-refuses a step in another branch of the same path, so it is
    # tested only where no other reason stands.
    Refusal(
        "master_params_without_step",
        file,
        master_params_without_step,
        "amp.master_params clipped where no optimizer.step() of the same block follows (gradient "
        "accumulation?): the scaler.unscale_(optimizer) put before it would run again before update(), "
        "which GradScaler refuses; clip only on stepping iterations, by hand",
        ex.MASTER_PARAMS_WITHOUT_STEP,
        alone=True,
    ),
    # A helper method that clips (a trainer's `clip_gradients()`) is the clipping of its callers: the same rule,
    # checked at each call; over-refusing in the same way, so tested alone too.
    Refusal(
        "master_params_helper_unproven",
        file,
        helper_unproven,
        "amp.master_params clipped in {helper}(), whose scaler.unscale_(optimizer) must run once between each "
        "scaled backward and scaler.step(), but {why}: GradScaler refuses a second unscale_ before update(); "
        "rewrite by hand, or use --to ampinit",
        ex.MASTER_PARAMS_HELPER_UNPROVEN,
        alone=True,
    ),
)
