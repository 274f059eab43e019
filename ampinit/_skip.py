"""Skipping a step whose gradients overflowed: decided on the host, or left to the optimizer on the device.

A step is skipped when an unscale step that fed it found inf/NaN. With a dynamic loss scale decided on the host
(on the CPU, ``sync_free=False``, or ``raise_at_min``) the overflow flag is read there once per ``scale_loss`` exit
and a skip is a plain branch around ``optimizer.step()``. With a static scale, and a dynamic one decided on the
device (by default on an accelerator, and with ``sync_free=True``), the flag stays on the device and goes into
the step's own kernel as ``found_inf`` (torch's AMP-scaling protocol, ``_step_supports_amp_scaling``, and amp's
master kernels), so nobody waits for the device; optimizers that cannot take it still read it, once, at their
step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ampinit._scaler import LossScaler

logger = logging.getLogger("ampinit")


def fold_flag(flag: torch.Tensor | None, found_inf: torch.Tensor) -> torch.Tensor:
    """The device flag of a step that skips if this or an earlier unscale step since the last step overflowed.

    ``found_inf`` is a scaler's lent flag (``LossScaler.lend_flag``), and ``flag`` one made here or lent: neither
    is written again by anyone, so the first is kept as it is (no copy) and a fold makes a new tensor (several
    records may hold the same flag)."""
    if flag is None:
        return found_inf
    return torch.maximum(flag, found_inf)


def settle_on_host(
    optimizer: torch.optim.Optimizer, flag: torch.Tensor | None, closure_given: bool, amp_step_skips: bool = False
) -> tuple[bool, torch.Tensor | None]:
    """Who skips the step: ``(True, None)`` the host skips it, ``(False, flag)`` the optimizer's kernel decides.

    A device flag is read on the host (one sync) when neither the optimizer nor amp's own step (``amp_step_skips``:
    amp's kernel step is meant to take it) can skip by itself, or when a closure must run (a skipped step must not
    call it, which only the host can ensure).
    """
    if flag is None or (not closure_given and (amp_step_skips or skips_on_device(optimizer))):
        return False, flag
    return bool(flag.item()), None


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip by itself from a device ``found_inf`` (torch's AMP-scaling protocol)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        # torch's fused SGD creates momentum buffers with empty_like on its first step, even when found_inf
        # skips that step; the garbage is then used as momentum. Until every buffer exists, decide on the host.
        return all(
            group["momentum"] == 0 or all("momentum_buffer" in optimizer.state.get(p, {}) for p in group["params"])
            for group in optimizer.param_groups
        )
    return True


def run_step(
    optimizer: torch.optim.Optimizer,
    original: Callable[..., Any],
    flag: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call the optimizer's own ``step``; given a ``flag``, its kernel skips the update when the flag is set.

    The grads are already unscaled, so the optimizer gets ``found_inf`` with no ``grad_scale``.
    """
    if flag is None:
        return original(*args, **kwargs)
    had_scale = "grad_scale" in vars(optimizer)
    saved_scale = vars(optimizer).get("grad_scale")
    # torch's fused kernels take a 0-d flag.
    optimizer.found_inf = flag.reshape(())  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    try:
        return original(*args, **kwargs)
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
        if had_scale:
            optimizer.grad_scale = saved_scale  # type: ignore[attr-defined]
        else:
            del optimizer.grad_scale  # type: ignore[attr-defined]


class OverflowLog:
    """Logs skipped steps, thinned out without clocks (deterministic): the first 8, then every power of two.

    A skip decided on the host is logged at once. One decided on the device (a dynamic scale on an accelerator)
    is logged when its flag reaches the host: each decision that may write a line copies the flag and the scale
    before and after the update into host memory without waiting (:meth:`defer`), and lines are written for the
    copies that have landed at the next decision (:meth:`poll`), or all at once when the session reads its stats
    or closes (:meth:`flush`). A line then comes a step or two after its overflow, in order, with the same words.
    """

    def __init__(self) -> None:
        self.count = 0
        self._pending: list[_PendingDecision] = []

    def writes_next(self, verbosity: int) -> bool:
        """Whether the next overflow gets a line: the scales it names are read on the host (syncs) only then."""
        return self.enabled(verbosity) and self._thinning_keeps_next()

    def _thinning_keeps_next(self) -> bool:
        """The first 8 overflows, then the 16th, 32nd, 64th... get a line."""
        n = self.count + 1
        return not (n > 8 and n & (n - 1))

    @staticmethod
    def enabled(verbosity: int) -> bool:
        """Whether any overflow line can be written (a device decision is copied to the host only then)."""
        return verbosity >= 1 and logger.isEnabledFor(logging.INFO)

    def overflow(self, scaler: LossScaler, scale_before: float, verbosity: int) -> None:
        """Count one overflow of ``scaler``, whose scale was ``scale_before`` and is already updated
        (``scale_before`` is only used when :meth:`writes_next` said so)."""
        if self.writes_next(verbosity):
            self._write(scaler.loss_id, scale_before, scaler.loss_scale())
        self.count += 1

    def defer(self, scaler: LossScaler, scale_before: torch.Tensor) -> None:
        """Queue the line of a decision taken on the device: ``scaler``'s flag and scale (updated already) and
        ``scale_before``, copied to the host without a wait."""
        values = torch.stack([scaler.found_inf.reshape(()), scale_before.reshape(()), scaler.scale_tensor])
        self._pending.append(_PendingDecision.copy(scaler.loss_id, values))

    def poll(self) -> None:
        """Write the lines of the queued decisions whose copies have landed, oldest first (no wait)."""
        while self._pending and self._pending[0].landed():
            self._resolve(self._pending.pop(0))

    def flush(self) -> None:
        """Write the lines of every queued decision, waiting for the copies."""
        while self._pending:
            pending = self._pending.pop(0)
            pending.wait()
            self._resolve(pending)

    def _resolve(self, pending: _PendingDecision) -> None:
        found, before, after = pending.host.tolist()
        if found:
            if self._thinning_keeps_next():  # the logger was enabled when the decision was queued (defer)
                self._write(pending.loss_id, before, after)
            self.count += 1

    def _write(self, loss_id: int, before: float, after: float) -> None:
        n = self.count + 1
        change = f"reducing loss scale to {after}" if after != before else f"keeping loss scale at {after}"
        suffix = "" if n <= 8 else f" ({n} overflows so far; further messages are thinned out)"
        logger.info("Gradient overflow.  Skipping step, loss scaler %d %s%s", loss_id, change, suffix)


class _PendingDecision:
    """A device decision's flag and scales on their way to the host: a non-blocking copy into pinned memory and
    an event behind it on an accelerator; on the CPU the values themselves, landed at once."""

    def __init__(self, loss_id: int, host: torch.Tensor, event: Any) -> None:
        self.loss_id = loss_id
        self.host = host
        self._event = event

    @classmethod
    def copy(cls, loss_id: int, values: torch.Tensor) -> _PendingDecision:
        if values.device.type != "cuda":
            return cls(loss_id, values.cpu(), None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return cls(loss_id, host, event)

    def landed(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
