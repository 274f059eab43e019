"""``apex.fp16_utils.FP16_Optimizer``: Apex's pre-amp master-weights wrapper, kept for code that still uses it.

It wraps an optimizer over a half-precision model: each half parameter in the param groups is replaced by an fp32
master, ``backward(loss)`` scales the loss and copies the unscaled grads to the masters, ``step()`` updates the
masters (or skips on overflow) and copies them back into the model. New code should use
``amp.initialize(..., opt_level="O2")``, which does the same with no wrapper object.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampinit._types import HALF_DTYPES
from ampinit.compat.apex.amp.scaler import LossScaler
from ampinit.compat.apex.fp16_utils.fp16util import clip_grad_norm

logger = logging.getLogger("ampinit")

__all__ = ["DeprecatedFeatureWarning", "FP16_Optimizer"]

DEPRECATION_MESSAGE = (
    "FP16_Optimizer is deprecated and dangerous, and will be deleted soon.  If it still works, you're probably "
    "getting lucky.  For mixed precision, use the documented API https://nvidia.github.io/apex/amp.html, with "
    "opt_level=O1."
)


class DeprecatedFeatureWarning(FutureWarning):
    """Apex's warning category for its deprecated APIs."""


class FP16_Optimizer:
    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        warnings.warn(DEPRECATION_MESSAGE, DeprecatedFeatureWarning, stacklevel=2)
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            fp16_params: list[torch.Tensor] = []
            masters: list[torch.Tensor] = []
            fp32_params: list[torch.Tensor] = []
            for index, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in HALF_DTYPES:
                    master = torch.nn.Parameter(param.detach().clone().float())
                    group["params"][index] = master
                    fp16_params.append(param)
                    masters.append(master)
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(
                        f"Wrapped parameters must be float32, float16 or bfloat16 tensors. Received {param.type()}"
                    )
            self.fp16_groups.append(fp16_params)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32_params)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # Recast any existing optimizer state to the masters' dtype.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.dynamic_loss_scale = dynamic_loss_scale
        if dynamic_loss_scale:
            self.loss_scaler = LossScaler("dynamic", **(dynamic_loss_args or {}))
        else:
            self.loss_scaler = LossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm: Callable[..., torch.Tensor] = clip_grad_norm

    # -- the step ----------------------------------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        for params in (*[g["params"] for g in self.optimizer.param_groups], *self.fp16_groups):
            for param in params:
                if set_grads_to_None:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_()
                    param.grad.zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then (by default) :meth:`update_master_grads`."""
        (loss.float() * self.loss_scaler.loss_scale()).backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model's grads into the masters' grads and decide whether the next step overflows."""
        self.loss_scaler.clear_overflow_state()
        model_grads, master_grads = [], []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is not None:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                model_grads.append(model.grad)
                master_grads.append(master.grad)
        scale = self.loss_scaler.loss_scale()
        self.loss_scaler.unscale(model_grads, master_grads, scale)
        own = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        self.loss_scaler.unscale(own, own, scale, models_are_masters=True)
        self.overflow = self.loss_scaler.update_scale()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the masters and copy them into the model, or skip after an overflow."""
        if closure is not None:
            raise RuntimeError(
                "FP16_Optimizer.step(closure) is not supported by ampinit's compatibility layer: call "
                "optimizer.backward(loss) and then optimizer.step() without a closure."
            )
        if self.overflow:
            logger.info("Gradient overflow.  Skipping step, reducing loss scale to %s", self.loss_scaler.loss_scale())
            return None
        result = self.optimizer.step()
        self._master_params_to_model_params()
        return result

    def _master_params_to_model_params(self) -> None:
        with torch.no_grad():
            for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
                model.copy_(master)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float | torch.Tensor:
        """Clip the masters' grads; returns the total norm, or -1 after an overflow (Apex's convention)."""
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        if self.overflow:
            logger.info("Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.")
            return None
        return [
            [None if p.grad is None else p.grad.data for p in group["params"]] for group in self.optimizer.param_groups
        ]

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Apex's keys: the scaler object itself, flags, the wrapped optimizer's state and the fp32 masters."""
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_scaler = state_dict["loss_scaler"]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for current, saved in zip(current_group, saved_group):
                    current.copy_(saved)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")
