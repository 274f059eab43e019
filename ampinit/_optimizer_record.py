"""One record per optimizer: where it stands between two steps, and what its next step must do.

The stage follows GradScaler's ``OptState`` idea: a ``scale_loss`` block moves an optimizer from ``READY`` to
``UNSCALED`` (or to ``SCALED`` with ``delay_unscale=True``), and ``step()`` brings it back to ``READY``. Next to
the stage the record keeps the optimizer's gradients and masters (:class:`OptimizerGrads`), the skip decided for
its next step (on the host, or as a device flag in sync-free mode) and the fate of its last step.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch

from ampinit import _skip, _torch_kernels
from ampinit._masters import Dial, OptimizerGrads, grads_for
from ampinit._scaler import LossScaler
from ampinit._types import HALF_DTYPES
from ampinit._undo import UndoStack

CLOSURE_MESSAGE = "Currently, Amp does not support closure use with optimizers."
_STILL_SCALED = (
    "optimizer.step() was called while gradients are still scaled: the last scale_loss(...) block for this "
    "optimizer had delay_unscale=True. End the accumulation with a block without delay_unscale before stepping."
)
_NOT_TRANSFERRED = (
    "The model has gradients that never reached the fp32 master weights: with master weights (O2/O5), call "
    "backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`."
)


class Stage(enum.Enum):
    """Where an optimizer's gradients are between two steps."""

    READY = "no scale_loss block since the last step"
    SCALED = "gradients still multiplied by the loss scale (delay_unscale=True)"
    UNSCALED = "gradients unscaled and checked for inf/NaN: ready to step"


