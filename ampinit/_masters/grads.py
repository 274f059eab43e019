"""How gradients reach an optimizer's parameters under amp: fp32 master weights and scaled-grad bookkeeping.

One :class:`OptimizerGrads` per optimizer. With master weights, every half-precision parameter in the
optimizer's param groups is replaced by an fp32 *master* copy; the model keeps the half tensor. A backward then
runs in three moves, each a constant number of multi-tensor kernels per (device, dtype) group:

1. ``prepare_backward`` (entering ``scale_loss``): half model grads are dropped (their values already live,
   unscaled, in the master grads) and grads of parameters the optimizer updates directly are stashed (in a
   multi-rank job kept in ``.grad`` at the block's scale instead, for DDP's all-reduce to carry them);
2. ``post_backward`` (leaving ``scale_loss``): new half grads go to fp32 master grads, times ``1/scale``,
   with an inf/NaN check into the scaler's device flag; stashed grads are added back;
3. ``after_step``: the updated masters are copied into the half model weights.

When the step will take amp's Triton kernels (``kernel_step``), move 2 only checks the half grads into the flag
and keeps ``1/scale`` (:class:`PendingGrads`): the kernels read the half grads themselves, so no fp32 master grad
is written and read back, and move 3 is part of the kernel. The fp32 master grads are made (with the bits move 2
would have given them) only when something asks for them: ``amp.master_params`` (clipping), a step the kernels do
not take (hooks, a wrapped step, an optimizer or layout they lack), another backward, ``zero_grad`` keeping grads,
or closing the session. Code that reads the masters' ``.grad`` through ``optimizer.param_groups`` instead sees
None until then.

Until the first backward (or step) the masters *follow the model* (``follow_model``), as Apex's masters, built
at that moment, did: a half weight written after ``initialize`` (DDP broadcasting rank 0's weights, a custom
init) becomes its master's value, so that every rank trains the weights DDP broadcast, whatever each rank's
seed. A master that the model's ``load_state_dict`` wrote since (an exact fp32 value) is kept while the weight
still holds its rounding: a checkpoint every rank loaded before the wrap resumes bitwise. Version counters tell
what was written, and so does a weight that no longer holds its master's rounding (a write through ``.data``, a
collective on the tensor itself, NumPy: none moves the counter), read once; from the first backward on the
masters are the truth.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from ampinit import _distributed, _torch_kernels
from ampinit._masters import clip, kernel_step
from ampinit._masters.update import Update, update_of
from ampinit._scaler import LossScaler
from ampinit._types import HALF_DTYPES

#: Device types on which a master's fp32 grad storage is kept between steps (see ``OptimizerGrads._grad_buffer``).
GRAD_BUFFERS_KEPT_ON = frozenset({"cpu"})


class PendingGrads(NamedTuple):
    """The master grads of a ``scale_loss`` exit left as the model's half grads (checked, not yet multiplied)."""

    inv_scale: torch.Tensor | None  # 1/scale when the exit ran (a copy: the scale may change before the step)
    before_widening: bool  # the exit would have unscaled the half grads in place before widening them
    exact: bool  # ``inv_scale`` is None or a power of two: a widened grad times it is exact in fp32
    plan: kernel_step.Plan  # the kernel step planned at the exit (the step takes it back if it still holds)
    grad_key: tuple[Any, ...] | None = None  # the finite check's storage key of the plan's grads, in its order


