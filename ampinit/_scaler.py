"""One loss scaler: the scale, its growth and hysteresis trackers, and the overflow flag, all on the device.

The scaler keeps its state in 0-d tensors created on the device of the first loss it scales, and updates them
with tensor ops, so deciding a new scale needs no host synchronisation (the same idea as
``torch.amp.GradScaler``). Apex's rules are kept: the scale starts at ``min(init_scale, max_scale)``, halves on
overflow (never below ``min_scale``) and doubles after ``growth_interval`` clean unscale steps (never above
``max_scale``); counting is per unscale step (per ``scale_loss`` exit), not per iteration.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ampinit import _torch_kernels
from ampinit._loss_scale import DynamicLossScale

#: A static scale's clean-step count takes this many updates' flags at once (``LossScaler._count_uncounted``).
STATIC_FOLD = 32

#: Zero overflow flags are cut from one zeroed buffer, this many at a time (``LossScaler._zero_flag``): a scaler
#: whose flag was lent to a step decision takes a new zero flag at each unscale step, and a ``zeros_like`` there
#: was a fill launch per iteration (10-25 us of host time each on the H100 checks' hosts) where this is one per
#: ``FLAG_POOL`` steps. The buffer lives while any flag cut from it does: ``FLAG_POOL * 16`` bytes.
FLAG_POOL = 64

#: Elements from one pooled flag to the next: 16 bytes, so each starts where torch's allocator starts a tensor (on
#: 16 bytes), which is what Triton specialises a pointer on (a flag at another offset would compile a variant).
_FLAG_STRIDE = 4

#: A dynamic scale's update in one launch where a device has one (``ampinit._masters.triton_kernels.update_scale_``:
#: scale, tracker, flag, growth factor, backoff factor, growth interval, min scale, max scale -> the new 1/scale).
FusedUpdate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float, int, float | None, float], torch.Tensor]


def _is_power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


class LossScaleAtMinimumError(FloatingPointError):
    """Raised when a step overflows although the dynamic loss scale is already at its floor."""


class LossScaler:
    """The scaling state of one loss (one ``loss_id``)."""

    def __init__(self, setting: float | DynamicLossScale, loss_id: int = 0) -> None:
        self.loss_id = loss_id
        self.config: DynamicLossScale | None = None
        if isinstance(setting, DynamicLossScale):
            self.config = setting
            self._host_scale = setting.first_scale
        else:
            self._host_scale = float(setting)
        self._host_unskipped = 0
        self._host_hysteresis = self.config.hysteresis if self.config is not None else 1
        self._scale: torch.Tensor | None = None
        self._unskipped: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        # Whether the flag was handed to a step decision (``lend_flag``): then it is never written again, and a
        # write of the scaler's own (a clear, a check) goes to a new tensor.
        self._flag_lent = False
        self._uncounted: list[torch.Tensor] = []  # a static scale's flags not yet in its clean-step count
        self._zero_flags: list[torch.Tensor] = []  # zero flags not yet taken (``_zero_flag``)
        self._inv_scale: torch.Tensor | None = None
        self._one: torch.Tensor | None = None  # the multiplier of a check that has nothing to unscale
        # Counts the events that may have changed the scale (a dynamic update, a load): grads kept scaled by
        # delay_unscale know from it, on the host, whether the scale they carry is still the current one.
        self.version = 0

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        return self.config is not None

    def unscales_exactly_in(self, dtype: torch.dtype) -> bool:
        """Whether multiplying ``dtype`` grads by ``1/scale`` in ``dtype`` itself loses nothing.

        True for a static scale of 1 (only the inf/NaN check remains), and for bfloat16 whenever every scale
        this scaler can take is a power of two: bf16 has fp32's exponent range, so such a multiply only moves
        the exponent. fp16's narrow range would flush small grads to zero, so fp16 is unscaled after widening.
        """
        if self.unit:
            return True
        return dtype == torch.bfloat16 and self.powers_of_two

    def unscales_before_widening(self, dtype: torch.dtype, device_type: str) -> bool:
        """Whether a master step should unscale and check half grads of ``dtype`` on ``device_type`` before
        widening them (asked once per kind of grad, not once per grad).

        Only where that is exact (:meth:`unscales_exactly_in`), and not for a bf16 grad on CPU that needs a
        multiply: torch's CPU unscale kernel takes bf16 element by element, so there the fp32 kernel on the
        widened grad is faster (0.36x against 1.07x an fp32 AdamW step over as many elements, on the Intel
        Xeon with AMX-BF16). With nothing to multiply (a static scale of 1) the bf16 check is a fast sum
        (see :func:`ampinit._torch_kernels.check_finite_`) and stays before widening.
        """
        if not self.unscales_exactly_in(dtype):
            return False
        return self.unit or dtype != torch.bfloat16 or device_type != "cpu"

    @property
    def unit(self) -> bool:
        """A static scale of exactly 1: grads need checking, never multiplying."""
        return self.config is None and self._host_scale == 1.0

    @property
    def powers_of_two(self) -> bool:
        """Whether every scale this scaler can take is a power of two (so is its reciprocal, exactly)."""
        if self.config is None:
            return _is_power_of_two(self._host_scale)
        cfg = self.config
        return all(
            _is_power_of_two(v)
            for v in (self._host_scale, cfg.growth_factor, cfg.backoff_factor, cfg.max_scale, cfg.min_scale or 1.0)
        )

    @property
    def device(self) -> torch.device | None:
        return None if self._scale is None else self._scale.device

    def materialize(self, device: torch.device) -> None:
        """Create the device tensors (once), from the host values set at construction or by ``load_state_dict``."""
        if self._scale is not None:
            return
        # Fill kernels that take the numbers as arguments: torch.tensor(value, device=...) would stage each in
        # host memory and copy it, a blocking host-to-device copy on CUDA at the first step.
        self._scale = torch.full((), self._host_scale, dtype=torch.float32, device=device)
        self._unskipped = torch.full((), self._host_unskipped, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), self._host_hysteresis, dtype=torch.int32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._refresh_inv_scale()

    def _refresh_inv_scale(self) -> None:
        assert self._scale is not None
        # One fp32 kernel. Dynamic scales are powers of two, whose fp32 reciprocal is exact; GradScaler's float64
        # detour only matters for odd static scales, which never change (so it is paid once, at materialize,
        # below). A new tensor at each update, never one written in place: a pending master step keeps the
        # reciprocal its grads were scaled with (``OptimizerGrads.post_backward``) without a copy of its own.
        if self._inv_scale is None or self.config is None:
            self._inv_scale = self._scale.double().reciprocal().float()
        else:
            self._inv_scale = torch.reciprocal(self._scale)

    @property
    def scale_tensor(self) -> torch.Tensor:
        assert self._scale is not None, "materialize() first"
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` (fp32, on the device): the tensor of the current scale, replaced (not written) when the
        scale changes, so that one taken stays the reciprocal of the scale it was taken at."""
        assert self._inv_scale is not None, "materialize() first"
        return self._inv_scale

    @property
    def found_inf(self) -> torch.Tensor:
        """The overflow flag (one fp32 element, 1 after an inf/NaN), to read; what writes it takes
        :meth:`writable_flag`."""
        assert self._found_inf is not None, "materialize() first"
        return self._found_inf

    def lend_flag(self) -> torch.Tensor:
        """The overflow flag, for a step decision to keep (a record's skip flag, the skip count, the last step's
        fate): the scaler never writes this tensor again. Its next clear or write makes a new one (copy on write),
        so the decision needs no copy of its own: one kernel launch fewer per iteration than a clone, on the H100
        checks' hosts 10-25 us of host time."""
        self._flag_lent = True
        return self.found_inf

    def writable_flag(self) -> torch.Tensor:
        """The overflow flag, to write in place (a check, a multi-rank agreement, Apex's setters): a lent one is
        first copied."""
        if self._flag_lent:
            self._found_inf = self.found_inf.clone()
            self._flag_lent = False
        return self.found_inf

    def take_flag(self, flag: torch.Tensor) -> None:
        """Make ``flag`` (a tensor nobody else writes: a deferred decision's own) the overflow flag."""
        if self._found_inf is not None and flag.shape != self._found_inf.shape:
            raise ValueError(f"an overflow flag has shape {tuple(self._found_inf.shape)}, got {tuple(flag.shape)}")
        self._found_inf, self._flag_lent = flag, False

    def set_overflow(self, value: bool) -> None:
        """Raise (``True``) or clear the overflow flag, as Apex's ``_has_overflow`` setter and ``update_scale``
        do."""
        self.writable_flag().fill_(1.0 if value else 0.0)

    def loss_scale(self) -> float:
        """The current scale as a Python float (a host sync when the scale lives on an accelerator)."""
        return self._host_scale if self._scale is None else float(self._scale.item())

    def unskipped(self) -> int:
        """Clean unscale steps since the scale last changed (Apex's ``_unskipped``)."""
        if self._unskipped is None:
            return self._host_unskipped
        self._count_uncounted()
        return int(self._unskipped.item())

    def _count_uncounted(self) -> None:
        """Fold a static scale's kept flags into its clean-step count, on the device: after the last raised flag,
        the clean ones that follow it; none raised, the count so far plus them all (the rule of one
        ``_amp_update_scale_`` per flag, with factors of 1 and no growth, in a few ops for all of them)."""
        flags, self._uncounted = self._uncounted, []
        if not flags:
            return
        assert self._unskipped is not None
        raised = torch.stack([flag.reshape(()) for flag in flags]) > 0
        positions = torch.arange(1, len(flags) + 1, dtype=torch.int32, device=raised.device)
        last = torch.where(raised, positions, 0).max()  # 0: none raised
        counted = torch.where(last > 0, len(flags) - last, self._unskipped + len(flags))
        self._unskipped.copy_(counted)

    def hysteresis_left(self) -> int:
        return self._host_hysteresis if self._hysteresis_left is None else int(self._hysteresis_left.item())

    # -- one unscale step ----------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * scale``: the tensor to call ``backward()`` on."""
        self.materialize(loss.device)
        if self.unit:
            return loss.float()  # the same values and grads, without a multiply in the graph
        return loss.float() * _torch_kernels.to_device(self.scale_tensor, loss.device)

    def clear_overflow(self) -> None:
        """A zero flag before an unscale step: written in place, or, where the last one was lent, a new tensor (one
        of the pool's, :meth:`_zero_flag`)."""
        if self._flag_lent:
            self._found_inf = self._zero_flag()
            self._flag_lent = False
        else:
            self.found_inf.zero_()

    def _zero_flag(self) -> torch.Tensor:
        """A new zero flag, never handed out before: cut from a zeroed buffer of :data:`FLAG_POOL` (one fill launch
        for that many), each a one-element contiguous view starting on 16 bytes. Nothing writes a flag before it
        is taken from here, and once taken it is the scaler's own flag, written as any other."""
        if not self._zero_flags:
            pool = torch.zeros(FLAG_POOL, _FLAG_STRIDE, dtype=torch.float32, device=self.found_inf.device)
            self._zero_flags = list(pool[:, :1].unbind(0))
            self._zero_flags.reverse()  # taken from the end: in the order of their addresses
        return self._zero_flags.pop()

    def unscale_(self, grads: list[torch.Tensor], fused: _torch_kernels.FusedCheck | None = None) -> None:
        """Unscale ``grads`` in place and raise the overflow flag if any is inf/NaN (``fused``: see ``check_``)."""
        if grads and self.unit:
            self.check_(grads, fused=fused)
        elif grads:
            _torch_kernels.unscale_and_check_(grads, self.writable_flag(), self.inv_scale)

    def check_(
        self,
        grads: list[torch.Tensor],
        key: _torch_kernels.GroupKey | None = None,
        fused: _torch_kernels.FusedCheck | None = None,
    ) -> None:
        """Raise the overflow flag if any of ``grads`` is inf/NaN, leaving their values as they are (times 1).

        ``key``: the one (device, (dtype,)) of every grad, where the caller knows it; ``fused``: a one-launch check
        that runs on the flag's device, for what torch's kernel refuses (both: see ``check_finite_``)."""
        if grads:
            assert self._one is not None, "materialize() first"
            _torch_kernels.check_finite_(grads, self.writable_flag(), self._one, key, fused)

    def unscale_unchecked_(self, grads: list[torch.Tensor]) -> None:
        """Unscale ``grads`` in place without touching the overflow flag (values already checked elsewhere)."""
        if grads:
            _torch_kernels.mul_(grads, self.inv_scale)

    def update(self, fused: FusedUpdate | None = None) -> None:
        """Fold this step's overflow flag into the scale, on device (no host sync). ``fused``: the one-launch update
        of a dynamic scale without hysteresis on this scaler's device, where the caller has one (this layer does not
        know the kernels); torch's three ops otherwise."""
        assert self._scale is not None and self._unskipped is not None and self._hysteresis_left is not None
        cfg = self.config
        if cfg is not None:
            self.version += 1
        if cfg is None:
            # A static scale only counts clean steps (Apex's ``_unskipped``; no factor, no growth ever). The
            # count is kept for later: the flags (lent: never written again) are counted every STATIC_FOLD
            # updates or when the count is read, where an update kernel per scale_loss exit cost a launch each.
            self._uncounted.append(self.lend_flag())
            if len(self._uncounted) >= STATIC_FOLD:
                self._count_uncounted()
            return
        if cfg.hysteresis == 1 and fused is not None:
            # The three ops below in one launch, with their bits (tests/test_scale_update.py).
            self._inv_scale = fused(
                self._scale, self._unskipped, self.found_inf, cfg.growth_factor, cfg.backoff_factor,
                cfg.growth_interval, cfg.min_scale, cfg.max_scale,
            )  # fmt: skip
            return
        if cfg.hysteresis == 1:
            # Apex's rule is GradScaler's plus a ceiling and an optional floor: one kernel and a clamp or two.
            _torch_kernels.update_scale_(
                self._scale, self._unskipped, self.found_inf, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval
            )
            self._scale.clamp_(min=cfg.min_scale, max=cfg.max_scale)
        else:
            self._update_with_hysteresis(cfg)
        self._refresh_inv_scale()

    def _update_with_hysteresis(self, cfg: DynamicLossScale) -> None:
        assert self._scale is not None and self._unskipped is not None and self._hysteresis_left is not None
        found = self.found_inf[0] > 0
        zero = torch.zeros_like(self._unskipped)
        left = torch.where(found, self._hysteresis_left - 1, torch.full_like(self._hysteresis_left, cfg.hysteresis))
        self._hysteresis_left.copy_(left.clamp(min=0))
        back_off = found & (left <= 0)
        shrunk = self._scale * cfg.backoff_factor
        if cfg.min_scale is not None:
            shrunk = shrunk.clamp(min=cfg.min_scale)
        new_scale = torch.where(back_off, shrunk, self._scale)
        unskipped = torch.where(found, zero, self._unskipped + 1)
        grow = unskipped >= cfg.growth_interval
        new_scale = torch.where(grow, (new_scale * cfg.growth_factor).clamp(max=cfg.max_scale), new_scale)
        self._unskipped.copy_(torch.where(grow, zero, unskipped))
        self._scale.copy_(new_scale)

    def stuck(self) -> bool:
        """Whether an overflow now would find the scale unable to back off any further, with a config that asks to
        raise then (host sync): ask before the update, raise (:meth:`raise_if_stuck`) once the overflow is decided."""
        cfg = self.config
        return cfg is not None and cfg.raise_at_min and self.at_minimum()

    def raise_if_stuck(self, stuck: bool | None = None) -> None:
        """After an overflow: raise if the scale cannot back off any further and the config asks to (host sync).
        ``stuck``: :meth:`stuck` as asked before the overflow's update (default: asked now)."""
        cfg = self.config
        if stuck is None:
            stuck = self.stuck()
        if stuck and cfg is not None:
            raise LossScaleAtMinimumError(
                f"Gradient overflow with loss scaler {self.loss_id} already at its minimum loss scale "
                f"{self.loss_scale()} (min_scale={cfg.min_scale}): training cannot make progress."
            )

    def reconfigure(self, config: DynamicLossScale) -> None:
        """Use ``config``'s rules from the next update on, keeping the current scale and counts.

        For Apex's settable scaler fields (``_scale_seq_len`` is the growth interval). Only a dynamic scale has
        rules to change.
        """
        if self.config is None:
            raise RuntimeError(f"loss scaler {self.loss_id} has a static scale ({self._host_scale!r}): it has no rules")
        self.config = config

    def set_loss_scale(self, value: float) -> None:
        """Make ``value`` the current loss scale, keeping the counts (Apex's scalers let legacy code assign it)."""
        state = self.state_dict()
        state["loss_scale"] = float(value)
        self.load_state_dict(state)

    def set_unskipped(self, value: int) -> None:
        """Make ``value`` the count of clean steps, keeping the scale (Apex's ``_unskipped`` is assignable)."""
        state = self.state_dict()
        state["unskipped"] = int(value)
        self.load_state_dict(state)

    def at_minimum(self) -> bool:
        """Whether the scale sits at its floor (host sync)."""
        return (
            self.config is not None and self.config.min_scale is not None and self.loss_scale() <= self.config.min_scale
        )

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Apex's per-scaler entry; the hysteresis count is added only when hysteresis is in use."""
        state: dict[str, Any] = {"loss_scale": self.loss_scale(), "unskipped": self.unskipped()}
        if self.config is not None and self.config.hysteresis > 1:
            state["hysteresis_left"] = self.hysteresis_left()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._apply_entry(self.parse_entry(state))

    def parse_entry(self, state: object) -> tuple[float, int, int]:
        """Check one Apex-format entry and return ``(loss_scale, unskipped, hysteresis_left)``; changes nothing.

        A value that no scaler can hold (a scale that is not a finite number > 0, a negative count) is refused
        here, naming it, so that a bad checkpoint fails before any scaler is touched.
        """
        try:
            scale = float(state["loss_scale"])  # type: ignore[index]
            unskipped = int(state["unskipped"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
            raise ValueError(
                f"A loss-scaler entry needs 'loss_scale' (a number) and 'unskipped' (an int), got {state!r}"
            ) from err
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"A loss-scaler entry's 'loss_scale' must be a finite number > 0, got {state!r}")
        if unskipped < 0:
            raise ValueError(f"A loss-scaler entry's 'unskipped' must be an int >= 0, got {state!r}")
        default = self.config.hysteresis if self.config else 1
        raw = state.get("hysteresis_left", default) if isinstance(state, Mapping) else default
        try:
            hysteresis = int(raw)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"A loss-scaler entry's 'hysteresis_left' must be an int >= 0, got {state!r}") from err
        if hysteresis < 0:
            raise ValueError(f"A loss-scaler entry's 'hysteresis_left' must be an int >= 0, got {state!r}")
        return scale, unskipped, hysteresis

    def _apply_entry(self, entry: tuple[float, int, int]) -> None:
        scale, unskipped, hysteresis = entry
        self._host_scale, self._host_unskipped = scale, unskipped
        self._uncounted = []  # flags of the steps before the loaded count
        self.version += 1
        self._host_hysteresis = hysteresis
        if self._scale is not None:
            self._scale.fill_(scale)
            assert self._unskipped is not None and self._hysteresis_left is not None
            self._unskipped.fill_(unskipped)
            self._hysteresis_left.fill_(self._host_hysteresis)
            self._refresh_inv_scale()


