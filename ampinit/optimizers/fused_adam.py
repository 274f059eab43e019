"""FusedAdam: Apex's Adam/AdamW on torch's fused Adam kernels."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ampinit import _torch_kernels
from ampinit._masters.reference import AdamSettings
from ampinit._masters.update import MasterChunk
from ampinit._torch_kernels import device_scalar, fp32_copies, fp32_work, group_indices, pick, write_back
from ampinit.optimizers._adam_math import adam_update_foreach, adam_update_single
from ampinit.optimizers._apex_ops import (
    TensorLists,
    adam_arguments,
    check_lists,
    float64_corrections,
    not_flagged,
    times,
)
from ampinit.optimizers._base import (
    AmpScaling,
    FusedOptimizer,
    Implementation,
    ParamsT,
    adam_defaults,
    advance_step,
    group_step,
)
from ampinit.optimizers._update_io import amp_on, reference_inputs, write_back_fused

# Apex's FusedAdam of 2018-10 (e0bc5d62) to 2019-08 took ``max_grad_norm`` and ``eps_inside_sqrt``. Commit
# 690b1f71 (2019-08-08, "initial commit to make fused optimizers compatible with AMP") dropped ``max_grad_norm``,
# commit 18062b69 (2019-08-16, "Removed legacy eps_mode from FusedAdam") dropped ``eps_inside_sqrt``; no Apex
# release tag (the first is 22.03) has either. Read from the NVIDIA/apex history of apex/optimizers/fused_adam.py.
_MAX_GRAD_NORM_WARNING = (
    "FusedAdam(max_grad_norm=...) is Apex's pre-2019-08 argument, removed by Apex commit 690b1f71 (2019-08-08; in "
    "no Apex release tag): it clipped each parameter group's gradient norm to max_grad_norm before the update "
    "(the norm that apex.optimizers.FP16_Optimizer passed to step()). ampinit clips each group the same way; "
    "call torch.nn.utils.clip_grad_norm_ before step() instead"
)
_EPS_INSIDE_SQRT_WARNING = (
    "FusedAdam(eps_inside_sqrt=False) is Apex's pre-2019-08 argument, removed by Apex commit 18062b69 "
    "(2019-08-16; in no Apex release tag): False, its default, is what FusedAdam always does now; drop it"
)
_EPS_INSIDE_SQRT_REFUSED = (
    "FusedAdam(eps_inside_sqrt=True) is Apex's pre-2019-08 argument, removed by Apex commit 18062b69 (2019-08-16; "
    "in no Apex release tag): it added eps under the square root, sqrt(v_hat + eps), where FusedAdam (Apex since "
    "then, and ampinit) divides by sqrt(v_hat) + eps. ampinit has no such mode: keep Apex of before 2019-08-16 "
    "for this run, or drop the argument and retune eps"
)
_DEPRECATED_STEP_ARGS = (
    "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, "
    "and call step() with no arguments."
)


def adam_multi_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    masters: Sequence[Tensor] | None = None,
) -> None:
    """One Adam update of every tensor, with ``torch._fused_adam_``/``torch._fused_adamw_``.

    ``step`` is the 0-d step number of this update. ``found_inf`` (0-d float, exactly 0 or 1) skips the
    update inside the kernel. Lists whose dtypes all match run in place; otherwise (half parameters with
    float32 moments) the kernel runs on float32 work copies that are rounded back once. ``masters``, if given,
    are float32 copies of ``params`` that the update runs on instead.
    When ``grad_scale`` is given, the gradients are left unscaled in place, as torch's fused kernels do.
    """
    kernel = _torch_kernels.fused_adamw_ if adam_w_mode else _torch_kernels.fused_adam_
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([masters] if masters is not None else [])
    for (device, dtypes), indices in group_indices(lists).items():
        p, g, m, v = (pick(t, indices) for t in lists[:4])
        amp = amp_on(device, grad_scale, found_inf)
        if masters is None and len(set(dtypes)) == 1:
            wp, wg, wm, wv = p, g, m, v
        else:
            wp = pick(masters, indices) if masters is not None else fp32_work(p)
            wg, wm, wv = fp32_work(g), fp32_work(m), fp32_work(v)
        # 1 - beta**inf == 1 exactly, which turns the kernel's bias corrections into no-ops.
        this_step = step.to(device) if bias_correction else device_scalar(float("inf"), device)
        kernel(
            wp,
            wg,
            wm,
            wv,
            [],
            [this_step] * len(wp),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            **amp.kernel_arguments(),
        )
        write_back_fused(amp, p + m + v, wp + wm + wv, g, wg)


# adam_multi_tensor's signature, spelled out: the two are interchangeable (``implementation`` picks one).
def adam_single_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    masters: Sequence[Tensor] | None = None,
) -> None:
    """The same update as :func:`adam_multi_tensor`, one tensor at a time in plain torch (the reference)."""
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        device = param.device
        target = masters[i] if masters is not None else param
        p, g = reference_inputs(target, grad, grad_scale, 0.0 if adam_w_mode else weight_decay)
        betas = (beta1, beta2, 1 - beta1)
        m, v, update = adam_update_single(
            g, exp_avg, exp_avg_sq, step.to(device), betas=betas, eps=eps, bias_correction=bias_correction
        )
        if adam_w_mode and weight_decay != 0:
            update = update + weight_decay * p
        skip = None if found_inf is None else found_inf.to(device).bool()
        write_back([target, exp_avg, exp_avg_sq], [p - lr * update, m, v], skip)
        if masters is not None:
            write_back([param], [target], skip)


# Apex's amp_C ops on this update, which FusedAdam exposes as attributes (see _apex_ops).
def multi_tensor_adam(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Adam on lists ``[g, p, m, v]``; ``mode`` 0 is L2 weight decay, 1 is AdamW. Ignores the flag."""
    if not check_lists("multi_tensor_adam", tensor_lists, (4,)):
        return
    g, p, m, v = tensor_lists
    hyper = adam_arguments(p[0].device, step, lr, (beta1, beta2), epsilon, weight_decay, bias_correction)
    adam_multi_tensor(p, g, m, v, adam_w_mode=mode != 0, **hyper)


