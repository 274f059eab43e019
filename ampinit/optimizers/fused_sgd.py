"""FusedSGD: Apex's SGD (momentum, dampening, Nesterov, weight decay after momentum) on torch's fused SGD."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _RequiredParameter, required

from ampinit import _torch_kernels
from ampinit._masters.reference import SgdSettings
from ampinit._masters.update import MasterChunk
from ampinit._torch_kernels import fp32_copies, fp32_work, group_indices, pick, write_back
from ampinit.optimizers._apex_ops import TensorLists, check_lists
from ampinit.optimizers._base import FusedOptimizer, Implementation, ParamsT
from ampinit.optimizers._update_io import amp_on, reference_inputs


def sgd_multi_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    wd_after_momentum: bool,
    first_run: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    model_params: Sequence[Tensor] | None = None,
) -> None:
    """One SGD update of every tensor, Apex's ``multi_tensor_sgd`` math.

    ``momentum_buffers`` may be empty when ``momentum == 0``. ``first_run`` makes the buffers start at the
    gradient. ``model_params``, if given, receive a copy of the updated ``params`` in their own dtype (Apex's
    fp32-master to fp16-model form). torch's fused kernel does the work unless weight decay must be applied
    after momentum, which it cannot do; that case runs on foreach ops.
    """
    lists: list[Sequence[Tensor]] = [params, grads]
    if momentum != 0:
        lists.append(momentum_buffers)
    if model_params is not None:
        lists.append(model_params)
    decay_after = wd_after_momentum and weight_decay != 0
    for (device, dtypes), indices in group_indices(lists).items():
        p, g = pick(params, indices), pick(grads, indices)
        m = pick(momentum_buffers, indices) if momentum != 0 else []
        amp = amp_on(device, grad_scale, found_inf)
        skip, gs = amp.skip, amp.grad_scale
        if decay_after:
            wp, wm = fp32_work(p, private=skip is not None), fp32_work(m, private=skip is not None)
            _sgd_foreach(wp, fp32_copies(g), wm, lr, momentum, dampening, weight_decay, nesterov, first_run, gs)
        else:
            # torch 2.13's CPU _fused_sgd_ miscomputes float16/bfloat16 tensors of 16+ elements, so only
            # float32 runs in place; everything else goes through float32 work copies.
            direct = model_params is None and set(dtypes) == {torch.float32}
            wp, wg, wm = (p, g, m) if direct else (fp32_work(p), fp32_work(g), fp32_work(m))
            _torch_kernels.fused_sgd_(
                wp,
                wg,
                wm,
                weight_decay=weight_decay,
                momentum=momentum,
                lr=lr,
                dampening=dampening,
                nesterov=nesterov,
                maximize=False,
                is_first_step=first_run,
                **amp.kernel_arguments(),
            )
            if gs is not None:
                write_back(g, wg, skip)
        write_back(p, wp, skip)
        write_back(m, wm, skip)
        if model_params is not None:
            write_back(pick(model_params, indices), wp, skip)


def _sgd_foreach(
    p: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    first_run: bool,
    grad_scale: Tensor | None,
) -> None:
    """SGD with weight decay added after momentum, in place on float32 ``p``, ``m`` and a private ``g``."""
    if grad_scale is not None:
        _torch_kernels.foreach_div_(g, grad_scale)
    direction: Sequence[Tensor] = g
    if momentum != 0:
        if first_run:
            _torch_kernels.copy_(m, g)
        else:
            _torch_kernels.foreach_mul_(m, momentum)
            _torch_kernels.foreach_add_(m, g, alpha=1 - dampening)
        direction = _torch_kernels.foreach_add(g, m, alpha=momentum) if nesterov else m
    _torch_kernels.foreach_add_(p, _torch_kernels.foreach_add(list(direction), p, alpha=weight_decay), alpha=-lr)


# sgd_multi_tensor's signature, spelled out: the two are interchangeable (``implementation`` picks one).
def sgd_single_tensor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    wd_after_momentum: bool,
    first_run: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    model_params: Sequence[Tensor] | None = None,
) -> None:
    """The same update as :func:`sgd_multi_tensor`, one tensor at a time in plain torch (the reference)."""
    for i, (param, grad) in enumerate(zip(params, grads)):
        device = param.device
        p, g = reference_inputs(param, grad, grad_scale, 0.0 if wd_after_momentum else weight_decay)
        targets, values = [param], []
        if momentum != 0:
            buf = momentum_buffers[i]
            m = g if first_run else momentum * buf + (1 - dampening) * g
            g = g + momentum * m if nesterov else m
            targets.append(buf)
            values.append(m)
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        new_p = p - lr * g
        if model_params is not None:
            targets.append(model_params[i])
            values.append(new_p)
        skip = None if found_inf is None else found_inf.to(device).bool()
        write_back(targets, [new_p, *values], skip)


def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    weight_decay: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float = 1.0,
) -> None:
    """SGD on ``[g, p, m]`` or ``[g, p, m, p_out]`` (``p_out`` receives the updated ``p`` in its own dtype).

    Gradients are multiplied by ``scale`` first (without modifying them). Nothing changes if the flag is set.
    """
    if not check_lists("multi_tensor_sgd", tensor_lists, (3, 4)):
        return
    g, p, m = tensor_lists[:3]
    if scale != 1.0:
        g = fp32_copies(g)
        _torch_kernels.foreach_mul_(g, scale)
    sgd_multi_tensor(
        p,
        g,
        m,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        wd_after_momentum=wd_after_momentum,
        first_run=first_run,
        found_inf=noop_flag.reshape(()).ne(0).to(torch.float32),
        model_params=tensor_lists[3] if len(tensor_lists) == 4 else None,
    )


class FusedSGD(FusedOptimizer):
    """SGD with Apex's ``FusedSGD`` signature and defaults.

    Momentum follows torch/Apex (``buf = momentum*buf + (1-dampening)*grad``, starting at the gradient).
    ``wd_after_momentum=True`` adds the weight decay to the update after momentum instead of to the gradient.
    State per parameter: ``momentum_buffer`` (float32). Buffers are created as zeros, never as torch's
    uninitialised ``empty_like``, so a skipped first step cannot leave garbage behind.
    ``materialize_master_grads`` is accepted and stored for amp; the optimizer's math does not depend on it.
    """

    # Apex's constructor (arguments, order, defaults), spelled out for users and IDEs.
    def __init__(
        self,
        params: ParamsT,
        lr: float | _RequiredParameter = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        implementation: Implementation = "multi_tensor",
    ) -> None:
        if not isinstance(lr, _RequiredParameter) and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr!r}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum!r}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none=set_grad_none, implementation=implementation)
        self.multi_tensor_sgd = multi_tensor_sgd
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One SGD step over every group."""
        loss = self._evaluate(closure)
        for group in self.param_groups:
            params = self._params_with_grads(group)
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        scaling = self._amp_scaling(params[0].device)
        grads = [p.grad for p in params]
        self._update_group(group, params, params, grads, scaling.grad_scale, scaling.found_inf)  # type: ignore[arg-type]

    # -- amp's master-update protocol (ampinit._masters.update.MasterUpdate) --------------------------------
    def check_master_update(self) -> None:
        """amp may run this update on masters it keeps, in every configuration: nothing to refuse."""

    def update_masters(self, group: dict[str, Any], chunks: Iterable[MasterChunk], found_inf: Tensor | None) -> None:
        """This optimizer's SGD step of ``group`` on the fp32 masters amp hands it (``master_weights="remainder"``)."""
        for params, masters, grads in chunks:
            self._update_group(group, params, masters, grads, None, found_inf)

    # -- amp's kernel step (ampinit._masters.kernel_step.KernelOptimizer) ----------------------------------
    kernel_update = "sgd"

    def kernel_settings(self, group: dict[str, Any]) -> SgdSettings | None:
        """The group in the kernels' terms (torch's SGD rule); None with weight decay after momentum, which the
        kernels lack. A zero buffer's first step equals a first step from the grad (``0*m + 1*g``), so the kernels'
        first-step launch covers this optimizer's zero-initialised buffers too."""
        if self.wd_after_momentum and group["weight_decay"] != 0:
            return None
        return SgdSettings(
            float(group["lr"]), group["momentum"], group["dampening"], group["nesterov"], group["weight_decay"], False
        )

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        targets: list[Tensor],
        grads: list[Tensor],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """SGD on ``targets`` with ``grads``, ``params`` keying the momentum buffers: the parameters themselves
        (``step``), or their fp32 masters (``master_weights="remainder"``). ``found_inf``: 0-d float32, 1.0 to skip.
        """
        momentum, dampening = group["momentum"], group["dampening"]
        fresh = [momentum != 0 and "momentum_buffer" not in self.state[p] for p in params]
        # With zero dampening a zero buffer gives exactly the first-run result (0*momentum + 1*grad), so new
        # and old buffers share one launch and a skipped first step keeps them at zero. With dampening the
        # first run differs; knowing whether it really happened then costs one host sync, once per buffer.
        if dampening != 0 and any(fresh) and found_inf is not None and bool(found_inf):
            return
        for p, new in zip(params, fresh):
            if new:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        update = sgd_multi_tensor if self.implementation == "multi_tensor" else sgd_single_tensor
        batches = [(False, list(range(len(params))))]
        if dampening != 0 and any(fresh):
            batches = [
                (True, [i for i, new in enumerate(fresh) if new]),
                (False, [i for i, new in enumerate(fresh) if not new]),
            ]
        for first_run, indices in batches:
            if not indices:
                continue
            update(
                [targets[i] for i in indices],
                [grads[i] for i in indices],
                [self.state[params[i]]["momentum_buffer"] for i in indices] if momentum != 0 else [],
                lr=group["lr"],
                momentum=momentum,
                dampening=dampening,
                weight_decay=group["weight_decay"],
                nesterov=group["nesterov"],
                wd_after_momentum=self.wd_after_momentum,
                first_run=first_run,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
