"""What the host-work tests share: Triton launches replaced by a counting stand-in (and the finite check counted),
the aten ops of a call (by torch's profiler, which also sees the ops an op runs inside itself), and the third
``optimizer.step()`` of an amp session over a number of parameter tensors, measured."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ampinit import amp

_M = TypeVar("_M")


def counted_checks(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``kernels.check_finite_`` (the master step's finite check) made to record, per call, how many grads it
    checked, and still check them: the list it records into."""
    calls: list[int] = []
    check = kernels.check_finite_

    def counted(grads: list[torch.Tensor], flag: torch.Tensor) -> None:
        calls.append(len(grads))
        check(grads, flag)

    monkeypatch.setattr(kernels, "check_finite_", counted)
    return calls


class NoLaunch:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](...)`` is accepted, counted and does nothing. ``every``
    counts the launches of every stand-in (what a step launches besides its aten ops)."""

    every = 0

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1
            NoLaunch.every += 1

        return launch


def aten_ops(step: Callable[[], None]) -> Counter[str]:
    """The aten ops ``step`` runs, by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


def third_step(
    level: str,
    tensors: int,
    measure: Callable[[Callable[[], None]], _M],
    make_opt: Callable[[Any], torch.optim.Optimizer],
    **options: Any,
) -> _M:
    """``measure`` of the third ``optimizer.step()`` of a session at ``level`` (with ``options``) over ``tensors``
    parameters of 16 elements, each step after a ``scale_loss`` block whose backward hands every parameter a grad."""
    gen = torch.Generator().manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(tensors)])
    opt = make_opt(params.parameters())
    amp.initialize(params, opt, opt_level=level, verbosity=0, **options)  # type: ignore[call-overload]
    session = amp.current_session()
    assert session is not None
    anchor = torch.zeros((), requires_grad=True)
    # The same grad tensors every step: fresh ones would land at addresses the allocator reuses in no fixed order,
    # so the grads' launch table would be found in its cache in one run and built again in another.
    grads = [torch.full_like(p, 0.01) for p in params]
    try:
        for step in range(3):
            with session.scale_loss(anchor * 1.0, opt) as scaled:
                scaled.backward()
                for p, g in zip(params, grads):
                    p.grad = g
            if step < 2:
                opt.step()
        return measure(opt.step)
    finally:
        session.close()
