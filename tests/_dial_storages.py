"""One list's storages under the precision dial, as the dial's kernel and step tests keep them: the tensors a step
updates (fp32 masters, bf16 weights, remainders, moment values, 8-bit block scales) and the setting they hold."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

_S = TypeVar("_S", bound="Storages")


@dataclass
class Storages:
    kind: str  # the master kind ("fp32", "fp32+weights", "remainder", "remainder8", "stochastic")
    fmt: str  # the moments' format ("fp32", "bf16", "8bit")
    masters: list[torch.Tensor]
    weights: list[torch.Tensor]
    remainders: list[torch.Tensor]
    moments: list[list[torch.Tensor]]
    absmax: list[list[torch.Tensor]]

    def tensors(self) -> list[torch.Tensor]:
        """Every stored tensor, in one order."""
        nested = [x for xs in [*self.moments, *self.absmax] for x in xs]
        return [*self.masters, *self.weights, *self.remainders, *nested]

    def clone(self: _S) -> _S:
        """A copy of every tensor (the same class, the same setting)."""

        def copy(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            return [x.clone() for x in xs]

        return dataclasses.replace(
            self,
            masters=copy(self.masters),
            weights=copy(self.weights),
            remainders=copy(self.remainders),
            moments=[copy(m) for m in self.moments],
            absmax=[copy(a) for a in self.absmax],
        )
