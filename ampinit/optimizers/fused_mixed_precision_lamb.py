"""FusedMixedPrecisionLamb: Apex's LAMB with device-side lr/step and optional float32 masters of
reduced-precision parameters, on Apex's ``amp_C`` op :func:`multi_tensor_lamb_mp`, which lives here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._torch_kernels import fp32_copies, group_indices, l2_norms, pick, write_back
from ampinit.optimizers._adam_math import adam_update_foreach, clip_divisor
from ampinit.optimizers._apex_ops import (
    TensorLists,
    check_lists,
    flag_if,
    float64_corrections,
    multi_tensor_l2norm,
    not_flagged,
    times,
)
from ampinit.optimizers._base import FusedOptimizer, ParamsT, adam_defaults


def multi_tensor_l2norm_mp(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """Apex's mixed-precision-LAMB variant of :func:`multi_tensor_l2norm` (same arguments and results).

    Apex's kernel leaves its outputs unwritten when the flag is already set; here they are always the norms.
    """
    return multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)


def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: Tensor,
    use_nvlamb: bool | None,
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """Apex's mixed-precision LAMB on ``[g, p, m, v]`` (float32 or half ``p``) or ``[g, p, m, v, p_model]``
    (float32 master ``p``, ``p_model`` receives it rounded).

    Three stages, each skipped when the flag is set by then, as Apex's kernels are: (1) per-tensor norms of
    ``p`` (a non-finite one sets the flag); (2) ``g*inv_scale``, divided by ``global_grad_norm /
    max_grad_norm`` when that exceeds 1, drives the Adam moments, and ``g`` is overwritten with the update
    (weight decay inside it for ``mode`` 1, in the gradient for ``mode`` 0); (3) the update norms (a non-finite
    one sets the flag) give the trust ratio ``lr * ||p|| / ||update||`` (when ``use_nvlamb`` or
    ``weight_decay != 0`` and both are nonzero, else ``lr``), and ``p -= ratio * update``. ``found_inf`` is
    accepted and unused, as in Apex (the caller copies it into the flag).
    """
    if not check_lists("multi_tensor_lamb_mp", tensor_lists, (4, 5)):
        return
    g, p, m, v = tensor_lists[:4]
    p_norms = _flagged_norms(noop_flag, p)
    for (device, _), indices in group_indices([g, p, m, v]).items():
        wg = times(pick(g, indices), inv_scale)
        norm = global_grad_norm.to(device=device, dtype=torch.float32).reshape(())
        _torch_kernels.foreach_div_(
            wg, clip_divisor(norm, max_grad_norm.to(device=device, dtype=torch.float32).reshape(()))
        )
        wm, wv = fp32_copies(pick(m, indices)), fp32_copies(pick(v, indices))
        update = adam_update_foreach(
            fp32_copies(pick(p, indices)),
            wg,
            wm,
            wv,
            betas=(beta1, beta2, 1 - beta1 if grad_averaging == 1 else 1.0),
            eps=epsilon,
            weight_decay=weight_decay,
            decoupled=mode != 0,
            corrections=float64_corrections(step, beta1, beta2, bias_correction, device),
        )
        write_back(
            pick(g, indices) + pick(m, indices) + pick(v, indices), update + wm + wv, ~not_flagged(noop_flag, device)
        )
    u_norms = _flagged_norms(noop_flag, g)
    trusted = bool(use_nvlamb) or weight_decay != 0
    _lamb_mp_apply(noop_flag, tensor_lists, lr, p_norms if trusted else None, u_norms)


def _flagged_norms(noop_flag: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Float32 L2 norm of each tensor; sets the flag if any is non-finite."""
    norms = l2_norms(tensors)
    flag_if(noop_flag, torch.stack([n.to(noop_flag.device) for n in norms]).isfinite().all().logical_not())
    return norms