# -- Apex's checkpoint format for a session's scalers ----------------------------------------------------------------
def state_dict_of(scalers: Sequence[LossScaler], destination: dict[str, Any]) -> dict[str, Any]:
    """Apex's amp state: ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``, into ``destination``."""
    for index, scaler in enumerate(scalers):
        destination[f"loss_scaler{index}"] = scaler.state_dict()
    return destination


def load_state_dict_into(scalers: Sequence[LossScaler], state_dict: dict[str, Any]) -> None:
    """Load :func:`state_dict_of` output following Apex's rules: entries are matched by position.

    Warnings point at the caller of ``ampinit.load_state_dict`` (or of ``AmpSession.load_state_dict``).
    """
    if not isinstance(state_dict, Mapping) or not all(isinstance(key, str) for key in state_dict):
        raise TypeError(
            "amp.load_state_dict takes what amp.state_dict() returns, a dict such as "
            f"{{'loss_scaler0': {{'loss_scale': 65536.0, 'unskipped': 0}}}}, got {state_dict!r:.200}"
        )
    if len(state_dict) != len(scalers):
        warnings.warn(
            f"state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used", stacklevel=4
        )
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected)
            + ". "
        )
    entries = [state_dict[key] for key in state_dict if "loss_scaler" in key]
    if len(entries) > len(scalers):
        warnings.warn(f"Skipping loss_scaler[{len(scalers)}], since num_losses was set to {len(scalers)}", stacklevel=4)
    # Every entry is checked before any scaler changes: a bad one leaves all of them as they were.
    parsed = [scaler.parse_entry(entry) for scaler, entry in zip(scalers, entries)]
    for scaler, values in zip(scalers, parsed):
        scaler._apply_entry(values)
