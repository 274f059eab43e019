"""No host sync in an optimizer's step: every fused optimizer (plain and under the GradScaler protocol),
FusedMixedPrecisionLamb, and Apex's amp_C optimizer ops, counted by a dispatch mode that is itself checked to see
what it must."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import ampinit.multi_tensor as mt
from ampinit.optimizers import FusedAdam, FusedMixedPrecisionLamb
from tests.test_optimizers import IDS, OPTIMIZERS, small_net

# On CPU a sync cannot be seen directly; what would be one on CUDA can: reading a value on the host
# (`_local_scalar_dense`, behind .item()/bool()/float()) and building a tensor from host data
# (`lift_fresh`, behind torch.tensor(x, device=...), a blocking host-to-device copy on CUDA).
SYNC_OPS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.lift_fresh_copy", "aten.item")


class CountSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sync_counter() -> Iterator[CountSyncs]:
    counter = CountSyncs()
    yield counter


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad-scaler-protocol"])
@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_optimizer_steps_make_no_host_syncs(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], scaled: bool, sync_counter: CountSyncs
) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    net = small_net(0).half() if cls is FusedAdam else small_net(0)
    optimizer = cls(net.parameters(), **kwargs)
    if scaled:
        optimizer.grad_scale = torch.full((), 4.0)  # type: ignore[attr-defined]
        optimizer.found_inf = torch.zeros(())  # type: ignore[attr-defined]
    for _ in range(2):  # the first step creates state and step counters; the second is the steady state
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        with sync_counter:
            optimizer.step()
    assert sync_counter.seen == Counter()


@pytest.mark.parametrize("reduced", [None, torch.bfloat16])
def test_fused_mixed_precision_lamb_steps_make_no_host_syncs(
    reduced: torch.dtype | None, sync_counter: CountSyncs
) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""
    net = small_net(0).to(reduced or torch.float32)
    optimizer = FusedMixedPrecisionLamb(net.parameters(), reduced_precision_dtype=reduced)
    optimizer.grad_scale = torch.full((), 4.0)  # type: ignore[attr-defined]
    optimizer.found_inf = torch.zeros(())  # type: ignore[attr-defined]
    for _ in range(2):
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        with sync_counter:
            optimizer.step()
    assert sync_counter.seen == Counter()


def test_amp_c_optimizer_ops_make_no_host_syncs(sync_counter: CountSyncs) -> None:
    """Found by: the sweep of edge cases of the fused optimizers and amp_C ops."""

    def lists(n: int, dtype: torch.dtype = torch.float32) -> list[list[Tensor]]:
        return [[torch.rand(5, dtype=dtype) + 0.5, torch.rand(3, dtype=dtype) + 0.5] for _ in range(n)]

    flag = torch.zeros(1, dtype=torch.int32)
    norm = torch.ones(1)
    with sync_counter:
        mt.multi_tensor_adam(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-8, 3, 1, 1, 0.01)
        mt.multi_tensor_adam(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-8, 3, 0, 0, 0.01)
        mt.multi_tensor_lamb(0, flag, lists(4), 1e-3, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1, norm, 1.0)
        mt.multi_tensor_novograd(0, flag, lists(3), torch.ones(2), 1e-3, 0.9, 0.999, 1e-8, 3, 1, 0.0, 1, 1, 2)
        lr, step, scale = torch.full((), 1e-3), torch.full((), 3, dtype=torch.int32), torch.ones(1)
        mt.multi_tensor_adam_capturable(0, flag, lists(4), lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, scale)
        mt.multi_tensor_lamb_mp(
            0, flag, lists(4), lr, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, torch.ones(1), False, norm, scale
        )
    assert sync_counter.seen == Counter()


def test_sync_counter_sees_what_it_must(sync_counter: CountSyncs) -> None:
    """The counter is not blind: a torch.tensor() constant and an .item() are both seen.

    Found by: the sweep of edge cases of the fused optimizers and amp_C ops.
    """
    with sync_counter:
        torch.tensor(1.0).add(1).item()
    assert sync_counter.seen == Counter({"aten.lift_fresh": 1, "aten._local_scalar_dense": 1})