def _lamb_mp_apply(
    noop_flag: Tensor, tensor_lists: TensorLists, lr: Tensor, p_norms: list[Tensor] | None, u_norms: list[Tensor]
) -> None:
    """Stage 3 of :func:`multi_tensor_lamb_mp`: ``p -= ratio * update`` (the update is in ``g``), with the trust
    ratio ``lr * (||p|| / ||update||)`` where ``p_norms`` is given and both norms are nonzero, else ``lr``."""
    g, p = tensor_lists[:2]
    for (device, _), indices in group_indices([g, p]).items():
        skip = ~not_flagged(noop_flag, device)
        learning_rate = lr.to(device=device, dtype=torch.float32).reshape(())
        ratios = [learning_rate] * len(indices)
        if p_norms is not None:
            pairs = [(p_norms[i].to(device), u_norms[i].to(device)) for i in indices]
            ratios = [torch.where((pn != 0) & (un != 0), learning_rate * (pn / un), learning_rate) for pn, un in pairs]
        wp = fp32_copies(pick(p, indices))
        _torch_kernels.foreach_sub_(wp, _torch_kernels.foreach_mul(fp32_copies(pick(g, indices)), ratios))
        write_back(pick(p, indices), wp, skip)
        if len(tensor_lists) == 5:
            write_back(pick(tensor_lists[4], indices), wp, skip)


