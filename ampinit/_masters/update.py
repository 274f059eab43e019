"""Which update an optimizer's step runs when amp takes the step: the one classifier, and the protocol an
optimizer implements so that amp can run its update on masters amp hands it.

amp takes the step itself where the optimizer's own ``step()`` cannot see the masters: the Triton kernels
(fp32 or remainder masters, for torch's fused Adam/AdamW/SGD) and every remainder step, which joins fp32 masters
chunk by chunk. It then needs the optimizer's update as a function of masters, grads and state. torch's
``Adam``/``AdamW`` and ``SGD`` have one (their functional ``adam``/``sgd``, and the kernels' twins); any other
optimizer says it has one by implementing :class:`MasterUpdate`, the way torch's fused optimizers say they
unscale in their kernel with ``_step_supports_amp_scaling`` and take ``grad_scale``/``found_inf``. amp asks for
the capability and names no optimizer class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

#: ``"adam"``: torch's Adam/AdamW update; ``"sgd"``: torch's SGD update; ``"own"``: the optimizer's own
#: :class:`MasterUpdate`.
Update = Literal["adam", "sgd", "own"]

REMAINDER_OPTIMIZERS = (
    "torch.optim.Adam",
    "torch.optim.AdamW",
    "torch.optim.SGD",
    "ampinit.optimizers.FusedAdam",
    "ampinit.optimizers.FusedSGD",
)


class MasterChunk(NamedTuple):
    """Some of one param group's parameters, with the fp32 masters an update writes and their fp32 grads."""

    params: list[torch.Tensor]  # the optimizer's own parameters: they key its state
    masters: list[torch.Tensor]  # fp32, updated in place; amp stores them back when the next chunk is asked for
    grads: list[torch.Tensor]  # fp32, unscaled


@runtime_checkable
class MasterUpdate(Protocol):
    """An optimizer whose update amp may run on fp32 masters (``master_weights="remainder"`` and the rest of the
    precision dial: amp decodes masters and moments to fp32 around the update)."""

    def check_master_update(self) -> None:
        """Raise ``ValueError``, naming what to change, if this optimizer as configured cannot take the update."""

    def update_masters(
        self, group: dict[str, Any], chunks: Iterable[MasterChunk], found_inf: torch.Tensor | None
    ) -> None:
        """One step of ``group``: the update on every chunk, in order (each chunk is read in full before the
        next is asked for), state keyed by ``chunk.params``; nothing changes where ``found_inf`` (0-d float32) is
        1.0. Per-group counters advance once per call."""


def own_update(optimizer: torch.optim.Optimizer) -> MasterUpdate | None:
    """``optimizer`` if its class itself defines :class:`MasterUpdate`'s update, else None.

    A subclass inherits the method but may have changed ``step()``, which a step amp takes never calls: only the
    class that wrote the update is taken at its word, so subclasses are refused as they always were.
    """
    if isinstance(optimizer, MasterUpdate) and "update_masters" in vars(type(optimizer)):
        return optimizer
    return None


def update_of(optimizer: torch.optim.Optimizer) -> Update | None:
    """The update ``optimizer.step()`` runs, if amp can run it on masters itself; None otherwise."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    return "own" if own_update(optimizer) is not None else None


def dial_setting(master_weights: object, optimizer_state: str) -> str:
    """How an error names the precision setting amp takes the step for: ``master_weights='remainder8'``, or
    ``master_weights=True, optimizer_state='8bit'``."""
    setting = f"master_weights={master_weights!r}"
    return setting if optimizer_state == "fp32" else f"{setting}, optimizer_state={optimizer_state!r}"


def remainder_update(optimizer: torch.optim.Optimizer, setting: str = "master_weights='remainder'") -> Update:
    """The update amp's chunked step runs for ``optimizer`` under ``setting`` (as :func:`dial_setting` names it);
    ``ValueError`` naming the optimizer when none fits."""
    update = update_of(optimizer)
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if update is None:
        raise ValueError(
            f"{setting} does not support the optimizer {name}: it runs the update of "
            f"{', '.join(REMAINDER_OPTIMIZERS)} (subclasses excluded). Use master_weights=True (fp32 masters) and "
            "optimizer_state='fp32' "
            "with other optimizers."
        )
    own = own_update(optimizer)
    if own is not None:
        own.check_master_update()
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError(f"{setting} does not support {name}(differentiable=True)")
    return update
