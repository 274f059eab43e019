"""``AmpSession``: everything one ``initialize()`` call set up, and the means to undo it.

A session owns its options, loss scalers, overflow decisions (:mod:`ampinit._overflow`), model casts, cast policy
and one :class:`OptimizerRecord` per optimizer. Every change it makes to a model or an optimizer is pushed on an
undo stack as it is made, so that ``close()`` (and a failure half-way through construction) restores models and
optimizers exactly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampinit import _distributed, _registry, _setup
from ampinit._casting import CastPolicy
from ampinit._masters import Dial, kernel_step, session_seed
from ampinit._masters.dial_grads import MasterFormat
from ampinit._masters.remainder_grads import RemainderGrads
from ampinit._opt_levels import LEVELS, MasterWeights, describe
from ampinit._optimizer_record import OptimizerRecord, Stage, StepCounts
from ampinit._options import AmpOptions
from ampinit._overflow import OverflowDecisions
from ampinit._scaler import LossScaler, load_state_dict_into, state_dict_of
from ampinit._stuck import StuckReport, StuckWeights
from ampinit._types import Optimizers
from ampinit._undo import UndoStack

logger = logging.getLogger("ampinit")


@dataclass(frozen=True)
class AmpStats:
    """Counters a logger or lr scheduler can read without touching private state.

    Skips decided on the device (a static loss scale, ``sync_free=True``) are counted there: ``stats()`` waits for
    the device to read them, so a loop that must not wait calls it where it logs, not at every step.

    Attributes:
        steps: ``optimizer.step()`` calls on this session's optimizers, taken or skipped.
        skipped_steps: how many of them were skipped because of inf/NaN gradients.
        last_step_skipped: whether the most recent ``optimizer.step()`` call was skipped.
        loss_scales: the current scale of each loss scaler (``loss_id`` order).
        unskipped: clean unscale steps since each scaler's scale last changed (Apex's ``_unskipped``).
        stuck_weights: the last stuck-weight measurement (``initialize(stuck_weights_every=N)``; see
            :class:`ampinit._stuck.StuckReport`), or None: the report is off, or no step has been measured yet.
    """

    steps: int
    skipped_steps: int
    last_step_skipped: bool
    loss_scales: tuple[float, ...]
    unskipped: tuple[int, ...]
    stuck_weights: StuckReport | None = None


class AmpSession:
    """The state created by one :func:`ampinit.initialize` call.

    Module-level functions (``ampinit.scale_loss``, ``state_dict``, ``disable_casts``...) act on the most
    recent open session, as Apex's global state did; a program with several sessions calls the same methods on
    the session objects (from ``ampinit.current_session()`` or ``ampinit.session_of(optimizer)``). Building a
    session writes nothing in module state: ``initialize`` enters it in the ledger (:mod:`ampinit._registry`),
    and ``close()`` strikes it out.
    """

    def __init__(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], options: AmpOptions
    ) -> None:
        self.options = options
        self.properties = options.properties
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.verbosity = options.verbosity  # Apex lets `_amp_state.verbosity = 0` silence a running session
        self.closed = False
        self.scalers = [LossScaler(options.loss_scale, i) for i in range(options.num_losses)]
        self._records: dict[int, OptimizerRecord] = {}
        self._cast_policy: CastPolicy | None = None
        self._undo = UndoStack()
        self._overflow = OverflowDecisions(options)
        self._counts = StepCounts()
        every = options.stuck_weights_every
        self._stuck = StuckWeights(every, self.models) if every is not None and self.enabled else None
        if self.enabled:
            props = self.properties
            masters = _master_format(props.master_weights)
            seed = session_seed()
            if masters in ("remainder8", "stochastic") or options.optimizer_state == "bf16":
                seed = _distributed.rank0_seed(seed)  # one collective, only where rounding is stochastic
            dial = Dial(masters, options.optimizer_state, seed)
            for opt in self.optimizers:
                self._records[id(opt)] = OptimizerRecord(opt, props.uses_master_weights, dial)
            try:
                records = list(self._records.values())
                self._cast_policy = _setup.install(
                    self.models, records, options, self._undo, self.master_for, self._wrapped_step
                )
            except BaseException:
                self._undo.run()
                raise
        self._log_properties()

    @property
    def num_losses(self) -> int:
        return self.options.num_losses

    # -- construction ---------------------------------------------------------------------------------------
    def _wrapped_step(self, record: OptimizerRecord) -> Callable[..., Any]:
        """The ``step`` that replaces ``record.optimizer.step``: amp's bookkeeping around the original.

        It is a method bound to the optimizer, as Apex's patched step was: torch's lr schedulers wrap
        ``optimizer.step`` through its ``__func__`` and call that on the optimizer. Such a wrapper, installed
        after ``initialize``, stays on the optimizer when the session closes (it is not ours to remove), so once
        closed this step is the original one.
        """
        original_step = record.optimizer.step
        session = self

        @functools.wraps(original_step)
        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if session.closed:
                return original_step(*args, **kwargs)
            return session._step(record, original_step, args, kwargs)

        return types.MethodType(step, record.optimizer)

    def _log_properties(self) -> None:
        if self.verbosity < 1 or not self.enabled:
            return
        lines = [
            f"Selected optimization level {LEVELS[self.properties.opt_level].brief}",
            "After processing overrides, optimization options are:",
            *describe(self.properties),
        ]
        logger.info("\n".join(lines))

    # -- teardown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Undo everything ``initialize`` did: hooks, optimizer methods, master weights, casts, autocast state.

        Model weights get back the dtype they had before ``initialize``; where a weight had an fp32 master,
        the master's value is used, so no precision is lost. Idempotent.
        """
        if self.closed:
            return
        if self._cast_policy is not None:
            # Refused before anything is undone: the session stays open, to be closed from the right thread.
            self._cast_policy.check_thread()
        self.closed = True
        try:
            try:
                self._overflow.flush_log()  # the lines of overflows still on their way to the host
            finally:
                self._undo.run()  # undone whatever the flush met
        finally:
            _registry.unregister(self)
            kernel_step.forget_tables()  # device memory keyed by tensors this session may have held

    def __enter__(self) -> AmpSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("This amp session has been closed; call ampinit.initialize() again to start a new one.")

    # -- lookups --------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.properties.enabled

    def master_for(self, param: torch.Tensor) -> torch.Tensor | None:
        for record in self._records.values():
            master = record.grads.master_for(param)
            if master is not None:
                return master
        return None

    def master_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """``amp.master_params(optimizer)``: the param groups' parameters, with the fp32 master grads that amp's
        kernel step would read from the half grads written first, and fp32 masters materialised with their grads
        where the masters live in the bf16 weights (``master_weights="remainder"`` and the dial's other bf16
        settings)."""
        record = self._record_of(optimizer)
        if record is not None and isinstance(record.grads, RemainderGrads):
            yield from record.grads.master_params()
            return
        if record is not None:
            record.grads.materialize_master_grads()
        for group in optimizer.param_groups:
            yield from group["params"]

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor | None:
        """``amp.clip_grad_norm_`` folded into ``optimizer``'s pending kernel step, or None where none is pending
        (see ``OptimizerGrads.clip_grad_norm_``)."""
        record = self._record_of(optimizer)
        if record is None or not record.grads.master_weights:
            return None
        return record.grads.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def _record_of(self, optimizer: object) -> OptimizerRecord | None:
        record = self._records.get(id(optimizer))
        return record if record is not None and record.optimizer is optimizer else None

    def _records_of(self, optimizers: object) -> list[OptimizerRecord]:
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        records = []
        for opt in opts:
            record = self._record_of(opt)
            if record is not None:
                records.append(record)
            elif self.enabled:
                raise RuntimeError(
                    f"{type(opt).__name__} {id(opt):#x} was not passed to amp.initialize() for this session: "
                    "pass every optimizer used with scale_loss to initialize."
                )
        return records

    # -- scale_loss -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Optimizers,
        loss_id: int = 0,
        model: nn.Module | None = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """See :func:`ampinit.scale_loss`."""
        self._check_open()
        records = self._records_of(optimizers)
        if not self.enabled:
            yield loss
            return
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "scale_loss needs the loss as a torch.Tensor (the scalar the backward starts from), got "
                f"{type(loss).__module__}.{type(loss).__qualname__} {loss!r:.80}"
            )
        scaler = self._scaler(loss_id)
        if self.properties.short_circuits and not self.options.skip_nonfinite:
            # Apex's short cut (no masters, static scale 1): grads are neither scaled nor checked.
            with self._casts_off():
                yield loss.float()
            return
        scaled = scaler.scale(loss)  # materializes the scaler, whose scale begin_backward may need
        # A parameter two of the block's optimizers train is made room for, and unscaled, once.
        claimed: set[int] | None = set() if len(records) > 1 else None
        for record in records:
            record.begin_backward(scaler, claimed)
        try:
            with self._casts_off():
                yield scaled
        except BaseException:
            # Last first: a grad set aside by the first optimizer that held it is given back after the others have
            # cleared what the backward began.
            for record in reversed(records):
                record.abort_backward()
            raise
        self._after_backward(scaler, records, delay_unscale, delay_overflow_check)

    def _scaler(self, loss_id: object) -> LossScaler:
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(self.scalers):
            raise IndexError(
                f"loss_id={loss_id!r} is out of range: initialize() was called with num_losses={self.num_losses}, "
                f"so loss_id must be an int in [0, {self.num_losses})"
            )
        return self.scalers[loss_id]

    def _after_backward(
        self, scaler: LossScaler, records: list[OptimizerRecord], delay_unscale: bool, delay_overflow_check: bool
    ) -> None:
        if delay_unscale:
            for record in records:
                record.keep_scaled(scaler)
            return
        self._overflow.begin_unscale(scaler)
        claimed: set[int] | None = set() if len(records) > 1 else None  # a shared parameter is unscaled once
        for record in records:
            record.unscale(scaler, claimed)
        self._overflow.after_unscale(scaler, records, self.verbosity, defer=delay_overflow_check)

    # -- optimizer.step -------------------------------------------------------------------------------------
    def _step(
        self, record: OptimizerRecord, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        record.check_step()
        self._overflow.before_step(record, self.verbosity)
        skip, flag = record.take_skip(args, kwargs)
        measured = None if self._stuck is None else self._stuck.before_step(record, skip, self.master_for)
        if self._cast_policy is not None and self._cast_policy.active:
            args, kwargs = _closure_with_casts(self._cast_policy, args, kwargs)
        try:
            with self._session_casts_off():
                result = record.step(original, skip, flag, args, kwargs)
        except BaseException:
            record.give_back_skip()  # the step did not happen: its skip decision waits for the next one
            raise
        self.clear_cast_cache()
        self._counts.count(record, skip, flag)
        if measured is not None:
            assert self._stuck is not None
            self._stuck.after_step(record, measured, flag, self._counts.steps, self.master_for, self.verbosity)
        return result

    # -- casts ------------------------------------------------------------------------------------------------
    def disable_casts(self) -> contextlib.AbstractContextManager[None]:
        """A region where the O1/O4 cast policy does not apply (a no-op at other levels)."""
        if self._cast_policy is None or not self._cast_policy.active:
            return contextlib.nullcontext()
        return self._cast_policy.suspended()

    def _session_casts_off(self) -> contextlib.AbstractContextManager[None]:
        """No casts for the session's own work (the backward inside ``scale_loss``, the optimizer step). Unlike the
        user's :meth:`disable_casts`, a model forward called inside still casts (its hooks): the recompute of a
        ``torch.utils.checkpoint`` around the model must cast as the forward did, whichever thread runs it."""
        if self._cast_policy is None or not self._cast_policy.active:
            return contextlib.nullcontext()
        return self._cast_policy.suspended(by_user=False)

    @contextlib.contextmanager
    def _casts_off(self) -> Iterator[None]:
        """Casts suspended for a backward; the cast cache is dropped afterwards, also when the body raises."""
        try:
            with self._session_casts_off():
                yield
        finally:
            self.clear_cast_cache()

    def clear_cast_cache(self) -> None:
        """Forget the weight casts the O1/O4 policy cached (a no-op at other levels).

        The session does it itself at every ``scale_loss`` exit and optimizer step; code that changes weights in
        place between forwards in one cached region (Apex's ``handle._clear_cache()``) calls it.
        """
        if self._cast_policy is not None:
            self._cast_policy.clear_cache()

    def cache_casts_outside_forwards(self) -> None:
        """Cache weight casts outside model forwards too, in the thread that called ``initialize``, until the
        next :meth:`clear_cast_cache` (a no-op without an O1/O4 policy).

        For sessions without a model forward, where the cache is otherwise never on (Apex's ``amp.init()``
        with ``enable_caching=True``); a weight changed in place meanwhile reads its old cast, as in Apex.
        """
        self._check_open()
        if self._cast_policy is not None:
            self._cast_policy.cache_outside_forwards()

    def follow_apex_tensor_rules(self) -> None:
        """Have the fp16 O1 policy apply Apex's tensor rules too, until the session closes (a no-op without a
        cast policy, or with a bf16 one): ``.cpu()`` of a half tensor gives float32, and the in-place forms of
        Apex's fp32 functions refuse fp16 tensors. For sessions made through the Apex API."""
        self._check_open()
        if self._cast_policy is not None:
            self._cast_policy.follow_apex_tensor_rules()

    # -- public state ---------------------------------------------------------------------------------------
    def step_was_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether the last ``step()`` of ``optimizer`` (default: the last step of any optimizer) was skipped."""
        record = self._counts.last if optimizer is None else self._record_of(optimizer)
        return record is not None and record.step_was_skipped()

    def next_step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the next ``optimizer.step()`` will be skipped: the last unscale found inf/NaN gradients.

        Where the overflow is decided on the device (a static loss scale; a dynamic one on an accelerator, or with
        ``sync_free=True``) the flag is on the device, and reading it here waits for it. ``False`` for an
        optimizer this session does not manage.
        """
        record = self._record_of(optimizer)
        if record is None:
            return False
        flag = record.skip_flag
        return record.skip_pending or (flag is not None and bool(flag.item()))

    def decide_deferred_by_hand(self, scaler: LossScaler) -> Callable[[torch.Tensor], None] | None:
        """For Apex's ``update_scale()`` called by hand after ``delay_overflow_check=True`` blocks of ``scaler``
        (BERT's ``run_pretraining.py``): the decision those blocks left to the next step is taken from it (the
        scaler's flag becomes the one they raised, and no step decides them again, which would update the scale
        twice). Returns what settles the next step of the optimizers they fed by a flag of the caller's: skipped
        exactly when it is raised, whatever was pending (a step the code left out after an overflow does not make
        the next one skip). None where no block waits, or none may skip (a static scale, ``skip_nonfinite=False``).
        """
        records = self._overflow.take_deferred(scaler)
        if not records:
            return None

        def settle(flag: torch.Tensor) -> None:
            for record in records:
                record.decide_next_step(flag)

        return settle

    def grads_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients are still multiplied by the loss scale: the last ``scale_loss``
        block for it had ``delay_unscale=True``. ``False`` for an optimizer this session does not manage."""
        record = self._record_of(optimizer)
        return record is not None and record.stage is Stage.SCALED

    def stats(self) -> AmpStats:
        # Reading the counts waits for the device anyway: the overflow lines it holds are written first.
        self._overflow.flush_log()
        return AmpStats(
            steps=self._counts.steps,
            skipped_steps=self._counts.skipped(),
            last_step_skipped=self.step_was_skipped(),
            loss_scales=tuple(s.loss_scale() for s in self.scalers),
            unskipped=tuple(s.unskipped() for s in self.scalers),
            stuck_weights=None if self._stuck is None else self._stuck.last,
        )

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apex's amp state: ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``."""
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        return state_dict_of(self.scalers, out) if self.enabled else out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output, following Apex's rules (entries are matched by position)."""
        if self.enabled:
            load_state_dict_into(self.scalers, state_dict)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"AmpSession(opt_level={self.properties.opt_level!r}, enabled={self.enabled}, models={len(self.models)}, "
            f"optimizers={len(self.optimizers)}, num_losses={self.num_losses}, {state})"
        )


def _master_format(master_weights: MasterWeights) -> MasterFormat:
    """The dial's name for a ``master_weights`` setting (``True``, and no masters, keep fp32 values)."""
    return master_weights if isinstance(master_weights, str) else "fp32"


def _closure_with_casts(
    policy: CastPolicy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``step``'s arguments with its closure (the user's forward and backward, which the step runs inside its cast
    suspension) run with the casts of the step's caller, as the same code outside a closure does."""
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": policy.casts_as_now(kwargs["closure"])}
    if args and callable(args[0]):
        return (policy.casts_as_now(args[0]), *args[1:]), kwargs
    return args, kwargs
