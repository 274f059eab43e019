"""``master_weights="remainder"``: one optimizer's bf16 weights plus int16 remainders as its fp32 masters.

The optimizer keeps the model's bf16 parameters in its param groups (no fp32 master tensors exist between steps)
and its state in torch's layout, fp32 (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``). The low 16
bits of each master live here, one int16 tensor per bf16 parameter; ``ampinit._remainder`` defines the encoding.
Gradients stay the model's bf16 grads, unscaled in place by the loss scaler. A step, per chunk of parameters of
at most ``CHUNK_ELEMENTS`` elements (so the fp32 temporaries stay small): join each master, widen its grad, run
the optimizer's own update on them (torch's functional ``adam``/``sgd`` with the group's flags, or the ampinit
optimizer's update), split the masters back into weight and remainder. The result is bitwise the result of the
same optimizer on fp32 masters, with the bf16 copy rounded ties-away (the remainder tie rule).

On CUDA (or on CPU under Triton's interpreter, for the tests), ``torch.optim.Adam/AdamW/SGD(fused=True)`` take
ampinit's kernels instead (``_triton_master.adam_``/``sgd_`` on ``Masters.remainder``): one launch per
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
from types import ModuleType
from typing import Any, Literal, NamedTuple

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update
from torch.utils.hooks import RemovableHandle

from ampinit import _fused_master, _remainder
from ampinit._fused_master import Masters
from ampinit._fused_step import adam_state, kernel_step
from ampinit._master_weights import OptimizerGrads

#: The largest number of elements joined into fp32 at once in a step (4 MiB of masters, as much of grads).
CHUNK_ELEMENTS = 1 << 20

Kind = Literal["adam", "sgd", "fused_adam", "fused_sgd"]
SUPPORTED_OPTIMIZERS = (
    "torch.optim.Adam",
    "torch.optim.AdamW",
    "torch.optim.SGD",
    "ampinit.optimizers.FusedAdam",
    "ampinit.optimizers.FusedSGD",
)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> Kind:
    """Which update a remainder step runs for ``optimizer``; ``ValueError`` naming it when none fits."""
    # ampinit.optimizers sit above this engine layer; imported here only to recognise their types.
    from ampinit.optimizers import FusedAdam, FusedSGD

    kind: Kind | None = None
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        kind = "adam"
    elif type(optimizer) is torch.optim.SGD:
        kind = "sgd"
    elif type(optimizer) is FusedAdam:
        if optimizer.master_weights:
            raise ValueError(
                "master_weights='remainder' cannot be combined with FusedAdam(master_weights=True), which keeps "
                "its own fp32 copies: create the FusedAdam without master_weights"
            )
        kind = "fused_adam"
    elif type(optimizer) is FusedSGD:
        kind = "fused_sgd"
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if kind is None:
        raise ValueError(
            f"master_weights='remainder' does not support the optimizer {name}: it runs the update of "
            f"{', '.join(SUPPORTED_OPTIMIZERS)} (subclasses excluded). Use master_weights=True (fp32 masters) "
            "with other optimizers."
        )
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError(f"master_weights='remainder' does not support {name}(differentiable=True)")
    return kind


class RemainderGrads(OptimizerGrads):
    """The amp-side state of one optimizer whose masters are bf16 weights plus int16 remainders.

    The gradient flow is the one without masters (bf16 grads on the parameters, unscaled in place), so
    ``OptimizerGrads``'s pairs stay empty; ``master_weights`` is true so that the session refuses closures and
    always asks :meth:`fused_step` to take the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool = True) -> None:
        # ``master_weights`` is accepted for OptimizerGrads's signature (the session builds either class with
        # the same arguments); remainder masters are always masters.
        super().__init__(optimizer, master_weights=True)
        self.kind = optimizer_kind(optimizer)
        self._remainders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, remainder)
        self._handles: list[RemovableHandle] = []
        self._loading: dict[str, Any] | None = None
        # Until the first backward or step: the bf16 weights load_master split off loaded masters, by param id.
        self._loaded_weights: dict[int, torch.Tensor] = {}

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
        with torch.no_grad():
            for param in group["params"]:
                if id(param) in self._remainders or not param.requires_grad or param.dtype != torch.bfloat16:
                    continue
                source = fp32_values.get(id(param), param)
                master = source.detach().to(device=param.device, dtype=torch.float32, copy=True)
                remainder = torch.empty_like(param, dtype=_remainder.REMAINDER_DTYPE)
                _remainder.split_(master, param.detach(), remainder)
                self._remainders[id(param)] = (param, remainder)
                self._note_agreement(id(param), param, remainder)

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
        return _remainder.join(param.detach(), entry[1])

    def load_master(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """Take ``value`` as ``param``'s master: store its remainder, return the bf16 weight to load (or None)."""
        entry = self._remainders.get(id(param))
        if entry is None or value.shape != param.shape:
            return None
        weight, remainder = _remainder.split(value.detach().to(device=param.device, dtype=torch.float32))
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
        saved_ids = [i for group in loaded["param_groups"] for i in group["params"]]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            if id(param) not in self._remainders:
                continue
            for key, value in loaded["state"].get(saved_id, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    optimizer.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)

    # -- the step -------------------------------------------------------------------------------------------
    def fused_step(self, original: Callable[..., Any], found_inf: torch.Tensor | None) -> bool:
        """Step every group on the joined masters and split them back; always True (the step is taken here)."""
        # ``original`` is not called, so an lr scheduler's wrapper beneath amp's step (one created before
        # initialize) cannot record the step: record it as that wrapper does (and as ``_fused_step`` does).
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                if self._kernels_step(group, params, found_inf):
                    continue
                self._torch_step(group, params, found_inf)
        return True

    def _torch_step(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        flag = None if found_inf is None else found_inf.reshape(())
        group_step: torch.Tensor | None = None
        if self.kind == "fused_adam":
            from ampinit.optimizers._base import group_step as make_group_step

            group_step = make_group_step(group, params[0].device)
        for some in _chunks(params):
            chunk = _Chunk(group, some, [self._joined(p) for p in some], [_fp32(p.grad) for p in some], flag)
            if self.kind == "adam":
                self._adam(chunk)
            elif self.kind == "sgd":
                self._sgd(chunk)
            elif self.kind == "fused_adam":
                assert group_step is not None
                self._fused_adam(chunk, group_step + 1)
            else:
                self._fused_sgd(chunk)
            self._split_back(some, chunk.masters)
        if group_step is not None:
            group_step.add_(1 if flag is None else 1 - flag.to(group_step.device))

    def _joined(self, param: torch.Tensor) -> torch.Tensor:
        entry = self._remainders.get(id(param))
        return param.detach() if entry is None else _remainder.join(param.detach(), entry[1])

    def _split_back(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        for param, master in zip(params, masters):
            entry = self._remainders.get(id(param))
            if entry is not None:
                _remainder.split_(master, param.detach(), entry[1])

    def _adam(self, chunk: _Chunk) -> None:
        group, params, masters, grads, flag = chunk
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

    def _sgd(self, chunk: _Chunk) -> None:
        group, params, masters, grads, flag = chunk
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

    def _fused_adam(self, chunk: _Chunk, step: torch.Tensor) -> None:
        group, params, masters, grads, flag = chunk
        from ampinit.optimizers.fused_adam import adam_multi_tensor, adam_single_tensor

        opt: Any = self.optimizer
        states = [opt._state_for(p) for p in params]
        beta1, beta2 = group["betas"]
        update = adam_multi_tensor if opt.implementation == "multi_tensor" else adam_single_tensor
        update(
            masters,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            step=step,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=bool(opt.adam_w_mode),
            bias_correction=bool(group["bias_correction"]),
            found_inf=flag,
        )

    def _fused_sgd(self, chunk: _Chunk) -> None:
        group, params, masters, grads, flag = chunk
        from ampinit.optimizers.fused_sgd import FusedSGD

        assert isinstance(self.optimizer, FusedSGD)  # what optimizer_kind calls "fused_sgd"
        self.optimizer._update_group(group, params, masters, grads, None, flag)

    # -- the kernels ----------------------------------------------------------------------------------------
    def _kernels_step(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> bool:
        """Step ``group`` with the Triton kernels if it qualifies (see the module docstring)."""
        kernels = _kernels_for(group, params, self.kind)
        if kernels is None or (found_inf is not None and found_inf.device != params[0].device):
            return False
        with_remainder = [p for p in params if id(p) in self._remainders]
        direct = [p for p in params if id(p) not in self._remainders]
        for batch in (with_remainder, direct):
            if batch:
                kernel_step(self.kind, kernels, self.optimizer, group, batch, self._masters(batch), found_inf)
        return True

    def _masters(self, params: list[torch.Tensor]) -> Masters:
        """The masters of ``params``, all with a remainder or all without (fp32 parameters are their own)."""
        tensors = [p.detach() for p in params]
        if params and id(params[0]) in self._remainders:
            return Masters.remainder(tensors, [self._remainders[id(p)][1] for p in params])
        return Masters.fp32(tensors)


#: Tests set this to run the remainder kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).
TRITON_ON_CPU = False


def _kernels_for(group: dict[str, Any], params: list[torch.Tensor], kind: Kind) -> ModuleType | None:
    """``ampinit._triton_master`` when ``group`` of a ``fused=True`` torch Adam/AdamW/SGD fits the kernels."""
    if kind not in ("adam", "sgd") or not group.get("fused") or not isinstance(group["lr"], float):
        return None
    if kind == "adam" and (group["amsgrad"] or not all(isinstance(b, float) for b in group["betas"])):
        return None
    device = params[0].device
    if device.type != "cuda" and not (device.type == "cpu" and TRITON_ON_CPU):
        return None
    for p in params:
        grad = p.grad
        if (
            p.device != device
            or not p.is_contiguous()
            or grad is None
            or grad.is_sparse
            or not grad.is_contiguous()
            or grad.dtype != p.dtype
        ):
            return None
    if not _fused_master.triton_available():
        return None
    from ampinit import _triton_master

    return _triton_master


def _fp32(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    if grad.is_sparse:
        raise RuntimeError("master_weights='remainder' does not support sparse gradients")
    return grad if grad.dtype == torch.float32 else grad.float()


class _Chunk(NamedTuple):
    """What a step on torch's (or ampinit's optimizers') update works on: some of one group's parameters, with
    their joined fp32 masters and fp32 grads, and the device flag that skips the update (or None)."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    masters: list[torch.Tensor]
    grads: list[torch.Tensor]
    flag: torch.Tensor | None


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
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