def _adam_capturable(
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Apex's capturable Adam kernels: every input that changes per step is a device tensor, so one
    captured graph replays correctly; nothing is read on the host."""
    masters = len(tensor_lists) == 5
    decoupled = mode != 0  # Apex tests mode == 0 (L2) and takes any other value as decoupled
    for (device, _), indices in group_indices(tensor_lists).items():
        g, p, m, v = (pick(t, indices) for t in tensor_lists[:4])
        skip = ~not_flagged(noop_flag, device)
        # The kernel multiplies the gradients by inv_scale and stores them back, then works in float32.
        wg = times(g, inv_scale)
        source = pick(tensor_lists[4], indices) if masters else p
        wp, wm, wv = fp32_copies(source), fp32_copies(m), fp32_copies(v)
        update = adam_update_foreach(
            wp,
            wg,
            wm,
            wv,
            betas=(beta1, beta2, 1 - beta1),
            eps=epsilon,
            weight_decay=weight_decay,
            decoupled=decoupled,
            corrections=float64_corrections(step, beta1, beta2, bias_correction, device),
        )
        _torch_kernels.foreach_mul_(update, lr.to(device=device, dtype=torch.float32).reshape(()))
        _torch_kernels.foreach_sub_(wp, update)
        if not decoupled and weight_decay != 0:
            # The gradient stored back is the unscaled one, without the L2 term.
            wg = times(g, inv_scale)
        write_back(g + p + m + v, wg + wp + wm + wv, skip)
        if masters:
            write_back(pick(tensor_lists[4], indices), wp, skip)


def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Adam on lists ``[g, p, m, v]`` with ``lr``, ``step`` and ``inv_scale`` as device tensors.

    Gradients are multiplied by ``inv_scale`` and stored back; ``mode`` 0 is L2, 1 is AdamW. Nothing changes
    when the flag is set (Apex's FusedAdam passes its overflow flag here).
    """
    if not check_lists("multi_tensor_adam_capturable", tensor_lists, (4,)):
        return
    _adam_capturable(
        noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
    )


def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """:func:`multi_tensor_adam_capturable` on ``[g, p, m, v, p_master]``: the update runs on the float32
    ``p_master``, and ``p`` receives it rounded to its own dtype."""
    if not check_lists("multi_tensor_adam_capturable_master", tensor_lists, (5,)):
        return
    _adam_capturable(
        noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
    )


class FusedAdam(FusedOptimizer):
    """Adam and AdamW with Apex's ``FusedAdam`` signature and defaults.

    ``adam_w_mode=True`` (the default) decouples weight decay as AdamW does; ``False`` adds it to the
    gradient (L2, as ``torch.optim.Adam``). ``bias_correction=False`` drops Adam's bias corrections.
    State per parameter: ``exp_avg`` and ``exp_avg_sq`` (float32); the step counter is per group in
    ``group['step']``, a 0-d float32 tensor. ``capturable=True`` makes each group's ``lr`` a 0-d device
    tensor, as Apex does, so that ``step()`` can be captured in a CUDA graph and replayed with the current
    learning rate. Every step is capturable: it never reads a tensor on the host (no ``.item()``, no
    ``bool()`` of a tensor, no ``torch.tensor(x, device=...)`` copies; skipping and step counting happen on the
    device), and it allocates only from the caching allocator; state is created on the first step, so that
    step must run before capture (the usual warm-up). ``master_weights=True`` (with ``capturable``) keeps a
    float32 copy of each half parameter in ``state['master_param']`` (saved with the state, unlike Apex) and
    updates that copy.
    ``implementation`` selects torch's fused kernels (``"multi_tensor"``) or the per-tensor reference.
    """

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        implementation: Implementation = "multi_tensor",
        max_grad_norm: float | None = None,
        eps_inside_sqrt: bool | None = None,
    ) -> None:
        defaults = adam_defaults("FusedAdam", amsgrad, lr, bias_correction, betas, eps, weight_decay)
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        _check_historic(max_grad_norm, eps_inside_sqrt)
        if max_grad_norm is not None:
            defaults["max_grad_norm"] = float(max_grad_norm)
        super().__init__(params, defaults, set_grad_none=set_grad_none, implementation=implementation)
        self.multi_tensor_adam = multi_tensor_adam
        self.multi_tensor_adam_capturable = multi_tensor_adam_capturable
        self.multi_tensor_adam_capturable_master = multi_tensor_adam_capturable_master
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        if capturable:
            # As in Apex, the learning rate becomes a device tensor: a captured CUDA graph then reads its current
            # value at each replay (torch's LR schedulers fill tensor learning rates in place) instead of the
            # number baked in at capture.
            for group in self.param_groups:
                if group["params"] and not isinstance(group["lr"], Tensor):
                    device = group["params"][0].device
                    group["lr"] = torch.full((), float(group["lr"]), dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        grads: object = None,
        output_params: object = None,
        scale: object = None,
        grad_norms: object = None,
    ) -> float | None:
        """One Adam step over every group. The extra arguments exist only to reject Apex's removed API.

        There is deliberately no ``grad_scaler`` argument: GradScaler would then use its deprecated
        calling convention instead of the ``grad_scale``/``found_inf`` attributes.
        """
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(_DEPRECATED_STEP_ARGS)
        loss = self._evaluate(closure)
        update = adam_multi_tensor if self.implementation == "multi_tensor" else adam_single_tensor
        for group in self.param_groups:
            # Empty groups are skipped, as in Apex and torch.optim; a group of frozen parameters only counts a step.
            if not group["params"]:
                continue
            with self._adam_step(group) as arguments:
                params = self._params_with_grads(group)
                if group.get("max_grad_norm", 0.0) > 0:
                    _clip_group([p.grad for p in params], group["max_grad_norm"], arguments["grad_scale"])  # type: ignore[misc]
                states = [self._state_for(p) for p in params]
                update(
                    params,
                    [p.grad for p in params],  # type: ignore[misc]
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    adam_w_mode=bool(self.adam_w_mode),
                    masters=[s.get("master_param", p) for s, p in zip(states, params)] if self.master_weights else None,
                    **arguments,
                )
        return loss

    # -- amp's master-update protocol (ampinit._masters.update.MasterUpdate) --------------------------------
    def check_master_update(self) -> None:
        """amp may run this update on masters it keeps, unless this optimizer keeps fp32 copies of its own or
        clips each group by its gradient norm (``max_grad_norm``): amp hands the update a group chunk by chunk,
        so no chunk could know the whole group's norm, and the clipping would silently not happen."""
        amp_step = (
            "amp's own master step (master_weights='remainder', 'remainder8', 'stochastic', or an optimizer_state)"
        )
        if self.master_weights:
            raise ValueError(
                f"{amp_step} cannot be combined with FusedAdam(master_weights=True), which keeps its own fp32 "
                "copies: create the FusedAdam without master_weights"
            )
        clipped = [group["max_grad_norm"] for group in self.param_groups if group.get("max_grad_norm", 0.0) > 0]
        if clipped:
            raise ValueError(
                f"{amp_step} cannot apply FusedAdam(max_grad_norm={clipped[0]!r}): it updates a group in chunks "
                "and never sees the group's whole gradient norm. Create the FusedAdam without max_grad_norm and "
                "clip before the step: torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)"
            )

    def update_masters(self, group: dict[str, Any], chunks: Iterable[MasterChunk], found_inf: Tensor | None) -> None:
        """This optimizer's Adam step of ``group`` on the fp32 masters amp hands it (``master_weights="remainder"``);
        the group's step counter advances once, unless ``found_inf`` is set."""
        update = adam_multi_tensor if self.implementation == "multi_tensor" else adam_single_tensor
        beta1, beta2 = group["betas"]
        step: Tensor | None = None
        for params, masters, grads in chunks:
            if step is None:
                step = group_step(group, params[0].device)
            states = [self._state_for(p) for p in params]
            update(
                masters,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                step=step + 1,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adam_w_mode=bool(self.adam_w_mode),
                bias_correction=bool(group["bias_correction"]),
                found_inf=found_inf,
            )
        if step is not None:
            advance_step(step, AmpScaling(found_inf=found_inf))

    # -- amp's kernel step (ampinit._masters.kernel_step.KernelOptimizer) ----------------------------------
    kernel_update = "adam"

    def kernel_settings(self, group: dict[str, Any]) -> AdamSettings | None:
        """The group in the kernels' terms; None with a tensor lr (``capturable``), fp32 copies of its own
        (``master_weights``) or the historic per-group clipping (``max_grad_norm``), which the kernels lack."""
        if self.capturable or self.master_weights or group.get("max_grad_norm", 0.0) > 0:
            return None
        beta1, beta2 = group["betas"]
        return AdamSettings(
            float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], bool(self.adam_w_mode), False
        )

    def kernel_adam_state(
        self, group: dict[str, Any], params: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """The moments of ``params``, and the group's step number for this update once per tensor (infinite
        without bias correction: ``1 - beta**inf`` is exactly 1)."""
        states = [self._state_for(p) for p in params]
        step = group_step(group, params[0].device)
        this_step = step + 1 if group["bias_correction"] else torch.full_like(step, float("inf"))
        return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], this_step.expand(len(params))

    def kernel_count_step(self, group: dict[str, Any], found_inf: Tensor | None) -> None:
        """One step of ``group`` counted, as this optimizer's own step counts it."""
        # group_step: a group whose parameters never had a grad has no counter yet (its own step makes it so too).
        step = group_step(group, group["params"][0].device)
        advance_step(step, AmpScaling(found_inf=None if found_inf is None else found_inf.reshape(())))

    def _state_for(self, param: Tensor) -> dict[str, Tensor]:
        self._zero_state([param], "exp_avg", "exp_avg_sq")
        state: dict[str, Tensor] = self.state[param]
        if self.master_weights and param.dtype != torch.float32 and "master_param" not in state:
            state["master_param"] = param.detach().to(torch.float32, copy=True)
        return state


