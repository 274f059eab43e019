"""The stuck-weight report: per parameter tensor, how much of a step's update the model's dtype rounded away.

A bf16 weight stops learning without any error when its updates are smaller than half a bf16 ulp: the weight's
bits stay the same step after step (NVIDIA Model-Optimizer PR #2322: 78% of q/k norm weights still exactly 1.0
at step 56k). With ``initialize(..., stuck_weights_every=N)`` every N-th ``step()`` of each optimizer measures,
for each of its parameter tensors, the fraction of elements that were *stuck* this step: the model weight's bits
did not change although the element's update was nonzero. Whether the update was nonzero is read

- with masters (anything :meth:`AmpSession.master_for` answers for: fp32 masters, remainder masters): from the
  master, which changed;
- without (``master_weights=False``, fp32 parameters, and settings whose "master" is the weight itself, widened,
  before and after the step, as with stochastic rounding into the weight): from what the update is made of: a
  nonzero gradient, a nonzero floating optimizer-state tensor of the parameter's shape (``exp_avg``,
  ``momentum_buffer``...) after the step, or a nonzero weight in a group with ``weight_decay``. Under stochastic
  rounding an element left unchanged this step still moves in expectation, so there the fraction says how often
  a step rounds away, not that the tensor stopped.

Only measuring steps pay: a snapshot of the weights and masters before the step, a comparison after it, and one
host read of all the counts (with the device's skip flag, in ``sync_free`` mode). Other steps count a call.
A skipped step measures nothing: the report keeps the last measurement, whose ``step`` then tells its age.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ampinit._optimizer_record import OptimizerRecord

logger = logging.getLogger("ampinit")

#: A measurement's log line names the tensors with at least this fraction of their elements stuck.
LOG_THRESHOLD = 0.5

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class StuckReport:
    """The last stuck-weight measurement of a session (``AmpStats.stuck_weights``).

    Attributes:
        step: the session's step count (``AmpStats.steps``) at the step measured.
        fractions: parameter name (from the models' ``named_parameters()``; with several models, prefixed by the
            model's position in ``initialize``'s list: ``"1.fc.weight"``) -> the fraction of its elements whose
            nonzero update left the weight's bits unchanged at that step. With several optimizers, each tensor's
            value is from its own optimizer's latest measurement.
    """

    step: int
    fractions: Mapping[str, float]

    def stuck(self, threshold: float = LOG_THRESHOLD) -> dict[str, float]:
        """The tensors with at least ``threshold`` of their elements stuck, most stuck first."""
        above = [(name, f) for name, f in self.fractions.items() if f >= threshold]
        return dict(sorted(above, key=lambda item: -item[1]))


@dataclass
class _Entry:
    """One parameter tensor of a measuring step: its snapshots before the step."""

    name: str
    weight: torch.Tensor  # the model parameter
    weight_before: torch.Tensor
    master_before: torch.Tensor | None
    weight_decay: bool


class StuckWeights:
    """Counts each optimizer's steps and measures every ``every``-th one (see the module docstring)."""

    def __init__(self, every: int, models: Sequence[nn.Module]) -> None:
        self.every = every
        self._models = list(models)
        self._calls: dict[int, int] = {}  # id(optimizer record) -> step() calls so far
        self.last: StuckReport | None = None

    def before_step(
        self, record: OptimizerRecord, skip: bool, master_for: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> list[_Entry] | None:
        """Count the call; on a measuring step that is not skipped on the host, snapshot its tensors."""
        calls = self._calls.get(id(record), 0) + 1
        self._calls[id(record)] = calls
        if skip or calls % self.every:
            return None
        # With several models their names can repeat (a GAN's two halves): prefixed by the model's position.
        several = len(self._models) > 1
        names = {
            id(p): f"{k}.{name}" if several else name
            for k, model in enumerate(self._models)
            for name, p in model.named_parameters()
        }
        model_of = {id(master): param for param, master in record.grads.pairs()}
        entries = []
        with torch.no_grad():
            for g, group in enumerate(record.optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    weight = model_of.get(id(param), param)
                    if not weight.requires_grad:
                        continue
                    master = master_for(weight)
                    name = names.get(id(weight), f"{type(record.optimizer).__name__}.param_groups[{g}][{i}]")
                    entries.append(
                        _Entry(
                            name=name,
                            weight=weight,
                            weight_before=weight.detach().clone(),
                            master_before=None if master is None else master.detach().clone(),
                            weight_decay=bool(group.get("weight_decay", 0)),
                        )
                    )
        return entries

    def after_step(
        self,
        record: OptimizerRecord,
        entries: list[_Entry],
        flag: torch.Tensor | None,
        step: int,
        master_for: Callable[[torch.Tensor], torch.Tensor | None],
        verbosity: int,
    ) -> None:
        """Count the stuck elements of every snapshot tensor, read them (and ``flag``) at once, keep the report."""
        if not entries:
            return
        with torch.no_grad():
            counts = [_stuck_count(entry, record.optimizer, master_for) for entry in entries]
            values = torch.stack([c.to(entries[0].weight.device) for c in counts])
            if flag is not None:  # sync_free: the step may have been skipped on the device
                values = torch.cat([values, flag.reshape(1).to(values)])
            read = values.tolist()
        if flag is not None and read.pop():
            return
        fractions = dict(self.last.fractions) if self.last is not None else {}
        for entry, count in zip(entries, read):
            fractions[entry.name] = count / entry.weight.numel() if entry.weight.numel() else 0.0
        self.last = StuckReport(step=step, fractions=types.MappingProxyType(fractions))
        if verbosity >= 1:
            _log(self.last, [entry.name for entry in entries])


def _stuck_count(
    entry: _Entry, optimizer: torch.optim.Optimizer, master_for: Callable[[torch.Tensor], torch.Tensor | None]
) -> torch.Tensor:
    weight = entry.weight.detach()
    unchanged = _bits(weight) == _bits(entry.weight_before)
    if entry.master_before is None:
        return (unchanged & _update_nonzero(entry, optimizer)).sum()
    master = master_for(entry.weight)
    assert master is not None  # a tensor with a master before the step has one after it
    master = master.detach()
    updated = _bits(master) != _bits(entry.master_before)
    # A "master" that is only the weight widened, before and after (stochastic rounding into the weight: no
    # master is kept), changes exactly when the weight does; then the update is read as without a master. Decided
    # on the device, so that the measurement still reads the host once.
    no_own_master = (_bits(entry.master_before) == _bits(entry.weight_before.to(master.dtype))).all() & (
        _bits(master) == _bits(weight.to(master.dtype))
    ).all()
    updated = torch.where(no_own_master, _update_nonzero(entry, optimizer), updated)
    return (unchanged & updated).sum()


def _update_nonzero(entry: _Entry, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Without a master: where the step's update was nonzero, from what it is made of (module docstring)."""
    weight = entry.weight
    nonzero = torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
    if weight.grad is not None and not weight.grad.is_sparse:
        nonzero |= weight.grad != 0
    for value in optimizer.state.get(weight, {}).values():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == weight.shape:
            nonzero |= value.to(weight.device) != 0
    if entry.weight_decay:
        nonzero |= entry.weight_before != 0
    return nonzero


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: equal bits are an unchanged value, -0.0 and NaNs included."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def _log(report: StuckReport, measured: list[str]) -> None:
    stuck = {name: f for name, f in report.stuck().items() if name in measured}
    if stuck:
        listed = ", ".join(f"{name} {fraction:.1%}" for name, fraction in stuck.items())
        logger.info(
            "stuck weights at step %d: %d of %d tensors had >= %.0f%% of their updates rounded away: %s",
            report.step,
            len(stuck),
            len(measured),
            LOG_THRESHOLD * 100,
            listed,
        )
    else:
        logger.info(
            "stuck weights at step %d: no tensor of %d had >= %.0f%% of its updates rounded away",
            report.step,
            len(measured),
            LOG_THRESHOLD * 100,
        )
