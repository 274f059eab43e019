"""``apex.parallel.distributed``: Apex's DistributedDataParallel and Reducer on torch.distributed.

``DistributedDataParallel`` is ``torch.nn.parallel.DistributedDataParallel`` with Apex's constructor. What torch
can express is honoured: ``message_size`` becomes ``bucket_cap_mb``; ``gradient_average=False``,
``gradient_predivide_factor`` and ``allreduce_always_fp32`` become a communication hook; ``delay_allreduce=True``
(which Apex users set for models with parameters that get no gradient) becomes ``find_unused_parameters=True``,
without which torch's DDP fails on the second iteration of such a model. The rest only tuned Apex's own
CUDA-stream scheduling (``num_allreduce_streams``, ...): it is accepted, explained once in a warning, and has no
effect on the result. The table of what each argument becomes is ``_ddp_arguments.APEX_DDP_ARGUMENTS``, shared
with the codemod.

``flat_dist_call(tensors, call, extra_args=None)`` is Apex's helper: the tensors are grouped by type, each group
flattened, ``call(flat, *extra_args)`` run on it (an ``all_reduce`` is then divided by the world size) and the
result copied back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampinit import _torch_kernels
from ampinit.compat.apex.parallel._ddp_arguments import NO_EFFECT

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

_warned: set[str] = set()


@dataclass
class _HookState:
    group: Any
    average: bool
    predivide: float
    always_fp32: bool


def _apex_allreduce_hook(state: _HookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Apex's reduction: optionally in fp32, divided by ``predivide`` before the sum and the rest after it."""
    buffer: torch.Tensor = bucket.buffer()
    work = buffer.float() if state.always_fp32 and buffer.dtype != torch.float32 else buffer
    if state.predivide != 1.0:
        work.div_(state.predivide)
    handle: Any = dist.all_reduce(work, group=state.group, async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = handle.get_future()

    def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced: torch.Tensor = done.value()[0]
        if state.average:
            reduced.div_(dist.get_world_size(state.group) / state.predivide)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    result: torch.futures.Future[torch.Tensor] = future.then(finish)
    return result


# torch's DDP checks a hook's annotations as objects; this module's annotations are strings (PEP 563).
_apex_allreduce_hook.__annotations__["bucket"] = dist.GradBucket  # type: ignore[attr-defined]
_apex_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """``apex.parallel.DistributedDataParallel(module, ...)`` as torch's DDP (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Any = None,
        prof: bool = False,
    ) -> None:
        given = {
            "shared_param": shared_param,
            "allreduce_trigger_params": allreduce_trigger_params,
            "retain_allreduce_buffers": retain_allreduce_buffers,
            "num_allreduce_streams": num_allreduce_streams,
            "allreduce_communicators": allreduce_communicators,
            "gradient_average_split_factor": gradient_average_split_factor,
            "prof": prof,
        }
        _explain_ignored(given)
        # Apex's message_size counts elements; torch's bucket_cap_mb counts MiB (4-byte elements assumed).
        super().__init__(module, bucket_cap_mb=message_size * 4 / 2**20, find_unused_parameters=bool(delay_allreduce))
        if not gradient_average or gradient_predivide_factor != 1.0 or allreduce_always_fp32:
            state = _HookState(
                self.process_group, gradient_average, float(gradient_predivide_factor), allreduce_always_fp32
            )
            self.register_comm_hook(state, _apex_allreduce_hook)

    def disable_allreduce(self) -> None:
        """Apex's switch for gradient accumulation: the following backward passes keep their gradients local
        (torch's ``no_sync()``, left on until :meth:`enable_allreduce`)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Reduce the gradients again from the next forward on (undoes :meth:`disable_allreduce`)."""
        self.require_backward_grad_sync = True


def _explain_ignored(given: dict[str, Any]) -> None:
    """One warning per process for each Apex-only argument set to a non-default value."""
    fresh = [name for name, value in given.items() if value != NO_EFFECT[name].default and name not in _warned]
    if not fresh:
        return
    _warned.update(fresh)
    reasons = "; ".join(f"{name}={given[name]!r}: {NO_EFFECT[name].reason}" for name in fresh)
    warnings.warn(
        f"apex.parallel.DistributedDataParallel runs as torch.nn.parallel.DistributedDataParallel; these Apex-only "
        f"arguments are accepted and have no effect: {reasons}. (This warning is shown once.)",
        UserWarning,
        stacklevel=3,
    )


def flat_dist_call(tensors: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Any = None) -> None:
    """Apex's ``flat_dist_call``: one collective per tensor type on the flattened tensors, copied back in place;
    after ``dist.all_reduce`` the result is divided by the world size (an average, as Apex does)."""
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((str(tensor.device), tensor.dtype), []).append(tensor)
    for bucket in groups.values():
        flat: torch.Tensor = _torch_kernels.flatten_dense_tensors(bucket)
        if extra_args is not None:
            call(flat, *extra_args)
        else:
            call(flat)
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        with torch.no_grad():
            for tensor, synced in zip(bucket, _torch_kernels.unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)


class Reducer:
    """Average gradients across processes when :meth:`reduce` is called (no hooks, no overlap).

    Give it a module (its parameters are broadcast from rank 0 now, and their grads reduced) or a list of tensors.
    """

    def __init__(self, module_or_grads_list: nn.Module | list[torch.Tensor]) -> None:
        if isinstance(module_or_grads_list, nn.Module):
            self.module: nn.Module | None = module_or_grads_list
            self.grads: list[torch.Tensor] = []
            # As Apex: flattened, broadcast, and copied back. The copy is what amp's masters see: a collective writes
            # its tensor without bumping the version counter, so masters made at initialize (O2/O5) would not
            # follow the broadcast weights and each rank would go on training its own.
            flat_dist_call([param.detach() for param in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        world = dist.get_world_size()
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(world)