def _check_historic(max_grad_norm: object, eps_inside_sqrt: object) -> None:
    """Accept Apex's pre-2019-08 arguments with a FutureWarning where ampinit does what they did, else refuse."""
    if eps_inside_sqrt is not None:
        if not isinstance(eps_inside_sqrt, bool):
            raise TypeError(f"eps_inside_sqrt must be True or False, got {eps_inside_sqrt!r}")
        if eps_inside_sqrt:
            raise ValueError(_EPS_INSIDE_SQRT_REFUSED)
        warnings.warn(_EPS_INSIDE_SQRT_WARNING, FutureWarning, stacklevel=3)
    if max_grad_norm is not None:
        number = isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
        if not number or not float(max_grad_norm) >= 0:  # type: ignore[arg-type]
            raise ValueError(f"max_grad_norm must be a number >= 0 (0: no clipping), got {max_grad_norm!r}")
        warnings.warn(_MAX_GRAD_NORM_WARNING, FutureWarning, stacklevel=3)


def _clip_group(grads: list[Tensor], max_norm: float, grad_scale: Tensor | None) -> None:
    """Apex's pre-2019-08 per-group clipping: gradients times ``max_norm / (norm + 1e-6)`` when that is below 1,
    ``norm`` being the group's unscaled L2 norm. Kept on the device (no host sync), so the step stays capturable."""
    if not grads:
        return
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if grad_scale is not None:
        norm = norm / grad_scale.to(norm.device)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
