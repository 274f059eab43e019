"""Checkpoints of other libraries, turned into what an ampinit session loads.

Transformer Engine's ``FusedAdam(master_weights=True, store_param_remainders=True)`` and Megatron-LM's
distributed optimizer on top of it keep each bf16 parameter's fp32 master as the bf16 weight plus 16 low bits
in an int16 tensor. Their checkpoints hold those int16 tensors, not fp32 masters. The functions here rebuild the
fp32 masters bit for bit and return

- a model ``state_dict`` with the fp32 masters, which ``model.load_state_dict`` takes at every ``master_weights``
  setting (the masters arrive exactly at ``True`` and ``"remainder"``), and
- an optimizer ``state_dict`` in torch's Adam/AdamW layout (``step``, ``exp_avg``, ``exp_avg_sq`` per
  parameter), which ``optimizer.load_state_dict`` takes at every ``optimizer_state`` setting.

The layouts, as read in the sources (docs/precision.md cites them):

Transformer Engine (``transformer_engine/pytorch/optimizers/fused_adam.py`` and the kernel
``AdamFunctorMasterParamRemainder`` in ``transformer_engine/common/multi_tensor/adam.cu``): an fp32 master's bits
are split into the high half ``hi`` and the low half ``lo``, both read as int16; the remainder is ``lo`` and the
bf16 weight is ``hi``, plus one when ``lo`` is negative (the upper half rounded half up: on the magnitude, round
to nearest, ties away from zero). The master is rebuilt as ``hi = weight - (lo < 0)``, bits ``hi:lo``. The
optimizer's ``state_dict()`` keeps the int16 remainder under ``state[i]["master_param"]`` (fp32 when remainders
are off), converts ``exp_avg``/``exp_avg_sq`` to fp32 whatever their stored dtype, and keeps a single step count
per param group, ``param_groups[g]["step"]``, beside ``bias_correction``. Whether it ran as AdamW or Adam
(``adam_w_mode``) is an attribute of the optimizer and is not saved.

Megatron-LM (``megatron/core/optimizer/distrib_optimizer.py``): with ``use_precision_aware_optimizer`` and
``store_param_remainders`` (the default since TE 2.1) the master is TE's int16 remainder, saved under
``"fp32_param"`` (``fully_sharded_model_space``) or ``"param"`` (the other layouts) despite the name, per
parameter beside ``exp_avg``/``exp_avg_sq``; without the precision-aware optimizer Megatron keeps real fp32
masters there. Its ``dp_zero`` save path copies the int16 remainders into fp32 buffers, so that format holds
the remainders as integer-valued floats (Megatron-LM PR #4222). The saved state is the flattened shard of each
parameter; :func:`from_megatron` takes the state gathered per parameter (as ``dist_checkpointing.load`` gives it
in model space), flat or in the parameter's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["from_megatron", "from_transformer_engine"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1
_INT32_MAX = 2**31 - 1


def from_transformer_engine(
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    param_names: Sequence[str] | None = None,
    *,
    adam_w_mode: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(model_state, optimizer_state)`` for an ampinit session, from a Transformer Engine ``FusedAdam`` checkpoint.

    ``model_state`` is the model's ``state_dict()`` (bf16 weights), ``optimizer_state`` the ``FusedAdam``'s
    ``state_dict()``. ``param_names`` are the ``model_state`` keys of the optimizer's parameters, in the order of
    its param groups; without them, the groups' ``"param_names"`` (torch's optimizers given named parameters)
    are used. ``adam_w_mode`` is what the ``FusedAdam`` was built with (its default ``True``), which the
    checkpoint does not record: it becomes the groups' ``decoupled_weight_decay``, honoured by
    ``torch.optim.Adam``; ``torch.optim.AdamW`` always decouples.

    Masters stored as int16 remainders are rebuilt exactly; fp32 ``master_param`` entries (remainders off) are
    taken as they are; a parameter without a ``master_param`` (``master_weights=False``) gets its weight in fp32.
    The returned dicts share no tensors with the inputs. Raises ``ValueError`` for a key, dtype or shape that does
    not fit the layout (nothing is returned half-converted), ``TypeError`` for a non-mapping argument.
    """
    _check_mapping("model_state", model_state)
    _check_mapping("optimizer_state", optimizer_state)
    for key in ("state", "param_groups"):
        if key not in optimizer_state:
            raise ValueError(
                f"optimizer_state has no {key!r}: expected an optimizer state_dict() with 'state' and "
                f"'param_groups', got keys {sorted(map(str, optimizer_state))}"
            )
    groups: list[dict[str, Any]] = list(optimizer_state["param_groups"])
    ids = [i for group in groups for i in group["params"]]
    names = _param_names(param_names, groups, len(ids), model_state)

    masters = {
        name: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for name, value in model_state.items()
    }
    state: dict[int, dict[str, Any]] = {}
    for group_index, group in enumerate(groups):
        if group.get("bias_correction", True) is not True:
            raise ValueError(
                f"param_groups[{group_index}] has bias_correction={group['bias_correction']!r}: torch's Adam and "
                "AdamW always correct the moments' bias, so only bias_correction=True checkpoints convert"
            )
    steps = {i: group.get("step") for group in groups for i in group["params"]}
    for saved_id, name in zip(ids, names):
        weight = model_state[name]
        entry = optimizer_state["state"].get(saved_id)
        where = f"optimizer_state['state'][{saved_id!r}] (model key {name!r})"
        masters[name] = _master(weight, None if entry is None else entry.get("master_param"), where)
        if entry is None:
            continue
        step = steps[saved_id]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(
                f"{where} has state but its param group's 'step' is {step!r}: expected FusedAdam's step count, "
                "a non-negative int"
            )
        state[saved_id] = {"step": torch.tensor(float(step))}
        for key in MOMENTS:
            state[saved_id][key] = _moment(entry, key, weight, where)

    torch_groups = []
    for group in groups:
        converted = {k: v for k, v in group.items() if k not in ("step", "bias_correction")}
        converted["decoupled_weight_decay"] = adam_w_mode
        converted["params"] = list(group["params"])
        torch_groups.append(converted)
    return masters, {"state": state, "param_groups": torch_groups}