class FusedMixedPrecisionLamb(torch.optim.Optimizer):
    """Apex's ``FusedMixedPrecisionLamb``: same constructor, defaults, state and ``step(closure, grad_scaler)``.

    ``group['lr']`` and ``group['step']`` are device tensors (float32 and int32 of shape [1]) so a step never
    reads the host. With ``reduced_precision_dtype`` set, parameters of that dtype get float32 masters,
    created from the parameters at the first ``step()`` (kept in ``param_groups_full_precision`` and, as in
    Apex, not saved in ``state_dict``); the update runs on the masters and is rounded into the parameters.
    Moments are float32 for those parameters and in the parameter dtype for the others, as in Apex.

    ``step(grad_scaler=scaler)`` is Apex's calling convention: ``torch.amp.GradScaler.step`` passes itself
    (with torch's own FutureWarning about it), its overflow flag skips the step on the device and the
    gradients are unscaled inside the update. Without a scaler the ``grad_scale``/``found_inf`` attributes
    of torch's newer protocol are used when set.
    """

    _step_supports_amp_scaling = True

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = adam_defaults("FusedLAMB", amsgrad, lr, bias_correction, betas, eps, weight_decay)
        defaults.update(
            step=torch.full((1,), step, dtype=torch.int32), grad_averaging=grad_averaging, max_grad_norm=max_grad_norm
        )
        defaults["lr"] = torch.full((), lr, dtype=torch.float32)
        super().__init__(params, defaults)
        firsts = [group["params"][0] for group in self.param_groups if group["params"]]
        device = firsts[0].device if firsts else torch.device("cpu")
        for group in self.param_groups:
            group["lr"] = group["lr"].to(device)
            group["step"] = group["step"].to(device)
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self._device = device
        self.reduced_precision_dtype = reduced_precision_dtype
        self.param_groups_full_precision: list[dict[str, list[Tensor | None]]] = []
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but tensor defaults (``lr``, ``step``) are cloned so groups never share them."""
        missing = [name for name in self.defaults if name not in param_group]
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name in missing:
            if isinstance(self.defaults[name], Tensor):
                group[name] = self.defaults[name].clone()
        # A group's own float lr becomes a tensor like the default's (Apex would replace it with the default).
        if not isinstance(group["lr"], Tensor):
            group["lr"] = torch.full((), float(group["lr"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, but keep every state tensor in its saved dtype (float32 moments of
        reduced-precision parameters stay float32, as Apex's override does) and unshared."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)
        for group in self.param_groups:
            for key in ("lr", "step"):
                if isinstance(group[key], Tensor):
                    group[key] = group[key].to(self._device, copy=True)

    def _setup_full_precision_params(self) -> None:
        for group in self.param_groups:
            reduced = self.reduced_precision_dtype
            masters: list[Tensor | None] = [
                p.detach().clone().to(torch.float32) if reduced is not None and p.dtype == reduced else None
                for p in group["params"]
            ]
            self.param_groups_full_precision.append({"params": masters})

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, grad_scaler: Any = None
    ) -> float | None:
        """One LAMB step over every group (Apex's ``step``); see the class docstring for ``grad_scaler``."""
        loss = FusedOptimizer._evaluate(closure)
        # Masters are made at the first step, not in the constructor, so that parameters broadcast by DDP
        # after construction are the ones copied (Apex's reason).
        if not self.param_groups_full_precision:
            self._setup_full_precision_params()
        grads = self._grads_of_one_dtype_groups()
        found_inf, scale = self._amp_inputs(grad_scaler)
        self._dummy_overflow_buf.copy_(found_inf.ne(0))
        grad_norm = multi_tensor_l2norm_mp(0, self._dummy_overflow_buf, [grads], False)[0]
        # The norm is taken of the scaled gradients, so the limit is scaled too.
        max_grad_norm = self.defaults["max_grad_norm"] * scale
        inv_scale = scale.double().reciprocal().float()
        for group, full in zip(self.param_groups, self.param_groups_full_precision):
            group["step"] += self._dummy_overflow_buf.ne(1).to(group["step"].dtype)
            self._step_group(group, full["params"], (grad_norm, max_grad_norm), found_inf, inv_scale)
        return loss

    def _grads_of_one_dtype_groups(self) -> list[Tensor]:
        """Every gradient, after checking that each group holds one dtype (Apex's rule)."""
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != group["params"][0].dtype:
                    raise TypeError(
                        f"FusedMixedPrecisionLamb wants one dtype per param group, got {group['params'][0].dtype} "
                        f"and {p.dtype}"
                    )
                if p.grad is not None:
                    grads.append(p.grad)
        return grads

    def _amp_inputs(self, grad_scaler: Any) -> tuple[Tensor, Tensor]:
        """This step's ``(found_inf, scale)`` on the optimizer's device, shape [1]: from ``grad_scaler`` (Apex's
        convention), else from the ``found_inf``/``grad_scale`` attributes, else 0 and 1."""
        device = self._device
        if grad_scaler is not None:
            return grad_scaler._check_inf_per_device(self)[device].reshape(1), grad_scaler._get_scale_async().reshape(1)
        found = getattr(self, "found_inf", None)
        given = getattr(self, "grad_scale", None)
        found_inf = torch.zeros(1, device=device) if found is None else found.to(device).reshape(1)
        scale = torch.ones(1, device=device) if given is None else given.to(device).reshape(1).float()
        return found_inf, scale

    def _step_group(
        self,
        group: dict[str, Any],
        masters: list[Tensor | None],
        norm_and_limit: tuple[Tensor, Tensor],  # the global gradient norm and its limit, both scaled
        found_inf: Tensor,
        inv_scale: Tensor,
    ) -> None:
        """Apex's ``multi_tensor_lamb_mp`` on the group's parameters (or their masters) that have gradients."""
        lists: list[list[Tensor]] = [[], [], [], []]
        if self.reduced_precision_dtype is not None:
            lists.append([])
        for p, master in zip(group["params"], masters):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedMixedPrecisionLamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                dtype = torch.float32 if master is not None else p.dtype
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
            row = (p.grad, p if master is None else master, state["exp_avg"], state["exp_avg_sq"], p)
            for tensors, tensor in zip(lists, row):
                tensors.append(tensor)
        beta1, beta2 = group["betas"]
        multi_tensor_lamb_mp(
            0,
            self._dummy_overflow_buf,
            lists,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["step"],
            1 if group["bias_correction"] else 0,
            group["weight_decay"],
            1 if group["grad_averaging"] else 0,
            self.adam_w_mode,
            *norm_and_limit,
            self.use_nvlamb,
            found_inf,
            inv_scale,
        )
