"""``AmpSession``: everything one ``initialize()`` call set up, and the means to undo it.

A session owns its properties, loss scalers, model casts, cast policy, master weights and the optimizer
methods it rebound. Every change it makes is recorded on an undo stack as it is made, so that ``close()``
(and a failure half-way through construction) restores models and optimizers exactly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampinit import _registry
from ampinit._cast_policy import CastPolicy, CastPolicyName
from ampinit._distributed import agree_on_overflow_
from ampinit._loss_scale import DynamicLossScale
from ampinit._master_weights import OptimizerGrads
from ampinit._model_cast import ModelCast, plan
from ampinit._opt_levels import LEVELS, Properties, describe
from ampinit._remainder_masters import RemainderGrads
from ampinit._scaler import LossScaleAtMinimumError, LossScaler
from ampinit._types import HALF_DTYPES

logger = logging.getLogger("ampinit")

CLOSURE_MESSAGE = "Currently, Amp does not support closure use with optimizers."


@dataclass(frozen=True)
class AmpStats:
    """Counters a logger or lr scheduler can read without touching private state.

    Attributes:
        steps: ``optimizer.step()`` calls on this session's optimizers, taken or skipped.
        skipped_steps: how many of them were skipped because of inf/NaN gradients.
        last_step_skipped: whether the most recent ``optimizer.step()`` call was skipped.
        loss_scales: the current scale of each loss scaler (``loss_id`` order).
        unskipped: clean unscale steps since each scaler's scale last changed (Apex's ``_unskipped``).
    """

    steps: int
    skipped_steps: int
    last_step_skipped: bool
    loss_scales: tuple[float, ...]
    unskipped: tuple[int, ...]


class AmpSession:
    """The state created by one :func:`ampinit.initialize` call.

    Module-level functions (``ampinit.scale_loss``, ``state_dict``, ``disable_casts``...) act on the most
    recent open session, as Apex's global state did; a program with several sessions calls the same methods on
    the session objects (``ampinit.initialize(..., return_session=True)`` or ``ampinit.current_session()``).
    """

    def __init__(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        properties: Properties,
        *,
        num_losses: int = 1,
        cast_model_outputs: torch.dtype | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        verbosity: int = 1,
        cast_policy: CastPolicyName = "apex",
        allow_banned: bool = False,
        sync_free: bool = False,
        skip_nonfinite: bool = True,
    ) -> None:
        self.properties = properties
        self.sync_free = sync_free
        self.skip_nonfinite = skip_nonfinite
        self.cast_policy_name = cast_policy
        self.allow_banned = allow_banned
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.num_losses = num_losses
        self.verbosity = verbosity
        self.closed = False
        self.scalers = [
            LossScaler(_scale_setting(properties, min_loss_scale, max_loss_scale), i) for i in range(num_losses)
        ]
        self._grads: dict[int, OptimizerGrads] = {}
        self._cast_policy: CastPolicy | None = None
        self._undo: list[Callable[[], None]] = []
        self._skip_pending: dict[int, bool] = {}
        self._deferred: dict[int, tuple[LossScaler, set[int]]] = {}
        self._steps = 0
        self._skipped = 0
        self._last_skipped: dict[int, bool | torch.Tensor] = {}
        # Sync-free mode keeps skip decisions and counts on the device.
        self._skip_flags: dict[int, torch.Tensor] = {}
        self._skipped_on_device: torch.Tensor | None = None
        self._last_step_optimizer: int | None = None
        self._overflows = 0
        if properties.enabled:
            try:
                self._apply(cast_model_outputs)
            except BaseException:
                self._run_undo()
                raise
        _registry.register(self, [*self.models, *self.optimizers])
        self._log_properties()

    # -- construction ---------------------------------------------------------------------------------------
    def _apply(self, cast_model_outputs: torch.dtype | None) -> None:
        props = self.properties
        model_dtype = props.model_dtype
        keep_bn = bool(props.keep_batchnorm_fp32)
        # Full-precision values of the weights about to be cast, so that masters start exact. A detached alias
        # suffices: the cast gives the model new storage and leaves this one to the alias.
        planned: dict[int, torch.dtype] = {}
        for model in self.models:
            if model_dtype is not None:
                planned.update(plan(model, model_dtype, keep_bn))
        fp32_values = {
            id(p): p.detach()
            for opt in self.optimizers
            for group in opt.param_groups
            for p in group["params"]
            if planned.get(id(p)) in HALF_DTYPES
        }
        # [remainder hook] master_weights="remainder": bf16 weights plus 16-bit remainders (_remainder_masters).
        grads_type = RemainderGrads if props.remainder_masters else OptimizerGrads
        for opt in self.optimizers:
            grads = self._grads[id(opt)] = grads_type(opt, props.uses_master_weights)
            # Registered before the model cast so that, undoing in reverse, the model weights get their
            # masters' values back before the masters are released.
            self._undo.append(grads.restore_model_params)

        output_dtype = (cast_model_outputs or torch.float32) if model_dtype is not None else cast_model_outputs
        for model in self.models:
            # Masters, and a cast policy's devices, stay where the model was at initialize().
            guard = props.uses_master_weights or props.cast_dtype is not None
            cast = ModelCast(
                model,
                model_dtype,
                keep_bn,
                output_dtype,
                self.master_for,
                guard_device=guard,
                load_master=self._load_remainder_master,  # [remainder hook]
            )
            self._undo.append(functools.partial(cast.undo, self.master_for))
            cast.apply()

        if props.uses_master_weights:
            for opt in self.optimizers:
                self._grads[id(opt)].create_masters(fp32_values)

        for opt in self.optimizers:
            self._wrap_optimizer(opt)

        if props.cast_dtype is not None:
            policy = CastPolicy(
                _device_types(self.models),
                props.cast_dtype,
                policy=self.cast_policy_name,
                allow_banned=self.allow_banned,
            )
            self._cast_policy = policy
            for model in self.models:
                for handle in policy.install_forward_hooks(model):
                    self._undo.append(handle.remove)
            policy.activate()
            self._undo.append(policy.deactivate)

    def _wrap_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Rebind ``step``, ``zero_grad`` and ``add_param_group`` on the instance (recorded for ``close``)."""
        grads = self._grads[id(opt)]
        original_step = opt.step

        @functools.wraps(original_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._step(opt, original_step, args, kwargs)

        self._rebind(opt, "step", step)

        if grads.master_weights:
            original_zero_grad = opt.zero_grad

            @functools.wraps(original_zero_grad)
            def zero_grad(*args: Any, **kwargs: Any) -> None:
                original_zero_grad(*args, **kwargs)
                set_to_none = kwargs.get("set_to_none", args[0] if args else True)
                grads.zero_model_grads(bool(set_to_none))

            self._rebind(opt, "zero_grad", zero_grad)

        original_add = opt.add_param_group

        @functools.wraps(original_add)
        def add_param_group(param_group: dict[str, Any]) -> None:
            original_add(param_group)
            grads.add_param_group(opt.param_groups[-1])

        self._rebind(opt, "add_param_group", add_param_group)

    def _rebind(self, obj: object, name: str, replacement: Callable[..., Any]) -> None:
        had_own = name in vars(obj)
        previous = vars(obj).get(name)
        setattr(obj, name, replacement)

        def restore() -> None:
            if had_own:
                setattr(obj, name, previous)
            elif vars(obj).get(name) is replacement:
                delattr(obj, name)

        self._undo.append(restore)

    def _log_properties(self) -> None:
        if self.verbosity < 1 or not self.properties.enabled:
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
        self.closed = True
        try:
            self._run_undo()
        finally:
            _registry.unregister(self)

    def _run_undo(self) -> None:
        errors: list[BaseException] = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as err:  # keep undoing the rest; report the first failure
                errors.append(err)
        if errors:
            raise errors[0]

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
        for grads in self._grads.values():
            master = grads.master_for(param)
            if master is not None:
                return master
        return None

    def _load_remainder_master(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """[remainder hook] Split a loaded fp32 master; the bf16 weight torch should load, or None."""
        for grads in self._grads.values():
            if isinstance(grads, RemainderGrads):
                weight = grads.load_master(param, value)
                if weight is not None:
                    return weight
        return None

    def _grads_of(self, optimizers: object) -> list[OptimizerGrads]:
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        result = []
        for opt in opts:
            grads = self._grads.get(id(opt))
            if grads is None or grads.optimizer is not opt:
                if self.enabled:
                    raise RuntimeError(
                        f"{type(opt).__name__} {id(opt):#x} was not passed to amp.initialize() for this session: "
                        "pass every optimizer used with scale_loss to initialize."
                    )
                continue
            result.append(grads)
        return result

    # -- scale_loss -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Any,
        loss_id: int = 0,
        model: nn.Module | None = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """See :func:`ampinit.scale_loss`."""
        self._check_open()
        states = self._grads_of(optimizers)
        if not self.enabled:
            yield loss
            return
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < self.num_losses:
            raise IndexError(
                f"loss_id={loss_id!r} is out of range: initialize() was called with num_losses={self.num_losses}, "
                f"so loss_id must be an int in [0, {self.num_losses})"
            )
        scaler = self.scalers[loss_id]
        if self.properties.short_circuits and not self.skip_nonfinite:
            # Apex's short cut (no masters, static scale 1): grads are neither scaled nor checked.
            try:
                with self.disable_casts():
                    yield loss.float()
            finally:
                self._clear_cast_cache()
            return

        for state in states:
            if not state.has_scaled_grads:
                state.prepare_backward()
        scaled = scaler.scale(loss)
        completed = False
        try:
            with self.disable_casts():
                yield scaled
            completed = True
        finally:
            if not completed:
                for state in states:
                    state.abort_backward()
            self._clear_cast_cache()

        if delay_unscale:
            for state in states:
                state.has_scaled_grads = True
            return
        if id(scaler) not in self._deferred:
            scaler.clear_overflow()
        for state in states:
            state.post_backward(scaler)
        if delay_overflow_check:
            _, waiting = self._deferred.setdefault(id(scaler), (scaler, set()))
            waiting.update(id(s.optimizer) for s in states)
            return
        self._decide(scaler, [id(s.optimizer) for s in states])

    def _decide(self, scaler: LossScaler, optimizer_ids: Sequence[int]) -> None:
        """Update the scale from this unscale step's overflow flag and mark the optimizers' next steps to skip.

        By default the flag is read on the host here (the step's one sync), so the skip is a plain branch and
        the overflow can be logged. In sync-free mode it stays on the device and reaches the optimizer's own
        kernel (see :meth:`_step`).
        """
        if scaler.config is None and not self.skip_nonfinite:
            scaler.clear_overflow()  # Apex: a static scale never skips, and counts every unscale step as clean
        agree_on_overflow_(scaler.found_inf)
        if self.sync_free:
            scaler.update()
            for opt_id in optimizer_ids:
                flag = self._skip_flags.get(opt_id)
                if flag is None:
                    self._skip_flags[opt_id] = scaler.found_inf.clone()
                else:
                    torch.maximum(flag, scaler.found_inf, out=flag)
            return
        overflow = bool(scaler.found_inf.item())
        if overflow and scaler.config is not None and scaler.config.raise_at_min and scaler.at_minimum():
            raise LossScaleAtMinimumError(
                f"Gradient overflow with loss scaler {scaler.loss_id} already at its minimum loss scale "
                f"{scaler.loss_scale()} (min_scale={scaler.config.min_scale}): training cannot make progress."
            )
        before = scaler.loss_scale() if overflow else 0.0
        scaler.update()
        if not overflow:
            return
        for opt_id in optimizer_ids:
            self._skip_pending[opt_id] = True
        self._log_overflow(scaler, before)

    def _log_overflow(self, scaler: LossScaler, before: float) -> None:
        self._overflows += 1
        n = self._overflows
        # Rate limit without clocks (deterministic): the first 8 overflows, then every power of two.
        if self.verbosity < 1 or (n > 8 and n & (n - 1)):
            return
        after = scaler.loss_scale()
        change = f"reducing loss scale to {after}" if after != before else f"keeping loss scale at {after}"
        suffix = "" if n <= 8 else f" ({n} overflows so far; further messages are thinned out)"
        logger.info("Gradient overflow.  Skipping step, loss scaler %d %s%s", scaler.loss_id, change, suffix)

    # -- optimizer.step -------------------------------------------------------------------------------------
    def _step(
        self,
        opt: torch.optim.Optimizer,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        grads = self._grads[id(opt)]
        closure = kwargs.get("closure", args[0] if args else None)
        if grads.has_scaled_grads:
            raise RuntimeError(
                "optimizer.step() was called while gradients are still scaled: the last scale_loss(...) block "
                "for this optimizer had delay_unscale=True. End the accumulation with a block without "
                "delay_unscale before stepping."
            )
        for key, (scaler, waiting) in list(self._deferred.items()):
            if id(opt) in waiting:
                del self._deferred[key]
                self._decide(scaler, sorted(waiting))
        skip = self._skip_pending.pop(id(opt), False)
        flag = self._skip_flags.pop(id(opt), None)
        if flag is not None and (closure is not None or not _skips_on_device(opt)):
            skip, flag = bool(flag.item()), None  # this optimizer cannot skip by itself: one host sync
        if (skip or grads.master_weights) and closure is not None:
            raise RuntimeError(CLOSURE_MESSAGE)
        if not skip and grads.master_weights and grads.untransferred_grads():
            raise RuntimeError(
                "The model has gradients that never reached the fp32 master weights: with master weights "
                "(O2/O5), call backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`."
            )
        result = None
        fused = False
        if not skip:
            with self.disable_casts():
                fused = closure is None and grads.fused_step(original, flag)
                if not fused:
                    result = (
                        original(*args, **kwargs)
                        if flag is None
                        else _step_with_flag(opt, original, flag, args, kwargs)
                    )
        # After a skip decided on the device the masters are unchanged, so copying them back is harmless.
        grads.after_step(stepped=not skip, weights_written=fused)
        self._clear_cast_cache()
        self._steps += 1
        self._last_step_optimizer = id(opt)
        if flag is None:
            self._skipped += int(skip)
            self._last_skipped[id(opt)] = skip
        else:
            self._skipped_on_device = flag if self._skipped_on_device is None else self._skipped_on_device + flag
            self._last_skipped[id(opt)] = flag
        return result

    # -- casts ------------------------------------------------------------------------------------------------
    def disable_casts(self) -> contextlib.AbstractContextManager[None]:
        """A region where the O1/O4 cast policy does not apply (a no-op at other levels)."""
        if self._cast_policy is None or not self._cast_policy.active:
            return contextlib.nullcontext()
        return self._cast_policy.suspended()

    def _clear_cast_cache(self) -> None:
        if self._cast_policy is not None:
            self._cast_policy.clear_cache()

    # -- public state ---------------------------------------------------------------------------------------
    def step_was_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether the last ``step()`` of ``optimizer`` (default: the last step of any optimizer) was skipped."""
        key = self._last_step_optimizer if optimizer is None else id(optimizer)
        skipped = False if key is None else self._last_skipped.get(key, False)
        return bool(skipped.item()) if isinstance(skipped, torch.Tensor) else skipped

    def stats(self) -> AmpStats:
        return AmpStats(
            steps=self._steps,
            skipped_steps=self._skipped
            + (0 if self._skipped_on_device is None else int(self._skipped_on_device.item())),
            last_step_skipped=self.step_was_skipped(),
            loss_scales=tuple(s.loss_scale() for s in self.scalers),
            unskipped=tuple(s.unskipped() for s in self.scalers),
        )

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apex's amp state: ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``."""
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        if not self.enabled:
            return out
        for index, scaler in enumerate(self.scalers):
            out[f"loss_scaler{index}"] = scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output, following Apex's rules (entries are matched by position)."""
        if not self.enabled:
            return
        if len(state_dict) != len(self.scalers):
            warnings.warn(
                f"state_dict contains {len(state_dict)} entries, while {len(self.scalers)} loss_scalers are used",
                stacklevel=3,
            )
        unexpected = [key for key in state_dict if "loss_scaler" not in key]
        if unexpected:
            raise RuntimeError(
                "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                + ", ".join(f'"{k}"' for k in unexpected)
                + ". "
            )
        entries = [state_dict[key] for key in state_dict if "loss_scaler" in key]
        if len(entries) > len(self.scalers):
            warnings.warn(
                f"Skipping loss_scaler[{len(self.scalers)}], since num_losses was set to {len(self.scalers)}",
                stacklevel=3,
            )
        for scaler, entry in zip(self.scalers, entries):
            scaler.load_state_dict(entry)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"AmpSession(opt_level={self.properties.opt_level!r}, enabled={self.enabled}, models={len(self.models)}, "
            f"optimizers={len(self.optimizers)}, num_losses={self.num_losses}, {state})"
        )


def _scale_setting(
    properties: Properties, min_loss_scale: float | None, max_loss_scale: float
) -> float | DynamicLossScale:
    setting = properties.loss_scale
    if isinstance(setting, DynamicLossScale):
        return setting
    if setting == "dynamic":
        return DynamicLossScale(min_scale=min_loss_scale or None, max_scale=max_loss_scale)
    return float(setting)


def _skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` can skip by itself from a device ``found_inf`` (torch's AMP-scaling protocol)."""
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return False
    if isinstance(opt, torch.optim.SGD):
        # torch's fused SGD creates momentum buffers with empty_like on its first step, even when found_inf
        # skips that step; the garbage is then used as momentum. Until every buffer exists, decide on the host.
        return all(
            group["momentum"] == 0 or all("momentum_buffer" in opt.state.get(p, {}) for p in group["params"])
            for group in opt.param_groups
        )
    return True


def _step_with_flag(
    opt: torch.optim.Optimizer, original: Callable[..., Any], flag: torch.Tensor, args: tuple[Any, ...], kwargs: Any
) -> Any:
    """Run a step that the optimizer itself skips when ``flag`` is nonzero (grads are already unscaled)."""
    had_scale = "grad_scale" in vars(opt)
    saved_scale = vars(opt).get("grad_scale")
    # torch's fused kernels take a 0-d flag.
    opt.found_inf = flag.reshape(())  # type: ignore[attr-defined]
    opt.grad_scale = None  # type: ignore[attr-defined]
    try:
        return original(*args, **kwargs)
    finally:
        del opt.found_inf  # type: ignore[attr-defined]
        if had_scale:
            opt.grad_scale = saved_scale  # type: ignore[attr-defined]
        else:
            del opt.grad_scale  # type: ignore[attr-defined]


def _device_types(models: Sequence[nn.Module]) -> list[str]:
    types = {t.device.type for m in models for t in (*m.parameters(), *m.buffers())}
    return sorted(types) or ["cpu"]