def from_megatron(
    model_state: Mapping[str, torch.Tensor],
    param_state: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    step: int,
    param_groups: Sequence[Mapping[str, Any]],
    param_names: Sequence[str],
    remainders: bool,
    adam_w_mode: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(model_state, optimizer_state)`` for an ampinit session, from Megatron-LM distributed-optimizer state.

    ``param_state`` maps a ``model_state`` key to that parameter's saved state, gathered over the data-parallel
    shards: the master under ``"fp32_param"`` or ``"param"``, and ``"exp_avg"``/``"exp_avg_sq"``, flat or in the
    parameter's shape. ``remainders`` is Megatron's ``store_param_remainders`` as the run used it (with
    ``use_precision_aware_optimizer`` on a bf16 model): the checkpoint does not say whether an fp32 tensor there
    holds masters or integer-valued remainders (the ``dp_zero`` format), so it is not guessed. ``step`` is the
    optimizer's step count (Megatron's saved ``param_groups[g]["step"]``). ``param_groups`` are the groups of the
    torch optimizer the result is loaded into (``optimizer.state_dict()["param_groups"]``: Megatron's own groups
    carry its scheduler's keys instead), and ``param_names`` the ``model_state`` keys of that optimizer's
    parameters in the order of those groups; a parameter missing from ``param_state`` gets no optimizer state.
    ``adam_w_mode`` is Megatron's ``decoupled_weight_decay`` (its default ``True``), which Megatron passes to
    ``FusedAdam`` as ``adam_w_mode`` and does not save: it becomes the groups' ``decoupled_weight_decay``, as in
    :func:`from_transformer_engine`.

    Raises ``ValueError`` for a key, dtype, shape or remainder value that does not fit, naming it.
    """
    _check_mapping("model_state", model_state)
    _check_mapping("param_state", param_state)
    groups = [dict(group) for group in param_groups]
    ids = [i for group in groups for i in group["params"]]
    if len(param_names) != len(ids):
        raise ValueError(
            f"param_names has {len(param_names)} names but param_groups hold {len(ids)} parameters: one name per "
            "parameter, in the groups' order"
        )
    entries: dict[Any, dict[str, torch.Tensor]] = {}
    for saved_id, name in zip(ids, param_names):
        saved = param_state.get(name)
        if saved is None:
            continue
        if name not in model_state:
            raise ValueError(f"param_state has {name!r}, which is not a key of model_state")
        weight = model_state[name]
        where = f"param_state[{name!r}]"
        master_keys = [k for k in ("fp32_param", "param") if k in saved]
        if len(master_keys) != 1:
            raise ValueError(
                f"{where} needs exactly one of 'fp32_param' or 'param' (the master), got keys {sorted(saved)}"
            )
        master = _shaped(saved[master_keys[0]], weight, f"{where}[{master_keys[0]!r}]")
        if remainders:
            master = _as_int16(master, weight, f"{where}[{master_keys[0]!r}]")
        entry = {"master_param": master}
        for key in MOMENTS:
            if key not in saved:
                raise ValueError(f"{where} has no {key!r}: Adam's moments are needed, got keys {sorted(saved)}")
            entry[key] = _shaped(saved[key], weight, f"{where}[{key!r}]")
        entries[saved_id] = entry
    for group in groups:
        group["step"] = step
        group["bias_correction"] = True
    return from_transformer_engine(
        model_state, {"state": entries, "param_groups": groups}, list(param_names), adam_w_mode=adam_w_mode
    )


def _check_mapping(what: str, value: object) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping (a state_dict), got {type(value).__name__}")


def _param_names(
    given: Sequence[str] | None, groups: list[dict[str, Any]], count: int, model_state: Mapping[str, torch.Tensor]
) -> list[str]:
    if given is None:
        if not all("param_names" in group for group in groups):
            raise ValueError(
                "param_names is needed: the optimizer state's param groups do not name their parameters; pass the "
                "model_state keys of the optimizer's parameters, in the order of its param groups"
            )
        given = [name for group in groups for name in group["param_names"]]
    names = list(given)
    if len(names) != count:
        raise ValueError(
            f"param_names has {len(names)} names but the optimizer state's param groups hold {count} parameters: "
            "one name per parameter, in the groups' order"
        )
    for position, name in enumerate(names):
        if name not in model_state:
            raise ValueError(f"param_names[{position}] is {name!r}, which is not a key of model_state")
    return names


def _master(weight: torch.Tensor, stored: object, where: str) -> torch.Tensor:
    if stored is None:
        return weight.detach().float() if weight.is_floating_point() else weight.detach().clone()
    if not isinstance(stored, torch.Tensor):
        raise ValueError(f"{where}['master_param'] is a {type(stored).__name__}: expected an int16 or fp32 tensor")
    if stored.shape != weight.shape:
        raise ValueError(
            f"{where}['master_param'] has shape {tuple(stored.shape)}, its parameter {tuple(weight.shape)}"
        )
    if stored.dtype == torch.float32:
        return stored.detach().clone()
    if stored.dtype != torch.int16:
        raise ValueError(f"{where}['master_param'] is {stored.dtype}: expected int16 remainders or an fp32 master")
    if weight.dtype != torch.bfloat16:
        raise ValueError(
            f"{where}['master_param'] holds int16 remainders but its parameter is {weight.dtype}: remainders "
            "complete bfloat16 weights only"
        )
    return _join_remainder(weight, stored)


def _join_remainder(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``weight`` and Transformer Engine's int16 ``remainder``, bit for bit.

    TE undoes its rounding (``hi = weight - 1`` where the remainder is negative) and concatenates ``hi:lo``; that
    is ``(weight << 16) + remainder`` modulo 2**32, computed here in int64 so that no step can overflow (a NaN
    master 0x7FFF8000.. is stored with the weight 0x8000).
    """
    bits = weight.detach().contiguous().view(torch.int16).to(torch.int64).bitwise_left_shift(16)
    bits += remainder.detach().to(device=bits.device, dtype=torch.int64)
    bits.bitwise_and_(0xFFFFFFFF)
    bits = torch.where(bits > _INT32_MAX, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _moment(entry: Mapping[str, Any], key: str, weight: torch.Tensor, where: str) -> torch.Tensor:
    value = entry.get(key)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} has no tensor {key!r}: Adam's moments are needed, got keys {sorted(entry)}")
    if value.dtype != torch.float32:
        raise ValueError(
            f"{where}[{key!r}] is {value.dtype}: FusedAdam's state_dict() saves its moments in float32 whatever it "
            "stores, so another dtype is not its layout"
        )
    if value.shape != weight.shape:
        raise ValueError(f"{where}[{key!r}] has shape {tuple(value.shape)}, its parameter {tuple(weight.shape)}")
    return value.detach().clone()


def _shaped(value: object, weight: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}: expected a tensor")
    if value.shape == weight.shape:
        return value
    if value.dim() == 1 and value.numel() == weight.numel():
        return value.reshape(weight.shape)
    raise ValueError(
        f"{where} has shape {tuple(value.shape)}: expected its parameter's {tuple(weight.shape)} or "
        f"{weight.numel()} elements flat"
    )


def _as_int16(value: torch.Tensor, weight: torch.Tensor, where: str) -> torch.Tensor:
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"{where}: remainders=True but the parameter is {weight.dtype}, not bfloat16")
    if value.dtype == torch.int16:
        return value
    if value.dtype != torch.float32:
        raise ValueError(f"{where} is {value.dtype}: remainders are int16, or float32 in the dp_zero format")
    bad = (value != value.round()) | (value < _INT16_MIN) | (value > _INT16_MAX)
    if bool(bad.any()):
        first = value[bad].flatten()[0].item()
        raise ValueError(
            f"{where} holds {first!r}, which is no int16 remainder (integers in [{_INT16_MIN}, {_INT16_MAX}]): "
            "was the run saved with store_param_remainders=False? Then pass remainders=False"
        )
    return value.to(torch.int16)
