"""``master_weights="remainder"``: one optimizer's bf16 weights plus int16 remainders as its fp32 masters.

The optimizer keeps the model's bf16 parameters in its param groups (no fp32 master tensors exist between steps)
and its state in torch's layout, fp32 (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``). The low 16
bits of each master live here, one int16 tensor per bf16 parameter; ``ampinit._masters.remainder`` defines the
encoding. Gradients stay the model's bf16 grads, unscaled in place by the loss scaler. A step, per chunk of
parameters of at most ``CHUNK_ELEMENTS`` elements (so the fp32 temporaries stay small): join each master, widen
its grad, run the optimizer's own update on them (torch's functional ``adam``/``sgd`` with the group's flags, or
the optimizer's ``MasterUpdate``, ``ampinit._masters.update``), split the masters back into weight and remainder.
The result is bitwise the result of the same optimizer on fp32 masters, with the bf16 copy rounded ties-away (the
remainder tie rule).

On CUDA (or on CPU under Triton's interpreter, for the tests), ``torch.optim.Adam/AdamW/SGD(fused=True)`` take
ampinit's kernels instead (``triton_kernels.adam_``/``sgd_`` on ``Masters.remainder``): one launch per
list that reads the bf16 grad, weight and remainder, and writes weight, remainder and state.

Checkpoints use the fp32-master format: ``model.state_dict()`` reports the joined masters (``master_for``), an
fp32 value loaded into the model is split into weight and remainder (``load_master``), and the optimizer's
``state_dict`` is torch's own, with fp32 state that loading keeps in fp32.

Until the first backward or step the masters follow the model as fp32 masters do (``OptimizerGrads``): a bf16
weight written since ``initialize`` (a DDP broadcast) gets a zero remainder, so that its master is the weight's
value, unless the weight still holds what ``load_master`` split off a loaded master.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update
from torch.utils.hooks import RemovableHandle

from ampinit._masters import clip, kernel_step
from ampinit._masters import remainder as encoding
from ampinit._masters.grads import OptimizerGrads
from ampinit._masters.kernel_step import adam_state
from ampinit._masters.reference import Masters
from ampinit._masters.update import MasterChunk, own_update, remainder_update
from ampinit._scaler import LossScaler

#: The largest number of elements joined into fp32 at once in a step (4 MiB of masters, as much of grads).
CHUNK_ELEMENTS = 1 << 20


class RemainderGrads(OptimizerGrads):
    """The amp-side state of one optimizer whose masters are bf16 weights plus int16 remainders.

    The gradient flow is the one without masters (bf16 grads on the parameters, unscaled in place), so
    ``OptimizerGrads``'s pairs stay empty; ``master_weights`` is true so that the session refuses closures and
    always asks :meth:`step_in_amp_kernels` to take the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool = True) -> None:
        # ``master_weights`` is accepted for OptimizerGrads's signature (the session builds either class with
        # the same arguments); remainder masters are always masters.
        update = remainder_update(optimizer)  # refused before anything is built
        super().__init__(optimizer, master_weights=True)
        self.update = update
        self._own_update = own_update(optimizer)
        self._remainders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, remainder)
        self._handles: list[RemovableHandle] = []
        self._loading: dict[str, Any] | None = None
        # Until the first backward or step: the bf16 weights load_master split off loaded masters, by param id.
        self._loaded_weights: dict[int, torch.Tensor] = {}
        # amp.master_params' fp32 masters, by param id, with the grad and versions they were made from.
        self._materialised: dict[int, _Materialised] = {}
        # What the step multiplies the bf16 grads of parameters with a remainder by (amp.clip_grad_norm_), if
        # anything; until the next backward or the end of the step.
        self._grad_factor: torch.Tensor | None = None

    # -- masters --------------------------------------------------------------------------------------------
    def create_masters(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Give every trainable bf16 parameter its remainder, from its fp32 value before the cast if known.

        The weight is rewritten with the tie rule, so weight and remainder hold that fp32 value exactly.
        """
        for group in self.optimizer.param_groups:
            self._add_group(group, fp32_values or {})
        self._handles.append(self.optimizer.register_load_state_dict_pre_hook(self._remember_loaded))
        self._handles.append(self.optimizer.register_load_state_dict_post_hook(self._keep_state_fp32))

    def _add_group(self, group: dict[str, Any], fp32_values: dict[int, torch.Tensor]) -> None:
        # A parameter listed twice gets one storage (torch warns of duplicates in a group; it does not refuse them).
        new = {
            id(p): p
            for p in group["params"]
            if id(p) not in self._remainders and p.requires_grad and p.dtype == torch.bfloat16
        }
        params = list(new.values())
        with torch.no_grad():
            # All storages first, in shared buffers (encoding.new_storages), then one fp32 master at a time.
            for param, storage in zip(params, self._new_storages(params)):
                source = fp32_values.get(id(param), param)
                master = source.detach().to(device=param.device, dtype=torch.float32, copy=True)
                self._store_first(param, master, storage)
                self._remainders[id(param)] = (param, storage)
                self._note_agreement(id(param), param, storage)

    def _new_storages(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where the bits of each master beyond its bf16 weight live: int16 remainders, packed."""
        return encoding.new_storages(params, encoding.REMAINDER_DTYPE)

    def _store_first(self, param: torch.Tensor, master: torch.Tensor, storage: torch.Tensor) -> None:
        """Write the fp32 ``master`` into ``param`` and its ``storage`` (the tie rule: they hold it exactly)."""
        encoding.split_(master, param.detach(), storage)

    def add_param_group(self, group: dict[str, Any]) -> None:
        self._add_group(group, {})

    def adopt_trainable(self) -> None:
        """Remainders for bf16 parameters frozen at initialize that have started training since (see the base)."""
        for group in self.optimizer.param_groups:
            self._add_group(group, {})

    def master_for(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of ``param``, joined (a new tensor: writing into it changes nothing)."""
        entry = self._remainders.get(id(param))
        if entry is None:
            return None
        if self._agreed is not None:
            self._follow(id(param))
        return encoding.join(param.detach(), entry[1])

    def load_master(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """Take ``value`` as ``param``'s master: store its remainder, return the bf16 weight to load (or None)."""
        entry = self._remainders.get(id(param))
        if entry is None or value.shape != param.shape:
            return None
        weight, remainder = encoding.split(value.detach().to(device=param.device, dtype=torch.float32))
        entry[1].copy_(remainder)
        if self._agreed is not None:
            self._loaded_weights[id(param)] = weight
        return weight

    def follow_model(self) -> None:
        super().follow_model()
        self._loaded_weights.clear()

    def _follow(self, param_id: int) -> None:
        assert self._agreed is not None
        weight, remainder = self._remainders[param_id]
        weight_version, _ = self._agreed[param_id]
        if weight._version == weight_version:
            return
        # A remainder is only right beside the weight it was split from: the one loaded with it, if the weight
        # still holds that value; otherwise the master is the weight itself, a zero remainder.
        loaded = self._loaded_weights.get(param_id)
        if loaded is None or not torch.equal(weight.detach(), loaded):
            remainder.zero_()
            self._loaded_weights.pop(param_id, None)
        self._note_agreement(param_id, weight, remainder)

    # -- amp.master_params ----------------------------------------------------------------------------------
    def master_params(self) -> Iterator[torch.Tensor]:
        """The optimizer's parameters as fp32 masters with fp32 ``.grad``s (the bf16 grads, already unscaled,
        widened), made when asked: ``clip_grad_norm_`` over them clips in fp32, and the step that follows takes
        their values and grads (a later backward, ``zero_grad`` or weight write makes them stale: then the step
        reads the parameter again). Parameters without a remainder are yielded as they are."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in self._remainders:
                    yield param
                    continue
                fresh = self._fresh_master(param)
                if fresh is None:
                    fresh = self._joined(param)
                    fresh.grad = None if param.grad is None else self._factored(param.grad.to(torch.float32, copy=True))
                    grad_version = None if param.grad is None else param.grad._version
                    self._materialised[id(param)] = _Materialised(fresh, param.grad, grad_version, param._version)
                yield fresh

    def _fresh_master(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s materialised master if nothing has changed its weight or bf16 grad since it was made."""
        entry = self._materialised.get(id(param))
        if entry is None or entry.grad is not param.grad or param._version != entry.weight_version:
            return None
        if param.grad is not None and param.grad._version != entry.grad_version:
            return None
        return entry.master

    def _step_master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master the step updates (a scratch tensor): the materialised one, else joined now."""
        fresh = self._fresh_master(param)
        return self._joined(param) if fresh is None else fresh.detach()

    def _step_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 grad the step applies: the materialised master's (clipped, maybe), else the bf16 grad widened
        (times the clip's factor, for a parameter with a remainder)."""
        fresh = self._fresh_master(param)
        if fresh is not None and fresh.grad is not None:
            return fresh.grad
        if id(param) in self._remainders:
            return self._factored(_fp32(param.grad))
        return _fp32(param.grad)

    def _factored(self, widened: torch.Tensor) -> torch.Tensor:
        """A widened bf16 grad (a copy) times the clip's factor, in place, in fp32 (as the kernels multiply)."""
        return widened if self._grad_factor is None else widened.mul_(self._grad_factor)

    def _factor_for(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The factor of a launch's grads: the clip's, for a launch of parameters with a remainder (a launch holds
        only those, or none of them)."""
        return self._grad_factor if params and id(params[0]) in self._remainders else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor | None:
        """``amp.clip_grad_norm_`` folded into the step (``ampinit._masters.clip``): the norm from the bf16 grads
        (unscaled at ``scale_loss``'s exit), the coefficient into the factor the step multiplies them by, in the
        kernels or chunked; no fp32 master is made. Grads of parameters without a remainder are clipped in place.
        None, with nothing done, where fp32 masters were already made (``amp.master_params``: the caller clips
        those) or the grads are beyond the fold."""
        if self._materialised or norm_type not in clip.EXACT_ORDERS:
            return None
        grads: list[torch.Tensor] = []
        scaled: list[bool] = []
        own: list[torch.Tensor] = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grads.append(param.grad)
                kept = id(param) in self._remainders
                scaled.append(kept)
                if not kept:
                    own.append(param)
        if not clip.same_device(grads):
            return None
        factor = self._grad_factor
        total, coefficient = clip.fold_(grads, scaled, own, factor, max_norm, norm_type, error_if_nonfinite)
        self._grad_factor = coefficient if factor is None else factor * coefficient
        return total

    def prepare_backward(self, scaler: LossScaler | None = None, claimed: set[int] | None = None) -> None:
        self._keep_clip()
        super().prepare_backward(scaler, claimed)
        self._materialised.clear()
        self._grad_factor = None

    def _keep_clip(self) -> None:
        """Before another backward of the same step: a clip made since the last one (``amp.clip_grad_norm_``'s
        factor, or the fp32 grads of ``amp.master_params``' masters, clipped or edited) is written into the bf16
        grads that backward accumulates into, rounded to bf16 as the accumulation is. Forgotten, it left the step
        unclipped, where fp32 masters (and Apex) keep it in the master grads the next backward adds to."""
        if self._grad_factor is None and not self._materialised:
            return
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None or id(param) not in self._remainders:
                        continue
                    fresh = self._fresh_master(param)
                    if fresh is not None and fresh.grad is not None:
                        param.grad.copy_(fresh.grad)
                    elif self._grad_factor is not None:
                        param.grad.copy_(self._factored(param.grad.to(torch.float32, copy=True)))

    def after_step(self, stepped: bool, weights_written: bool = False) -> None:
        super().after_step(stepped, weights_written)
        self._materialised.clear()
        self._grad_factor = None

    def remainder_of(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._remainders.get(id(param))
        return None if entry is None else entry[1]

    def restore_model_params(self) -> None:
        """Forget the remainders (the session has already given the model its joined masters back)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remainders.clear()
        self._loaded_weights.clear()
        self._materialised.clear()
        self._agreed = None

    # -- optimizer state_dict -------------------------------------------------------------------------------
    def _remember_loaded(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        self._loading = state_dict

    def _keep_state_fp32(self, optimizer: torch.optim.Optimizer) -> None:
        # torch casts loaded floating state to its parameter's dtype, bf16 here; the moments of fp32 masters
        # are fp32, so they are taken again from the loaded dict.
        loaded, self._loading = self._loading, None
        if loaded is None:
            return
        for _, param, saved in loaded_states(loaded, optimizer):
            if id(param) not in self._remainders or saved is None:
                continue
            for key, value in saved.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    optimizer.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)

    # -- the step -------------------------------------------------------------------------------------------
    def step_in_amp_kernels(self, original: Callable[..., Any], found_inf: torch.Tensor | None) -> bool:
        """Step every group on its joined masters, in amp's kernels where the group fits them, else chunk by chunk
        on the optimizer's update; always True (amp takes every remainder step)."""
        # ``original`` is not called, so an lr scheduler's wrapper beneath amp's step (one created before
        # initialize) cannot record the step: record it as that wrapper does (and as the fp32 kernel step does);
        # nor can torch run the optimizer's step hooks around it: they are run here.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        kernel_step.with_step_hooks(self.optimizer, lambda: self._step_groups(found_inf))
        return True

    def _step_groups(self, found_inf: torch.Tensor | None) -> None:
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    if group["params"]:  # FusedAdam's group count advances without grads too, as its own step's
                        kernel_step.count_group_step(self.optimizer, self.update, group, found_inf)
                    continue
                # The kernels read the bf16 grads: materialised fp32 ones (clipped, maybe) take the chunked step.
                if not self._materialised and self._kernels_step(group, params, found_inf):
                    continue
                self._chunked_step(group, params, found_inf)

    def _chunked_step(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        flag = None if found_inf is None else found_inf.reshape(())
        chunks = self._chunks(params)
        if self._own_update is not None:
            self._own_update.update_masters(group, chunks, flag)
            return
        for chunk in chunks:
            if self.update == "adam":
                self._adam(group, chunk, flag)
            else:
                self._sgd(group, chunk, flag)

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[MasterChunk]:
        """``params`` in chunks with their joined masters and fp32 grads; a chunk's masters are split back into
        weights and remainders when the next chunk is asked for (or the iteration ends)."""
        for some in _in_chunks(params):
            chunk = MasterChunk(some, [self._step_master(p) for p in some], [self._step_grad(p) for p in some])
            yield chunk
            self._split_back(some, chunk.masters)

    def _joined(self, param: torch.Tensor) -> torch.Tensor:
        entry = self._remainders.get(id(param))
        return param.detach() if entry is None else encoding.join(param.detach(), entry[1])

    def _split_back(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        for param, master in zip(params, masters):
            entry = self._remainders.get(id(param))
            if entry is not None:
                encoding.split_(master, param.detach(), entry[1])

    def _adam(self, group: dict[str, Any], chunk: MasterChunk, flag: torch.Tensor | None) -> None:
        params, masters, grads = chunk
        states = [adam_state(self.optimizer, group, p) for p in params]
        beta1, beta2 = group["betas"]
        adam_update(
            masters,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
            [s["step"] for s in states],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            fused=group["fused"],
            grad_scale=None,
            found_inf=flag if group["fused"] else None,
            has_complex=False,
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)),
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )

    def _sgd(self, group: dict[str, Any], chunk: MasterChunk, flag: torch.Tensor | None) -> None:
        params, masters, grads = chunk
        buffers: list[torch.Tensor | None] = [self.optimizer.state[p].get("momentum_buffer") for p in params]
        sgd_update(
            masters,
            grads,
            buffers,
            has_sparse_grad=False,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=flag if group["fused"] else None,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        if group["momentum"] != 0:
            for param, buffer in zip(params, buffers):
                self.optimizer.state[param]["momentum_buffer"] = buffer

    # -- the kernels ----------------------------------------------------------------------------------------
    def _kernels_step(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> bool:
        """Step ``group`` with the Triton kernels if it qualifies (``kernel_step``'s rule: torch's Adam/AdamW/SGD,
        or ampinit's FusedAdam/FusedSGD through their ``kernel_settings``, with their state layout)."""
        update = kernel_step.kernel_update(self.optimizer, self.update)
        if update is None or not kernel_step.takes_group(self.optimizer, update, group):
            return False
        kernels = kernel_step.kernels_taking(params, found_inf, {}, self._remainders)
        if kernels is None:
            return False
        with_remainder = [p for p in params if id(p) in self._remainders]
        direct = [p for p in params if id(p) not in self._remainders]
        for batch in (with_remainder, direct):
            if batch:
                masters = self._masters(batch)
                factor = self._factor_for(batch)
                kernel_step.run_kernels(update, kernels, self.optimizer, group, batch, masters, found_inf, None, factor)
        kernel_step.count_group_step(self.optimizer, update, group, found_inf)
        return True

    def _masters(self, params: list[torch.Tensor]) -> Masters:
        """The masters of ``params``, all with a remainder or all without (fp32 parameters are their own). The
        lists hold the parameters themselves: the kernels read data pointers only, and a ``detach()`` per tensor per
        step was an aten op each (host work a GPU waits on)."""
        if params and id(params[0]) in self._remainders:
            return Masters.remainder(params, [self._remainders[id(p)][1] for p in params])
        return Masters.fp32(params)


def loaded_states(
    loaded: dict[str, Any], optimizer: torch.optim.Optimizer
) -> Iterator[tuple[int, torch.Tensor, dict[str, Any] | None]]:
    """A loaded optimizer ``state_dict``'s per-parameter state beside the optimizer's parameters, paired by position
    as torch's ``load_state_dict`` pairs them: ``(position, parameter, saved state or None)``."""
    saved_ids = [i for group in loaded["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for position, (saved_id, param) in enumerate(zip(saved_ids, params)):
        yield position, param, loaded["state"].get(saved_id)


@dataclass
class _Materialised:
    """An fp32 master made for ``amp.master_params``, and what it was made from."""

    master: torch.Tensor
    grad: torch.Tensor | None
    grad_version: int | None
    weight_version: int


def _fp32(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    if grad.is_sparse:
        raise RuntimeError("master_weights='remainder' does not support sparse gradients")
    return grad if grad.dtype == torch.float32 else grad.float()


def _in_chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for param in params:
        if chunk and size + param.numel() > CHUNK_ELEMENTS:
            yield chunk
            chunk, size = [], 0
        chunk.append(param)
        size += param.numel()
    if chunk:
        yield chunk