class OptimizerGrads:
    """The amp-side state of one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool) -> None:
        self.optimizer = optimizer
        self.master_weights = master_weights
        self.update: Update | None = update_of(optimizer)  # the update amp could run itself (kernel_step)
        # id(model param) -> (model param, master), and id(master) -> model param.
        self._master_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._model_of: dict[int, torch.Tensor] = {}
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        # A multi-rank job's accumulation (see prepare_backward): the parameters whose grads were left in place
        # (brought to the block's scale) with those grads, and the factor that takes them back (None: scale 1).
        self._in_place: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._in_place_back: torch.Tensor | None = None
        self._warned_masters_accumulate = False
        self._held_at_entry: set[int] = set()  # ids of the direct parameters with a grad when the block began
        # Whether a scale_loss exit has moved grads into the masters (or left them pending) since the last step or
        # zero_grad: a block that begins then accumulates onto them.
        self._unscaled_since_step = False
        # zero_grad(set_to_none=False): each zeroed half model grad and its version counter then, by param id.
        # Untouched since (same tensor, same version), it holds no gradient that a step could miss.
        self._zeroed: dict[int, tuple[torch.Tensor, int]] = {}
        # Until the first backward or step (then None): id(model param) -> the version counters of the weight and
        # of its master when amp last made them agree (see follow_model).
        self._agreed: dict[int, tuple[int, int]] | None = {}
        self._loaded: set[int] = set()  # ids of the model params whose masters a load wrote since (follow_model)
        self._pending: PendingGrads | None = None  # master grads still in the half grads (see the module docstring)
        self._pairs_listed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # see _pair_lists
        self._direct_listed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # see direct_params

    # -- masters --------------------------------------------------------------------------------------------
    def create_masters(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Replace every trainable half parameter in the param groups by an fp32 master.

        ``fp32_values`` gives, by parameter id, the full-precision value a parameter had before its model was
        cast, so that masters start exact rather than as upcast half values.
        """
        for group in self.optimizer.param_groups:
            self._replace_in_group(group, fp32_values or {})
        self._recast_state()

    def _replace_in_group(self, group: dict[str, Any], fp32_values: dict[int, torch.Tensor]) -> bool:
        """Masters for the group's trainable half parameters that have none; whether any brought state along."""
        moved_state = False
        params = group["params"]
        for index, param in enumerate(params):
            if id(param) in self._master_of or not param.requires_grad or param.dtype not in HALF_DTYPES:
                continue
            source = fp32_values.get(id(param), param)
            master = torch.nn.Parameter(source.detach().clone().float(), requires_grad=True)
            params[index] = master
            self._master_of[id(param)] = (param, master)
            self._pairs_listed = None
            self._model_of[id(master)] = param
            self._note_agreement(id(param), param, master)
            if param in self.optimizer.state:
                self.optimizer.state[master] = self.optimizer.state.pop(param)
                moved_state = True
        return moved_state

    def adopt_trainable(self) -> None:
        """Masters for half parameters that were frozen at initialize and have started training since.

        Apex made masters lazily, at the first ``zero_grad``/``scale_loss``, for the parameters that required grad
        then; masters made at ``initialize`` must not leave a parameter unfrozen afterwards to train in half
        precision. Frozen parameters still get no master (no fp32 copies of a frozen backbone).
        """
        moved_state = False
        for group in self.optimizer.param_groups:
            moved_state = self._replace_in_group(group, {}) or moved_state
        if moved_state:
            self._recast_state()

    def _recast_state(self) -> None:
        # torch's load_state_dict casts floating state to each parameter's dtype: fp32 for the masters.
        if self.optimizer.state:
            self.optimizer.load_state_dict(self.optimizer.state_dict())

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Give a param group added after initialize its masters (the group is already in ``param_groups``).

        torch's own check for a parameter in two groups compares the new group with the groups, which hold
        masters: a model parameter that already has one is refused here, with torch's message.
        """
        if any(id(p) in self._master_of for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        if self.master_weights:
            self._replace_in_group(group, {})

    def trains(self, param: torch.Tensor) -> bool:
        """Whether the optimizer trains ``param``: listed in its param groups, or through a master (a scan of the
        groups: for rare calls, such as ``add_param_group``)."""
        if id(param) in self._master_of:
            return True
        return any(p is param for group in self.optimizer.param_groups for p in group["params"])

    def master_for(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s master; before the first backward, brought up to date with the weight first (a checkpoint
        saved, or a session closed, between a custom init and the first step keeps the init)."""
        pair = self._master_of.get(id(param))
        if pair is None:
            return None
        if self._agreed is not None:
            self._follow(id(param))
        return pair[1]

    # -- masters that follow the model until the first backward ---------------------------------------------
    def _note_agreement(self, param_id: int, weight: torch.Tensor, master: torch.Tensor) -> None:
        if self._agreed is not None:
            self._agreed[param_id] = (weight._version, master._version)

    @property
    def following(self) -> bool:
        """Whether the masters still follow the model (no backward or step yet)."""
        return self._agreed is not None

    def follow_model(self) -> None:
        """Before amp first uses the masters (a backward or a step): make each master follow its model weight if
        the weight was written since ``initialize``, then stop following (the rule is in the module docstring).
        Once only: callers on the step's path test ``following`` first, which is all that later steps pay.
        """
        if self._agreed is None:
            return
        for param_id in list(self._agreed):
            self._follow(param_id)
        self._agreed = None
        self._loaded.clear()

    def _follow(self, param_id: int) -> None:
        assert self._agreed is not None
        weight, master = self._master_of[param_id]
        weight_version, master_version = self._agreed[param_id]
        if master._version != master_version:  # only the model's load_state_dict writes a master before a step
            self._loaded.add(param_id)
        if weight._version != weight_version:
            with torch.no_grad():
                keep = param_id in self._loaded and torch.equal(weight.detach(), master.to(weight.dtype))
                if not keep:
                    master.copy_(weight.detach())
                    self._loaded.discard(param_id)
        elif param_id not in self._loaded and not _holds_rounding(weight, master):
            # Written without a version bump: through ``.data`` (``p.data.normal_()``, ``p.data.copy_(...)``, as
            # Apex-era code writes weights), by a collective on the tensor itself (``dist.broadcast(p, 0)``,
            # Horovod's broadcast), or by NumPy. The weight no longer holds its master's rounding: it was written.
            with torch.no_grad():
                master.copy_(weight.detach())
        self._note_agreement(param_id, weight, master)

    def pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self._master_of.values())

    def _pair_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model weights and their masters as two lists, kept until the pairs change (the lists are read with
        ``map``, each a loop in C, where iterating the pairs is bytecode per pair)."""
        if self._pairs_listed is None:
            pairs = list(self._master_of.values())
            self._pairs_listed = [p for p, _ in pairs], [m for _, m in pairs]
        return self._pairs_listed

    def direct_params(self) -> list[torch.Tensor]:
        """Parameters whose own ``.grad`` the optimizer reads (no separate master).

        Kept with the parameters they were found among, and found again when those are not the same objects in the
        same order: the masters change only by replacing parameters in the groups (made, restored, a group added),
        and comparing identities is one loop in C, where finding them is three."""
        params = list(itertools.chain.from_iterable(map(_PARAMS, self.optimizer.param_groups)))
        listed = self._direct_listed
        if listed is not None and len(listed[0]) == len(params) and all(map(operator.is_, listed[0], params)):
            return listed[1]
        masters = self._model_of
        direct = list(itertools.compress(params, map(operator.not_, map(masters.__contains__, map(id, params)))))
        self._direct_listed = params, direct
        return direct

    def restore_model_params(self) -> None:
        """Undo :meth:`create_masters`: the model parameters go back into the param groups, with their state."""
        self.materialize_master_grads()
        kernel_step.forget_states(self.optimizer)  # it holds the masters
        for group in self.optimizer.param_groups:
            params = group["params"]
            for index, master in enumerate(params):
                model_param = self._model_of.get(id(master))
                if model_param is None:
                    continue
                params[index] = model_param
                if master in self.optimizer.state:
                    self.optimizer.state[model_param] = self.optimizer.state.pop(master)
                if master.grad is not None:
                    # Closed between scale_loss and step: the model's own grad is still scaled (as in Apex); the
                    # step would have used the master's, unscaled.
                    model_param.grad = master.grad.detach().to(model_param.dtype)
        self._master_of.clear()
        self._pairs_listed = self._direct_listed = None
        self._model_of.clear()
        self._grad_buffers.clear()
        self._zeroed = {}
        self._agreed = None
        self._loaded.clear()

    # -- one backward -----------------------------------------------------------------------------------------
    def prepare_backward(self, scaler: LossScaler | None = None, claimed: set[int] | None = None) -> None:
        """Make room for a backward scaled by ``scaler`` (materialized; None: a caller that knows no scale).

        Grads of the parameters the optimizer trains directly, left by an earlier block of an accumulation, are
        stashed and added back after the backward's unscale. In a multi-rank job they stay in ``.grad`` instead,
        brought to the block's scale (exact: a power of two): DDP's all-reduce of this backward sums what is in
        ``.grad``, so a stashed grad from a block run inside ``no_sync()`` would never be reduced and the ranks
        would step apart (the backward then adds to them, and the exit unscales and checks the sum).

        ``claimed``: ids of the parameters another optimizer of the same block has already made room for (a
        parameter two optimizers train): a grad it kept in place is not multiplied again. This record's are added.
        """
        if self.following:
            self.follow_model()
        if self._unscaled_since_step and self.master_weights:
            self._warn_if_masters_accumulate_across_ranks()
        self.materialize_master_grads()  # the half grads that hold them are dropped below
        direct = self.direct_params()
        # With fp32 masters a half parameter the optimizer trains directly can only be one unfrozen since the
        # masters were made: adopt it (the scan is shared with the stash below). Remainder masters train the bf16
        # weights themselves, so there the test always passes and adopt_trainable skips the weights it knows.
        if self.master_weights and any(p.requires_grad and p.dtype in HALF_DTYPES for p in direct):
            self.adopt_trainable()
            direct = self.direct_params()
        self._zeroed = {}
        _clear_grads(self._pair_lists()[0])
        self._stash = []
        self._in_place, self._in_place_back = [], None
        held = list(itertools.compress(direct, map(_IS_NOT_NONE, map(_GRAD, direct))))  # a loop in C
        self._held_at_entry = set(map(id, held))  # what abort_backward gives back rather than clears
        if claimed is not None:
            if claimed:
                held = [param for param in held if id(param) not in claimed]
            claimed.update(self._held_at_entry)
        if held and _accumulates_in_place(held, scaler):
            assert scaler is not None
            grads = [_grad(param) for param in held]
            if not scaler.unit:
                _torch_kernels.mul_(grads, scaler.scale_tensor)
                self._in_place_back = scaler.inv_scale
            self._in_place = list(zip(held, grads))
            return
        for param in held:
            self._stash.append((param, _grad(param)))
            param.grad = None

    def _warn_if_masters_accumulate_across_ranks(self) -> None:
        """Once: a block begins while fp32 master grads hold an earlier block's, in a multi-rank job. Their half
        grads were moved into the masters, so this backward's all-reduce does not carry them: from a block inside
        DDP's ``no_sync()`` they were never reduced."""
        if self._warned_masters_accumulate or _distributed.world_size() <= 1:
            return
        self._warned_masters_accumulate = True
        warnings.warn(
            "a scale_loss block began while the fp32 master weights hold the gradients of an earlier block, in a "
            "multi-rank job: those were moved out of the model's half gradients, so this backward's all-reduce "
            "(DDP) does not include them. If the earlier block ran inside DDP's no_sync(), every rank now steps "
            "with its own: pass delay_unscale=True to every scale_loss block of an accumulation but the last "
            "(docs/distributed.md).",
            UserWarning,
            stacklevel=6,  # the user's `with amp.scale_loss(...)` (through begin_backward and contextlib)
        )

    def drop_stash(self) -> None:
        """Forget the grads stashed by :meth:`prepare_backward` (``zero_grad`` cleared them)."""
        self._stash = []

    def rescale_kept(self, factor: torch.Tensor, claimed: set[int] | None = None) -> None:
        """Multiply the grads kept scaled by delay_unscale (model grads, direct grads; not the stash) by ``factor``.
        ``claimed``: as :meth:`prepare_backward`'s (a direct grad another optimizer of the block rescaled)."""
        kept = [p.grad for p, _ in self.pairs() if p.grad is not None]
        direct = [p for p in self.direct_params() if p.grad is not None]
        if claimed is not None:
            direct = [p for p in direct if id(p) not in claimed]
            claimed.update(map(id, direct))
        kept += [_grad(p) for p in direct]
        _torch_kernels.mul_(kept, factor)

    def abort_backward(self) -> None:
        """Forget a backward that raised: grads are as they were before ``prepare_backward``."""
        for model_param, _ in self.pairs():
            model_param.grad = None
        # Only the grads this backward began: one held at entry is given back below, by the optimizer that set it
        # aside or kept it (another optimizer training the same parameter leaves it alone).
        held, self._held_at_entry = self._held_at_entry, set()
        for param in self.direct_params():
            if id(param) not in held:
                param.grad = None
        for param, grad in self._stash:
            param.grad = grad
        self._stash = []
        self._take_back_in_place()

    def _take_back_in_place(self) -> None:
        """Grads left in place for a backward that raised, back to the scale they had (the earlier blocks'). What
        that backward added before it raised, if anything, stays: it cannot be told from the rest (a multi-rank
        job only; DDP's reducer is itself left mid-reduction by such a raise)."""
        if self._in_place_back is not None:
            grads = [grad for param, grad in self._in_place if param.grad is grad]
            if grads:
                _torch_kernels.mul_(grads, self._in_place_back)
        self._in_place, self._in_place_back = [], None

    def post_backward(self, scaler: LossScaler, claimed: set[int] | None = None) -> None:
        """Unscale this backward's grads into the optimizer's parameters and check them for inf/NaN; when the
        step's kernels will read the half grads themselves, only check them (see the module docstring).

        ``claimed``: ids of the parameters whose own grads another optimizer of the same block has unscaled (a
        parameter two optimizers train): skipped here, else the grad would be divided by the scale twice. This
        record's are added to it."""
        self._unscaled_since_step = True
        models, masters = self._pair_lists()
        model_grads = list(map(_GRAD, models))
        master_grads = list(map(_GRAD, masters))
        acc_src: list[torch.Tensor] = []  # grads added to master grads kept from an earlier backward
        acc_dst: list[torch.Tensor] = []
        if all(map(_IS_NONE, master_grads)) and not any(map(_IS_NONE, model_grads)):
            # The usual backward (every weight a fresh grad, no master grad kept): one walk, each test a loop in C.
            fresh, copy_src = masters, model_grads
        else:
            fresh, copy_src = [], []
            for master, grad, master_grad in zip(masters, model_grads, master_grads):
                if grad is None:
                    continue
                if master_grad is None:
                    fresh.append(master)
                    copy_src.append(grad)
                else:
                    acc_src.append(grad)
                    acc_dst.append(master_grad)
        direct_params = self.direct_params()
        if claimed is not None:
            if claimed:
                direct_params = [p for p in direct_params if id(p) not in claimed]
            claimed.update(map(id, direct_params))
        direct = list(filter(_IS_NOT_NONE, map(_GRAD, direct_params)))
        # The usual backward hands the plan the weights' grads just read (every master's, in the pairs' order).
        known = (masters, models, model_grads) if fresh is masters else None
        plan = self._half_grads_plan(known) if fresh and not acc_src else None
        key: _torch_kernels.GroupKey | None = None
        if plan is not None and kernel_step.weights_read(plan) == len(copy_src):
            # The plan reads every one of these grads and has checked each (a plain tensor on its device, of its
            # weight's dtype): nothing is read again.
            device = kernel_step.plan_device(plan)
            dtypes = kernel_step.read_dtypes(plan)
            kinds = {(dtype, device.type) for dtype in dtypes}
            key = (device, (*dtypes,)) if len(dtypes) == 1 else None
        else:
            half = copy_src + acc_src
            # The types of the few devices: a device's type read per tensor costs several times more.
            kinds = {(dtype, device.type) for dtype, device in set(zip(map(_DTYPE, half), map(_DEVICE, half)))}
        before_widening = all(scaler.unscales_before_widening(dtype, device_type) for dtype, device_type in kinds)
        if plan is not None:
            keys: list[tuple[Any, ...]] = []
            scaler.check_(copy_src, key, functools.partial(_kernel_check, keys=keys))
            # One launch over every grad (a key: one group, in the plan's order): the step's launches read the same
            # grads, and take their sizes from this key where their pointers, read again, are the same.
            grad_key = keys[0] if key is not None and len(keys) == 1 else None
            scaler.unscale_(direct, _kernel_check)
            inv_scale = None if scaler.unit else scaler.inv_scale  # replaced, never written, by the update
            self._pending = PendingGrads(inv_scale, before_widening, scaler.powers_of_two, plan, grad_key)
            self._merge_stash()
            return
        for master in fresh:
            master.grad = self._grad_buffer(master)
        copy_dst = list(map(_GRAD, fresh))
        if before_widening:
            # Unscale and check the half grads before widening them: half the bytes, the same result (a scale of
            # 1, or a power of two on bf16 off CPU: see unscales_before_widening). The model's half grads are
            # left unscaled in this case.
            scaler.unscale_([*copy_src, *acc_src, *direct], _kernel_check)
            _torch_kernels.copy_(copy_dst, copy_src)
            _torch_kernels.add_(acc_dst, acc_src)
        else:
            _torch_kernels.copy_(copy_dst, copy_src)
            scaler.unscale_([*copy_dst, *direct], _kernel_check)
            if acc_dst:
                # Master grads already hold unscaled values from an earlier backward. Bringing them to the
                # current scale, adding the new scaled grads and unscaling the sum is exact for power-of-two
                # scales (what dynamic scaling produces) and needs no fp32 temporary for the new grads. Only
                # this backward's grads are checked (Apex's rule): an inf kept from an earlier block was
                # counted by that block's scaler, and must not make this one back off or skip again.
                scaler.check_(acc_src)
                _torch_kernels.mul_(acc_dst, scaler.scale_tensor)
                _torch_kernels.add_(acc_dst, acc_src)
                scaler.unscale_unchecked_(acc_dst)
        self._merge_stash()

    def _half_grads_plan(self, known: kernel_step.WeightGrads | None) -> kernel_step.Plan | None:
        """The plan of the next step if it will be this class's kernel step reading the half grads, else None (a
        subclass with a step of its own reads the master grads). ``known``: every master, its weight and that
        weight's grad, as just read."""
        if type(self).step_in_amp_kernels is not OptimizerGrads.step_in_amp_kernels:
            return None
        return kernel_step.half_grads_plan(self.optimizer, self.update, self._model_of, known)

    def skips_on_device(self) -> bool:
        """Whether the next step is meant for this class's kernel step, which takes a device overflow flag (so the
        skip need not be read on the host; a step the kernels decline reads it then). Without masters the kernels
        are meant only for a step given a flag (see :meth:`step_in_amp_kernels`)."""
        if type(self).step_in_amp_kernels is not OptimizerGrads.step_in_amp_kernels:
            return False
        return kernel_step.takes_device_flag(self.optimizer, self.update)

    def materialize_master_grads(self) -> None:
        """Write the fp32 master grads that a ``scale_loss`` exit left in the half grads (:class:`PendingGrads`),
        with the bits that exit would have written then; a no-op when none are pending."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        fresh = [(p, m) for p, m in self.pairs() if p.grad is not None and m.grad is None]
        src = [_grad(p) for p, _ in fresh]
        if pending.before_widening and pending.inv_scale is not None:
            _torch_kernels.mul_(src, pending.inv_scale)
        for _, master in fresh:
            master.grad = self._grad_buffer(master)
        dst = [_grad(m) for _, m in fresh]
        _torch_kernels.copy_(dst, src)
        if not pending.before_widening and pending.inv_scale is not None:
            _torch_kernels.mul_(dst, pending.inv_scale)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor | None:
        """``amp.clip_grad_norm_`` folded into a pending kernel step (``ampinit._masters.clip``): the norm from the
        half grads, the coefficient into the multiplier the kernels apply, the direct parameters' grads multiplied
        in place as torch's clip does. None, with nothing done, where no such step is pending or the fold would
        not give torch's bits: the caller clips ``amp.master_params`` instead."""
        pending = self._pending
        if pending is None or not pending.exact or norm_type not in clip.EXACT_ORDERS:
            return None
        grads: list[torch.Tensor] = []
        scaled: list[bool] = []  # a master's grad: its weight's half grad, times the pending factor
        own: list[torch.Tensor] = []  # parameters the optimizer updates directly, with a grad
        model_of = self._model_of
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                weight = model_of.get(id(param))
                if weight is None:
                    if param.grad is not None:
                        grads.append(param.grad)
                        scaled.append(False)
                        own.append(param)
                elif param.grad is not None:
                    return None  # a master grad kept from an earlier backward: not what a pending step reads
                elif weight.grad is not None:
                    grads.append(weight.grad)
                    scaled.append(True)
        if not clip.same_device(grads):
            return None
        total, coefficient = clip.fold_(grads, scaled, own, pending.inv_scale, max_norm, norm_type, error_if_nonfinite)
        factor = coefficient if pending.inv_scale is None else pending.inv_scale * coefficient
        # Widened, then multiplied in fp32 (as the kernels do): a half multiply by the coefficient would round.
        self._pending = pending._replace(inv_scale=factor, before_widening=False)
        return total

    def before_zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad`` is about to clear the master grads: pending ones are dropped, or made to be zeroed."""
        self._unscaled_since_step = False
        if set_to_none:
            self._pending = None
        else:
            self.materialize_master_grads()

    def _merge_stash(self) -> None:
        acc_dst: list[torch.Tensor] = []
        acc_src: list[torch.Tensor] = []
        for param, grad in self._stash:
            if param.grad is None:
                param.grad = grad
            else:
                acc_dst.append(param.grad)
                acc_src.append(grad)
        _torch_kernels.add_(acc_dst, acc_src)
        self._stash = []
        self._in_place, self._in_place_back = [], None  # unscaled with this backward's

    def _grad_buffer(self, master: torch.Tensor) -> torch.Tensor:
        """Storage for ``master``'s fp32 grad, from ``scale_loss``'s exit to the end of the step.

        On CPU it is allocated once per master and kept: fresh pages each step cost page faults (measured 2% of
        the benchmark MLP's step). Elsewhere it is allocated each step and released with ``master.grad`` after
        the step, as Apex does: the caching allocator (CUDA's) hands the same blocks back at no cost, and during
        the next forward and backward, where a large model's memory peaks, those 4 bytes per parameter go to
        activations instead of sitting idle.
        """
        if master.device.type not in GRAD_BUFFERS_KEPT_ON:
            return torch.empty_like(master)
        buffer = self._grad_buffers.get(id(master))
        if buffer is None:
            buffer = self._grad_buffers[id(master)] = torch.empty_like(master)
        return buffer

    # -- around the step --------------------------------------------------------------------------------------
    def has_model_grads(self) -> bool:
        """Whether any half model parameter holds a grad (which only ``scale_loss`` carries to its master)."""
        return any(p.grad is not None and not self._still_zeroed(p) for p, _ in self.pairs())

    def _still_zeroed(self, param: torch.Tensor) -> bool:
        entry = self._zeroed.get(id(param))
        return entry is not None and entry[0] is param.grad and entry[0]._version == entry[1]

    def step_in_amp_kernels(self, original: Callable[..., Any], found_inf: torch.Tensor | None) -> bool:
        """Whether amp's kernels took the step: the masters updated and the half weights written, one launch per
        list (see ``kernel_step``). False: nothing was done, and the optimizer's own ``step`` must run.

        Without masters (O0/O1/O3/O4) the optimizer's own step runs, but for a step whose skip was decided on the
        device (a static scale, ``sync_free=True``), which torch's foreach and for-loop optimizers cannot take: the
        kernels take such a step of torch's Adam/AdamW/SGD on the fp32 parameters (in place, the grads as they
        are), so that the flag is never read on the host. The caller hands the flag only to a step the optimizer
        cannot skip by itself (``OptimizerRecord.step``): a fused optimizer keeps its own kernel.
        """
        if not self.master_weights:
            if found_inf is None:
                return False
            return kernel_step.step_fp32_masters(self.optimizer, self.update, {}, original, found_inf)
        pending = self._pending
        if pending is None:
            inv_scale, plan, grad_key = None, None, None
        else:
            inv_scale, plan, grad_key = pending.inv_scale, pending.plan, pending.grad_key
        taken = kernel_step.step_fp32_masters(
            self.optimizer, self.update, self._model_of, original, found_inf, pending is not None, inv_scale, plan,
            grad_key,
        )  # fmt: skip
        if not taken:
            self.materialize_master_grads()
        return taken

    def after_step(self, stepped: bool, weights_written: bool = False) -> None:
        """Copy updated masters into the model (if the step ran) and release the master grads (as Apex does).

        ``weights_written``: amp's kernels already wrote the half weights.
        """
        self._pending = None
        self._unscaled_since_step = False
        models, masters = self._pair_lists()
        if stepped and masters and not weights_written:
            _torch_kernels.copy_(models, masters)
        _clear_grads(masters)

    def zero_model_grads(self, set_to_none: bool) -> None:
        """The half model grads, which the optimizer's own ``zero_grad`` cannot see."""
        self._zeroed = {}
        if set_to_none:
            _clear_grads(self._pair_lists()[0])
            return
        grads = [p.grad for p, _ in self.pairs() if p.grad is not None]
        if grads:
            _torch_kernels.foreach_zero_(grads)
            self._zeroed = {id(p): (p.grad, p.grad._version) for p, _ in self.pairs() if p.grad is not None}


def _accumulates_in_place(held: list[torch.Tensor], scaler: LossScaler | None) -> bool:
    """Whether grads ``held`` from an earlier block stay in ``.grad`` for the next backward: in a multi-rank job
    (DDP reduces what ``.grad`` holds), plain tensors (FSDP2's sharded grads are reduced by FSDP itself), and a
    scale whose every value is a power of two (bringing them to it and back is exact)."""
    if scaler is None or _distributed.world_size() <= 1 or not scaler.powers_of_two:
        return False
    return all(type(param.grad) is torch.Tensor for param in held)


#: Elements of a weight compared with its master's rounding at a time (:func:`_holds_rounding`): the comparison runs
#: at the first ``scale_loss`` entry, where the forward's activations are alive, and a rounded copy of a whole large
#: weight (GPT-2's 77 MB embedding at O2) would add to the peak; slices keep it at a few MB.
_ROUNDING_SLICE = 1 << 20


def _holds_rounding(weight: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether half ``weight`` still holds its fp32 ``master`` rounded (as ``initialize`` made it), compared slice by
    slice (once per weight and session; on an accelerator a host read per slice)."""
    if weight.shape != master.shape:
        return False
    with torch.no_grad():
        weights, masters = weight.detach().reshape(-1), master.detach().reshape(-1)
        return all(
            torch.equal(weights[at : at + _ROUNDING_SLICE], masters[at : at + _ROUNDING_SLICE].to(weight.dtype))
            for at in range(0, weights.numel(), _ROUNDING_SLICE)
        )


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def _clear_grads(params: list[torch.Tensor]) -> None:
    # ``map`` over setattr: a loop in C, where a ``for`` statement is bytecode per parameter.
    collections.deque(map(setattr, params, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)


_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_IS_NONE = functools.partial(operator.is_, None)
_IS_NOT_NONE = functools.partial(operator.is_not, None)
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


#: The grad dtypes the check kernel reads.
_CHECKED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def _kernel_check(
    grads: list[torch.Tensor], flag: torch.Tensor, checked: bool, keys: list[tuple[Any, ...]] | None = None
) -> bool:
    """The master step's one-launch finite check (``triton_kernels.check_finite_``), where its kernels run on the
    flag's device and read the grads (fp32, fp16 or bf16, contiguous plain tensors: ``checked`` says the caller
    knows they are); False elsewhere. Offered to the scaler's check of every group of grads
    (``_torch_kernels.check_finite_``: read once, nothing written); Triton is imported only when it is asked.
    ``keys``: each launch's storage key of its grads is appended (``triton_kernels.check_finite_``'s)."""
    if grads[0].dtype not in _CHECKED_DTYPES:
        return False
    kernels = kernel_step.kernels_for(flag.device)
    if kernels is None or not (checked or _torch_kernels.contiguous_plain(grads)):
        return False
    key = kernels.check_finite_(grads, flag)
    if keys is not None and key is not None:
        keys.append(key)
    return True
