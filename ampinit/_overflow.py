"""The overflow decision of an unscale step: update the loss scale and mark the optimizers' next steps to skip.

A ``scale_loss`` exit unscales the gradients into the scaler's device flag; this module turns that flag into a
decision, right away or, with ``delay_overflow_check=True``, at the next ``step()`` of one of the optimizers that
the unscale step fed. By default the flag is read on the host here (the step's one sync), so the skip is a plain
branch and the overflow can be logged; in sync-free mode it stays on the device (see :mod:`ampinit._skip`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ampinit import _skip
from ampinit._distributed import agree_on_overflow_
from ampinit._optimizer_record import OptimizerRecord
from ampinit._options import AmpOptions
from ampinit._scaler import LossScaler


class OverflowDecisions:
    """One session's overflow decisions, with those deferred to a step (``delay_overflow_check=True``)."""

    def __init__(self, options: AmpOptions) -> None:
        self._options = options
        # Unscale steps whose decision waits for a step, by scaler: the records they fed, in order.
        self._deferred: dict[LossScaler, dict[OptimizerRecord, None]] = {}
        self._log = _skip.OverflowLog()

    def begin_unscale(self, scaler: LossScaler) -> None:
        """Clear ``scaler``'s flag before an unscale step, unless a deferred decision is still collecting it."""
        if scaler not in self._deferred:
            scaler.clear_overflow()

    def after_unscale(
        self, scaler: LossScaler, records: Sequence[OptimizerRecord], verbosity: int, *, defer: bool
    ) -> None:
        """Decide now from ``scaler``'s flag, or (``defer``) when one of ``records`` steps."""
        if defer:
            self._deferred.setdefault(scaler, {}).update(dict.fromkeys(records))
        else:
            self._decide(scaler, records, verbosity)

    def before_step(self, record: OptimizerRecord, verbosity: int) -> None:
        """Take every deferred decision that ``record``'s step waits for."""
        for scaler, waiting in list(self._deferred.items()):
            if record in waiting:
                del self._deferred[scaler]
                self._decide(scaler, list(waiting), verbosity)

    def _decide(self, scaler: LossScaler, records: Sequence[OptimizerRecord], verbosity: int) -> None:
        if scaler.config is None and not self._options.skip_nonfinite:
            scaler.clear_overflow()  # Apex: a static scale never skips, and counts every unscale step as clean
        agree_on_overflow_(scaler.found_inf)
        if self._options.sync_free:
            scaler.update()
            for record in records:
                record.skip_next_step(scaler.found_inf)
            return
        if not bool(scaler.found_inf.item()):
            scaler.update()
            return
        scaler.raise_if_stuck()
        before = scaler.loss_scale()
        scaler.update()
        for record in records:
            record.skip_next_step()
        self._log.overflow(scaler, before, verbosity)