class OptimizerRecord:
    """The amp-side state of one optimizer of a session."""

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool, dial: Dial | None = None) -> None:
        self.optimizer = optimizer
        # The precision dial picks the class: fp32 masters, remainders, stochastic rounding, compressed moments.
        self.dial = dial or Dial("fp32", "fp32", 0)
        self.grads: OptimizerGrads = grads_for(optimizer, master_weights, self.dial)
        self.stage = Stage.READY
        self.skip_pending = False  # an overflow read on the host: skip the next step
        self.skip_flag: torch.Tensor | None = None  # sync-free: the overflow flag, on the device, for the next step
        self._taken_skip: tuple[bool, torch.Tensor | None] = (False, None)  # what take_skip consumed last
        self.last_skipped: bool | torch.Tensor = False  # the last step's fate (a device flag in sync-free mode)
        # delay_unscale: the scaler, its version and the scale that the kept grads are multiplied by.
        self._kept_scale: tuple[LossScaler, int, torch.Tensor] | None = None

    # -- rebinding --------------------------------------------------------------------------------------------
    def rebind_grad_methods(
        self, undo: UndoStack, in_other_optimizer: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        """Make ``zero_grad`` clear the half model grads too (master weights) and end an unfinished delay_unscale
        accumulation, and ``add_param_group`` add masters. ``in_other_optimizer(param)``: whether another optimizer
        of the session trains ``param`` (with master weights a half one must not be added here too)."""
        opt, grads = self.optimizer, self.grads
        original_zero_grad = opt.zero_grad

        @functools.wraps(original_zero_grad)
        def zero_grad(*args: Any, **kwargs: Any) -> None:
            set_to_none = bool(kwargs.get("set_to_none", args[0] if args else True))
            grads.before_zero_grad(set_to_none)
            original_zero_grad(*args, **kwargs)
            if grads.master_weights:
                grads.zero_model_grads(set_to_none)
            self._drop_kept_scaled()

        undo.rebind(opt, "zero_grad", zero_grad)

        original_add = opt.add_param_group

        @functools.wraps(original_add)
        def add_param_group(param_group: dict[str, Any]) -> None:
            original_add(param_group)
            try:
                if grads.master_weights and in_other_optimizer is not None:
                    _refuse_shared(opt.param_groups[-1], in_other_optimizer)
                grads.add_param_group(opt.param_groups[-1])
            except BaseException:
                opt.param_groups.pop()  # refused: the optimizer is left as it was
                raise

        undo.rebind(opt, "add_param_group", add_param_group)

    # -- one scale_loss block ---------------------------------------------------------------------------------
    def begin_backward(self, scaler: LossScaler, claimed: set[int] | None = None) -> None:
        """Before a backward scaled by ``scaler`` (materialized): make room for its grads.

        Grads kept scaled by delay_unscale are accumulated into; if they carry another scale than ``scaler``'s
        (another loss, or a scale changed since), they are first brought to ``scaler``'s scale, so that the
        unscale at the end divides every contribution by the scale it was multiplied by. ``claimed``: the ids of
        the parameters the block's earlier optimizers made room for (one two optimizers train is handled once).
        """
        if self.stage is not Stage.SCALED:
            self.grads.prepare_backward(scaler, claimed)
            return
        kept = self._kept_scale
        assert kept is not None
        kept_by, version, scale = kept
        if kept_by is not scaler or version != scaler.version:
            factor = scaler.scale_tensor / _torch_kernels.to_device(scale, scaler.scale_tensor.device)
            self.grads.rescale_kept(factor, claimed)

    def abort_backward(self) -> None:
        """The block raised: its gradients are dropped, and scaled ones kept by delay_unscale with them."""
        self.grads.abort_backward()
        if self.stage is Stage.SCALED:
            self.stage = Stage.READY
            self._kept_scale = None

    def _drop_kept_scaled(self) -> None:
        """``zero_grad`` amid a delay_unscale accumulation: nothing scaled is left, nor the grads stashed before it."""
        if self.stage is Stage.SCALED:
            self.grads.drop_stash()
            self.stage = Stage.READY
            self._kept_scale = None

    def keep_scaled(self, scaler: LossScaler) -> None:
        """The grads stay multiplied by ``scaler``'s current scale (remembered, a device copy: no sync)."""
        self.stage = Stage.SCALED
        self._kept_scale = (scaler, scaler.version, scaler.scale_tensor.clone())

    def unscale(self, scaler: LossScaler, claimed: set[int] | None = None) -> None:
        self.grads.post_backward(scaler, claimed)
        self.stage = Stage.UNSCALED
        self._kept_scale = None

    def skip_next_step(self, found_inf: torch.Tensor | None = None) -> None:
        """An unscale step overflowed (decided on the host), or may have (``found_inf``, on the device)."""
        if found_inf is None:
            self.skip_pending = True
        else:
            self.skip_flag = _skip.fold_flag(self.skip_flag, found_inf)

    def decide_next_step(self, found_inf: torch.Tensor) -> None:
        """The next step skips if and only if ``found_inf`` (a lent flag) is raised: a decision made by hand
        (Apex's ``update_scale()`` after ``delay_overflow_check=True`` blocks) replaces what was pending, so that
        a step the code left out after an overflow does not make the next one skip."""
        self.skip_pending, self.skip_flag = False, found_inf

    # -- one step ---------------------------------------------------------------------------------------------
    def check_step(self) -> None:
        """Before a step: refuse grads still scaled by delay_unscale, and bring masters that still follow the model
        up to date (a step before any backward must not write stale masters over the model)."""
        if self.stage is Stage.SCALED:
            raise RuntimeError(_STILL_SCALED)
        if self.grads.following:
            self.grads.follow_model()

    def take_skip(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, torch.Tensor | None]:
        """Consume the decision for the step called with ``args``/``kwargs``: ``(skip on the host, device flag for
        the optimizer's kernel)``."""
        closure_given = _closure(args, kwargs) is not None
        amp_step_skips = self.skip_flag is not None and self.grads.skips_on_device()
        host_skip, flag = _skip.settle_on_host(self.optimizer, self.skip_flag, closure_given, amp_step_skips)
        skip = self.skip_pending or host_skip
        # A refused step leaves the decision in place (Apex's skip_step raises before it unpatches itself), so
        # that the step retried without a closure still skips.
        if (skip or self.grads.master_weights) and closure_given:
            raise RuntimeError(CLOSURE_MESSAGE)
        if not skip and self.grads.master_weights and self.stage is not Stage.UNSCALED and self.grads.has_model_grads():
            raise RuntimeError(_NOT_TRANSFERRED)
        self._taken_skip = self.skip_pending, self.skip_flag
        self.skip_pending, self.skip_flag = False, None
        return skip, flag

    def give_back_skip(self) -> None:
        """Undo the last :meth:`take_skip`: its step raised (an optimizer state the kernels refuse, say), and a retried
        step must be decided as that one was, not taken as a clean step."""
        self.skip_pending, self.skip_flag = self._taken_skip

    def step(
        self,
        original: Callable[..., Any],
        skip: bool,
        flag: torch.Tensor | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The step :meth:`take_skip` decided: in amp's kernels when they take it, else the optimizer's own
        ``original`` step (given the device ``flag``); then the masters reach the model and the record is READY.
        After a device-decided skip the masters are unchanged, so copying them back is harmless."""
        result, in_kernels = None, False
        if not skip:
            takes_flag = flag is not None and _skip.skips_on_device(self.optimizer)
            # Without masters amp's kernels only stand in for an optimizer that cannot take the device flag.
            kernels_may = self.grads.master_weights or (flag is not None and not takes_flag)
            in_kernels = (
                kernels_may and _closure(args, kwargs) is None and self.grads.step_in_amp_kernels(original, flag)
            )
            step_flag = flag
            if not in_kernels and flag is not None and not takes_flag:
                # The flag was left for amp's kernels, which declined a step that may be skipped (a first momentum
                # step), and the optimizer cannot take it: read it now (the one sync the kernels would have saved;
                # the device count keeps ``flag``), and the kernels may take the step decided on the host.
                skip, step_flag = bool(flag.item()), None
                in_kernels = not skip and self.grads.step_in_amp_kernels(original, None)
            if not in_kernels and not skip:
                result = _skip.run_step(self.optimizer, original, step_flag, args, kwargs)
        self.grads.after_step(stepped=not skip, weights_written=in_kernels)
        self.stage = Stage.READY
        self.last_skipped = skip if flag is None else flag
        return result

    def step_was_skipped(self) -> bool:
        skipped = self.last_skipped
        return bool(skipped.item()) if isinstance(skipped, torch.Tensor) else skipped


def _refuse_shared(group: dict[str, Any], in_other_optimizer: Callable[[torch.Tensor], bool]) -> None:
    """Refuse a group added with master weights that lists a half parameter another optimizer already trains: each
    optimizer would step its own master of it, and one of the updates would be lost (see ``initialize``'s check)."""
    for param in group["params"]:
        if param.dtype in HALF_DTYPES and in_other_optimizer(param):
            raise RuntimeError(
                f"add_param_group: a parameter of shape {tuple(param.shape)} is already trained by another optimizer "
                "of this amp session. With master weights each optimizer would get its own fp32 master of it, "
                "stepped by that optimizer only, so one of the updates would be lost. List each parameter in one "
                "optimizer."
            )


def _closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """The closure of a ``step(closure)`` call, or None."""
    return kwargs.get("closure", args[0] if args else None)


class StepCounts:
    """Steps taken and skipped by a session's optimizers; skips decided on the device are summed there."""

    #: Device flags kept before they are summed: one sum of this many (a stack and two adds) instead of an add per
    #: step, each a kernel launch (10-25 us of host time on the H100 checks' hosts). The flags are scalers' lent
    #: ones or folds of them (``LossScaler.lend_flag``, ``_skip.fold_flag``), never written after their step: views
    #: into the scaler's 1 KiB flag buffers (``LossScaler._zero_flag``), or a 512-byte block for a fold.
    FOLD = 32

    def __init__(self) -> None:
        self.steps = 0
        self.last: OptimizerRecord | None = None  # the record of the most recent step
        self._skipped = 0
        self._skipped_on_device: dict[torch.device, torch.Tensor] = {}  # by the flags' devices
        self._flags: list[torch.Tensor] = []  # device flags not yet summed

    def count(self, record: OptimizerRecord, skip: bool, flag: torch.Tensor | None) -> None:
        self.steps += 1
        self.last = record
        if flag is None:
            self._skipped += int(skip)
            return
        self._flags.append(flag)
        if len(self._flags) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        """Add the kept flags into the sums, on their devices (no host sync)."""
        flags, self._flags = self._flags, []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for flag in flags:
            by_device.setdefault(flag.device, []).append(flag.reshape(()))
        for device, kept in by_device.items():
            total = torch.stack(kept).sum()
            before = self._skipped_on_device.get(device)
            self._skipped_on_device[device] = total if before is None else before + total

    def skipped(self) -> int:
        """Every skipped step so far (one host sync per device in sync-free mode)."""
        self._fold()
        return self._skipped + sum(int(total.item()) for total in self._skipped_on_device.values())
