"""What every ampinit fused optimizer shares: the AMP-scaling protocol, Apex's ``zero_grad``, fp32 state."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

import torch
from torch import Tensor

from ampinit._torch_kernels import device_scalar

Implementation = Literal["multi_tensor", "single_tensor"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# A module-level alias is evaluated at import time, so it spells the union without ``|`` (Python 3.9).
ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


@dataclass(frozen=True)
class AmpScaling:
    """The AMP inputs of one step, moved to one device.

    ``grad_scale``: 0-d float32 tensor that gradients are divided by, or None.
    ``found_inf``: 0-d float32 tensor, exactly 1.0 when the step must be skipped and 0.0 otherwise, or None.
    ``skip``: ``found_inf`` as a 0-d bool tensor, or None.
    """

    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None
    skip: Tensor | None = None

    def kernel_arguments(self) -> KernelAmpArguments:
        """The ``grad_scale``/``found_inf`` keyword arguments of torch's fused optimizer kernels."""
        return {"grad_scale": self.grad_scale, "found_inf": self.found_inf}


class KernelAmpArguments(TypedDict):
    grad_scale: Tensor | None
    found_inf: Tensor | None


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the ampinit fused optimizers.

    AMP-scaling protocol (the one ``torch.amp.GradScaler`` uses with ``torch.optim.Adam(fused=True)``): the
    class sets ``_step_supports_amp_scaling = True``, and ``step()`` reads two optional attributes set by the
    caller: ``grad_scale`` (gradients are divided by it inside the update) and ``found_inf`` (when nonzero
    the step changes nothing: parameters, state and step counters stay bitwise identical). Both are read on
    the device, so the step never waits for the host.

    Optimizer state is float32 for every parameter dtype: half-precision parameters are updated with float32
    math and rounded once, as Apex's kernels do.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        set_grad_none: bool,
        implementation: Implementation,
    ) -> None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"Invalid implementation: {implementation!r}. Allowed values: {IMPLEMENTATIONS}")
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.implementation: Implementation = implementation
        # Apex's optimizers carry a zero int32 flag for the amp_C ops they call (subclasses such as fairseq's
        # pass it to those ops themselves); the steps here do not use it.
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)

    @staticmethod
    def _evaluate(closure: Callable[[], float] | None) -> float | None:
        """The loss from ``closure`` (run with gradients enabled, as torch.optim does), or None."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: set them to None if ``set_grad_none`` (the constructor flag), else zero them.

        An explicit ``set_to_none`` overrides the constructor flag, as in ``torch.optim.Optimizer``.
        """
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does, then keep floating-point state in float32.

        torch casts loaded state to the dtype of its parameter, which would round fp32 moments of half
        parameters to half. The values are taken again from ``state_dict`` so nothing is lost.

        The load's post hooks run last, as torch runs them, so that they see the state this method leaves: amp's
        precision dial re-encodes loaded moments into its stored format in one (bf16 or 8-bit moments), which the
        float32 copies would otherwise replace.
        """
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_post_hooks = post_hooks
        # torch keeps the saved group dicts' values by reference; per-group tensors (step counters, NovoGrad
        # norms) are updated in place, so they must not be shared with the dict or another optimizer.
        for group in self.param_groups:
            for key, value in group.items():
                if isinstance(value, Tensor):
                    group[key] = value.clone()
                elif key != "params" and isinstance(value, list) and any(isinstance(v, Tensor) for v in value):
                    group[key] = [v.clone() if isinstance(v, Tensor) else v for v in value]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)
        for post_hook in post_hooks.values():
            post_hook(self)

    def _params_with_grads(self, group: dict[str, Any]) -> list[Tensor]:
        """The group's parameters that have a gradient, after checking sparsity and dtype."""
        name = type(self).__name__
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name} supports float32, float16 and bfloat16 parameters, got one of {p.dtype!r}")
            params.append(p)
        return params

    def _zero_state(self, params: Iterable[Tensor], *names: str) -> None:
        """Create the named float32 state tensors, as zeros, of each parameter that has no state yet."""
        for p in params:
            if not self.state[p]:
                for name in names:
                    self.state[p][name] = torch.zeros_like(p, dtype=torch.float32)

    @contextmanager
    def _adam_step(self, group: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The keyword arguments of an Adam-family update of ``group`` (this step's number, the group's
        hyperparameters, the AMP inputs); the group's step is counted, unless skipped, when the block ends."""
        device = group["params"][0].device
        scaling = self._amp_scaling(device)
        step = group_step(group, device)
        beta1, beta2 = group["betas"]
        yield dict(
            step=step + 1,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=bool(group["bias_correction"]),
            grad_scale=scaling.grad_scale,
            found_inf=scaling.found_inf,
        )
        advance_step(step, scaling)

    def _amp_scaling(self, device: torch.device) -> AmpScaling:
        """This step's ``grad_scale``/``found_inf`` attributes, on ``device``, without a host sync."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is not None:
            grad_scale = grad_scale.to(device=device, dtype=torch.float32).reshape(())
        if found_inf is None:
            return AmpScaling(grad_scale=grad_scale)
        # GradScaler sums found_inf over devices, and torch's fused kernels skip only on exactly 1.0.
        skip = found_inf.to(device=device).reshape(()).ne(0)
        return AmpScaling(grad_scale=grad_scale, found_inf=skip.to(torch.float32), skip=skip)


def group_step(group: dict[str, Any], device: torch.device) -> Tensor:
    """The group's step counter as a 0-d float32 tensor on ``device``, created at 0 on first use.

    Apex keeps ``group['step']`` as a Python int; ampinit keeps it on the device so that a skipped step can
    leave it unchanged without a host sync. An int loaded from an Apex checkpoint is converted here.
    """
    step = group.get("step", 0)
    if not isinstance(step, Tensor):
        step = device_scalar(float(step), device)
    elif step.device != device or step.dtype != torch.float32:
        step = step.to(device=device, dtype=torch.float32)
    group["step"] = step
    return step


def advance_step(step: Tensor, scaling: AmpScaling) -> None:
    """Count one step, unless this step is skipped."""
    if scaling.found_inf is None:
        step.add_(1)
    else:
        step.add_(1 - scaling.found_inf.to(step.device))


def adam_defaults(
    name: str,
    amsgrad: bool,
    lr: float,
    bias_correction: bool,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> dict[str, Any]:
    """Check the arguments every Adam-family constructor of Apex takes (none has AMSGrad) and return them as
    group defaults, in Apex's order."""
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")
    check_hyperparameters(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay)
    return dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)


def check_hyperparameters(*, lr: float, eps: float, betas: tuple[float, float], weight_decay: float) -> None:
    """ValueErrors for the Adam-family hyperparameters, worded as torch.optim words them."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr!r}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps!r}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]!r}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r}")
