"""``apex.parallel.LARC``: layer-wise adaptive rate clipping/scaling around any optimizer.

For each parameter with a gradient, ``adaptive_lr = trust_coefficient * |p| / (|g| + |p| * weight_decay + eps)``
(with ``clip``: ``min(adaptive_lr / lr, 1)``), then ``g = (g + weight_decay * p) * adaptive_lr`` and the wrapped
optimizer steps with its weight decay switched off for that step. Parameters whose weight or gradient norm is zero
are left alone, as in Apex. Unlike Apex, the factors are computed on the device (no host sync per parameter) and
the group's weight decay is restored even if the inner step raises.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LARC"]


class LARC:
    """A wrapper (not an ``Optimizer`` subclass, as in Apex) that amp's ``initialize``/``scale_loss`` accept."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8
    ) -> None:
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = self.optim.__getstate__()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optim.__setstate__(state)

    @property
    def state(self) -> Any:
        return self.optim.state

    def __repr__(self) -> str:
        return f"LARC({self.optim!r})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def step(self) -> Any:
        weight_decays = []
        try:
            with torch.no_grad():
                for group in self.optim.param_groups:
                    weight_decay = group.get("weight_decay", 0)
                    weight_decays.append(weight_decay)
                    group["weight_decay"] = 0
                    for p in group["params"]:
                        if p.grad is not None:
                            self._adapt(p, p.grad, weight_decay, group["lr"])
            return self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay

    def _adapt(self, p: torch.Tensor, grad: torch.Tensor, weight_decay: float, lr: float) -> None:
        param_norm = torch.linalg.vector_norm(p.float())
        grad_norm = torch.linalg.vector_norm(grad.float())
        adaptive_lr = self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
        if self.clip:
            adaptive_lr = (adaptive_lr / lr).clamp(max=1.0)
        active = (param_norm != 0) & (grad_norm != 0)
        factor = torch.where(active, adaptive_lr, torch.ones_like(adaptive_lr))
        decay = torch.where(active, torch.full_like(adaptive_lr, weight_decay), torch.zeros_like(adaptive_lr))
        grad.add_(p * decay.to(p.dtype)).mul_(factor.to(grad.dtype))
