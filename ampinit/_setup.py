"""What ``initialize`` changes on models and optimizers, each change pushed on an undo stack as it is made.

The order is the one undoing must reverse: masters are released only after the model weights got their values
back; the model is cast before the masters are created (from the fp32 values the weights had before the cast);
the optimizers' methods are rebound next, and the O1/O4 cast policy is switched on last.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampinit._casting import CastPolicy
from ampinit._masters import RemainderGrads, StateStore, moments_for_own_step
from ampinit._model_cast import MasterLoader, MasterLookup, ModelCast, plan
from ampinit._opt_levels import Properties
from ampinit._optimizer_record import OptimizerRecord
from ampinit._options import AmpOptions
from ampinit._types import HALF_DTYPES
from ampinit._undo import UndoStack


def install(
    models: Sequence[nn.Module],
    records: Sequence[OptimizerRecord],
    options: AmpOptions,
    undo: UndoStack,
    master_for: MasterLookup,
    make_step: Callable[[OptimizerRecord], Callable[..., Any]],
) -> CastPolicy | None:
    """Cast the models, give the optimizers their masters and amp's ``step``; return the O1/O4 cast policy."""
    props = options.properties
    planned = planned_dtypes(models, props)
    if not props.uses_master_weights:
        # Warned before anything changes: where warnings are errors (``-W error``, pytest's filterwarnings), the
        # raise must not leave weights cast and cast back without masters, which rounds them to fp16.
        _warn_of_a_vanishing_eps(records, planned)
    fp32_values = _values_before_cast(records, planned)
    for record in records:
        # Run last: once the parameters are the model's again, their moments in the layout the optimizer's own
        # step reads (the dial's bf16 and 8-bit moments decoded, fp32 ones in a bf16 model's dtype).
        undo.push(functools.partial(moments_for_own_step, record.optimizer))
        undo.push(record.grads.restore_model_params)
    _cast_models(models, options, undo, master_for, _remainder_loader(records))
    for record in records:
        if props.uses_master_weights:
            record.grads.create_masters(fp32_values)
            if record.dial.exact:
                # Today's exact classes store fp32 moments; a checkpoint of any dial setting loads into them decoded.
                undo.push(StateStore(record.optimizer, record.dial).remove)
        else:
            # The optimizer steps its own parameters: another setting's 8-bit moments load decoded into them.
            undo.push(StateStore(record.optimizer, record.dial, own_step=True).remove)
        undo.rebind(record.optimizer, "step", make_step(record))
        others = [r for r in records if r is not record]
        record.rebind_grad_methods(undo, functools.partial(_trained_by_any, others))
    if props.cast_dtype is None:
        return None
    return _activate_cast_policy(models, props.cast_dtype, options, undo)


def _trained_by_any(records: Sequence[OptimizerRecord], param: torch.Tensor) -> bool:
    return any(record.grads.trains(param) for record in records)


def _warn_of_a_vanishing_eps(records: Sequence[OptimizerRecord], planned: dict[int, torch.dtype]) -> None:
    """Warn where an optimizer steps fp16 parameters itself (no masters: O3, ``master_weights=False``) with an
    ``eps`` that fp16 cannot hold: Adam's 1e-8 rounds to 0, so where a gradient's square underflows too, the update
    divides by zero and the first step writes inf/NaN into the weights (docs/faq.md, "O3 gives NaN")."""
    for record in records:
        for index, group in enumerate(record.optimizer.param_groups):
            eps = group.get("eps")
            if not isinstance(eps, float) or not eps > 0.0 or float(torch.tensor(eps, dtype=torch.float16)) != 0.0:
                continue
            if any(planned.get(id(p), p.dtype) == torch.float16 for p in group["params"]):
                warnings.warn(
                    f"{type(record.optimizer).__name__}'s param group {index} steps float16 parameters without fp32 "
                    f"master weights, with eps={eps!r}, which is 0 in float16: where a gradient's square underflows, "
                    "its update divides by zero and writes inf/NaN into the weights. Use opt_level='O2' (fp32 "
                    "master weights), or eps >= 1e-4 (docs/faq.md).",
                    UserWarning,
                    stacklevel=5,  # initialize's caller: _setup.install <- AmpSession <- initialize
                )
                break


def planned_dtypes(models: Sequence[nn.Module], props: Properties) -> dict[int, torch.dtype]:
    """The dtype each parameter and buffer (by ``id``) that the model cast converts will have."""
    planned: dict[int, torch.dtype] = {}
    if props.model_dtype is not None:
        for model in models:
            planned.update(plan(model, props.model_dtype, bool(props.keep_batchnorm_fp32)))
    return planned


def _values_before_cast(records: Sequence[OptimizerRecord], planned: dict[int, torch.dtype]) -> dict[int, torch.Tensor]:
    """The full-precision values of the weights about to be cast, so that masters start exact.

    A detached alias suffices: the cast gives the model new storage and leaves this one to the alias.
    """
    params = (p for r in records for group in r.optimizer.param_groups for p in group["params"])
    return {id(p): p.detach() for p in params if planned.get(id(p)) in HALF_DTYPES}


def _remainder_loader(records: Sequence[OptimizerRecord]) -> MasterLoader | None:
    """For remainder masters: split a loaded fp32 master, returning the bf16 weight torch should load instead."""
    owners = [r.grads for r in records if isinstance(r.grads, RemainderGrads)]
    if not owners:
        return None

    def load(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        for grads in owners:
            weight = grads.load_master(param, value)
            if weight is not None:
                return weight
        return None

    return load


def _cast_models(
    models: Sequence[nn.Module],
    options: AmpOptions,
    undo: UndoStack,
    master_for: MasterLookup,
    load_master: MasterLoader | None,
) -> None:
    props = options.properties
    outputs = options.cast_model_outputs
    output_dtype = (outputs or torch.float32) if props.model_dtype is not None else outputs
    keep_bn = bool(props.keep_batchnorm_fp32)
    # Masters, and a cast policy's devices, stay where the model was at initialize().
    guard = props.uses_master_weights or props.cast_dtype is not None
    for model in models:
        cast = ModelCast(
            model, props.model_dtype, keep_bn, output_dtype, master_for, guard_device=guard, load_master=load_master
        )
        undo.push(functools.partial(cast.undo, master_for))
        cast.apply()


def _activate_cast_policy(
    models: Sequence[nn.Module], dtype: torch.dtype, options: AmpOptions, undo: UndoStack
) -> CastPolicy:
    policy = CastPolicy(_device_types(models), dtype, policy=options.cast_policy, allow_banned=options.allow_banned)
    for model in models:
        for handle in policy.install_forward_hooks(model):
            undo.push(handle.remove)
    policy.activate()
    undo.push(policy.deactivate)
    return policy


def _device_types(models: Sequence[nn.Module]) -> list[str]:
    types = {t.device.type for m in models for t in (*m.parameters(), *m.buffers())}
    return sorted(types) or ["cpu"]
