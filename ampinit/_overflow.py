"""The overflow decision of an unscale step: update the loss scale and mark the optimizers' next steps to skip.

A ``scale_loss`` exit unscales the gradients into the scaler's device flag; this module turns that flag into a
decision, right away or, with ``delay_overflow_check=True``, at the next ``step()`` of one of the optimizers that
the unscale step fed.

With a static scale (O0/O3/O4/O5's 1.0 included) nothing on the host needs the flag before the step, so it stays on
the device: the step skips inside its kernel where it can (see :mod:`ampinit._skip`). A dynamic scale is decided
there too wherever reading the flag would make the host wait for the GPU (by default on an accelerator, and always
with ``sync_free=True``): the scale is updated by tensor ops and the overflow line is written when the flag reaches
the host, a step or two later. On the CPU, with ``sync_free=False``, and for ``DynamicLossScale(raise_at_min=True)``
the flag is read on the host here (the step's one sync): the skip is a plain branch, the line is written at once
and ``raise_at_min`` can raise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ampinit import _skip
from ampinit._distributed import agree_on_overflow_
from ampinit._masters import kernel_step
from ampinit._optimizer_record import OptimizerRecord
from ampinit._options import AmpOptions
from ampinit._scaler import LossScaler

# Tests set this to take the CPU for an accelerator here: a dynamic scale is then decided on the device by default,
# as on CUDA (the decision's flag is a CPU tensor, so nothing waits, but every path is the accelerator's).
DEVICE_DECIDES_ON_CPU = False


class OverflowDecisions:
    """One session's overflow decisions, with those deferred to a step (``delay_overflow_check=True``)."""

    def __init__(self, options: AmpOptions) -> None:
        self._options = options
        # Unscale steps whose decision waits for a step, by scaler, in the order of their exits: each one's own
        # overflow flag (lent: the scaler's flag is cleared for every unscale step, so that a plain block in between
        # is decided on its own grads only) and the records it fed. Each is decided on its own (a block's decision
        # only moves to the step): its overflow skips only its own optimizers, and each counts as one unscale step.
        self._deferred: dict[LossScaler, list[tuple[torch.Tensor, tuple[OptimizerRecord, ...]]]] = {}
        self._log = _skip.OverflowLog()

    def begin_unscale(self, scaler: LossScaler) -> None:
        """Clear ``scaler``'s flag before an unscale step: each step checks only the grads of its own backward."""
        scaler.clear_overflow()

    def after_unscale(
        self, scaler: LossScaler, records: Sequence[OptimizerRecord], verbosity: int, *, defer: bool
    ) -> None:
        """Decide now from ``scaler``'s flag, or (``defer``) when one of ``records`` steps."""
        if not defer:
            self._decide(scaler, records, verbosity)
            return
        self._deferred.setdefault(scaler, []).append((scaler.lend_flag(), tuple(records)))

    def take_deferred(self, scaler: LossScaler) -> list[OptimizerRecord]:
        """Hand the decision that waits for a step to code that makes it now (Apex's ``update_scale()`` called by
        hand after ``delay_overflow_check=True`` blocks, as BERT's ``run_pretraining.py`` does): ``scaler``'s flag
        becomes the one its deferred unscale steps raised (any of them), and no step decides them again (that would
        update the scale twice; Apex's hand-made decision is one update for them all). Returns the records whose
        next step that decision settles (``OptimizerRecord.decide_next_step``): none where the scale is static and
        non-finite steps are not skipped (``skip_nonfinite=False``, Apex's rule)."""
        blocks = self._deferred.pop(scaler, None)
        if not blocks:
            return []
        scaler.take_flag(functools.reduce(torch.maximum, [flag for flag, _ in blocks]))
        if not scaler.dynamic and not self._options.skip_nonfinite:
            return []
        return list(dict.fromkeys(record for _, waiting in blocks for record in waiting))

    def device_decides(self, scaler: LossScaler) -> bool:
        """Whether a dynamic ``scaler``'s overflow is decided on the device: ``sync_free`` when given; by default
        wherever reading the flag would make the host wait (an accelerator), unless ``raise_at_min`` needs it."""
        if self._options.sync_free is not None:
            return self._options.sync_free
        config = scaler.config
        if config is not None and config.raise_at_min:
            return False
        return scaler.found_inf.device.type != "cpu" or DEVICE_DECIDES_ON_CPU

    def flush_log(self) -> None:
        """Write the overflow lines of device decisions still on their way to the host (waits for them)."""
        self._log.flush()

    def before_step(self, record: OptimizerRecord, verbosity: int) -> None:
        """Take every deferred decision that ``record``'s step waits for."""
        for scaler, blocks in list(self._deferred.items()):
            if any(record in waiting for _, waiting in blocks):
                # Every deferred block of the scaler, in the order of their exits (the scale updates follow it).
                del self._deferred[scaler]
                for index, (flag, waiting) in enumerate(blocks):
                    scaler.take_flag(flag)  # the flag that block's unscale step raised (its own), decided now
                    try:
                        self._decide(scaler, waiting, verbosity)
                    except BaseException:
                        if index + 1 < len(blocks):  # raise_at_min: the later blocks wait for the next step
                            self._deferred[scaler] = blocks[index + 1 :]
                        raise

    def _decide(self, scaler: LossScaler, records: Sequence[OptimizerRecord], verbosity: int) -> None:
        if not scaler.dynamic and not self._options.skip_nonfinite:
            scaler.clear_overflow()  # Apex: a static scale never skips, and counts every unscale step as clean
            scaler.update()
            return
        agree_on_overflow_(scaler.writable_flag())
        # A dynamic scale's update in one launch where the master kernels run (two fewer than torch's ops).
        fused = kernel_step.scale_update_for(scaler.scale_tensor.device) if scaler.dynamic else None
        if not scaler.dynamic or self.device_decides(scaler):
            logs = scaler.dynamic and self._log.enabled(verbosity)
            scale_before = scaler.scale_tensor.clone() if logs else None
            scaler.update(fused)
            for record in records:
                record.skip_next_step(scaler.lend_flag())
            if scale_before is not None:
                self._log.defer(scaler, scale_before)
                self._log.poll()
            return
        if not bool(scaler.found_inf.item()):
            scaler.update(fused)
            return
        # Asked before the update, raised after it: the overflow is decided (the steps it fed skip, the scale and
        # counts are updated) whether or not the caller goes on after LossScaleAtMinimumError.
        stuck = scaler.stuck()
        # The scale is read on the host only for a line that is written: an overflow stays one sync otherwise.
        before = scaler.loss_scale() if self._log.writes_next(verbosity) else math.nan
        scaler.update(fused)
        for record in records:
            record.skip_next_step()
        self._log.overflow(scaler, before, verbosity)
        scaler.raise_if_stuck(stuck)
