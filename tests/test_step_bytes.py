"""The bytes an O2/O5 step moves per parameter, read from the passes it launches (issue 24's byte ledger).

Every per-element pass of a ``scale_loss`` exit and an ``optimizer.step()`` goes through the engine's multi-tensor
ops (``ampinit._torch_kernels``) or the master-step kernels (``ampinit._masters.triton_kernels``); the ledger wraps
both and adds up, per pass, the bytes of the lists each reads and writes (their dtypes and numels). Per-tensor
scalars (step counts, bias corrections) are not per-parameter traffic and are not counted.

The floor for Adam with fp32 moments: the step reads the half grad (2), the fp32 master (4) and the two moments (8)
and writes the half weight (2), the master and the moments: 28 bytes per parameter. The overflow check is a pass
of its own (2 bytes read per parameter), as native ``GradScaler.unscale_`` is (which reads and writes the fp32
grads of an autocast model: 8). Master grads asked for (clipping through ``amp.master_params``) cost their pass;
``amp.clip_grad_norm_`` costs a read of the half grads. torch's ``_foreach_norm`` and ``_foreach_mul_`` (a clip's
passes) are counted too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import _torch_kernels, amp
from ampinit._masters.reference import Masters

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels are tested through it")


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _masters_read(masters: Masters) -> list[torch.Tensor]:
    return [*masters.masters, *masters.weights, *masters.remainders] if masters.remainders else [*masters.masters]


def _masters_written(masters: Masters) -> list[torch.Tensor]:
    return [*masters.masters, *masters.weights, *masters.remainders]


#: name -> (what it reads, what it writes), from its arguments. A Triton step reads its momentum buffers unless
#: ``first_step`` sets them.
PASSES: dict[str, Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]]] = {
    "check_finite_": lambda grads, *_: (list(grads), []),
    "unscale_and_check_": lambda grads, *_: (list(grads), list(grads)),
    "copy_": lambda dst, src: (list(src), list(dst)),
    "mul_": lambda tensors, factor: (list(tensors), list(tensors)),
    "add_": lambda tensors, others: ([*tensors, *others], list(tensors)),
    "_foreach_norm": lambda tensors, *_, **__: (list(tensors), []),  # torch's, in its clip
    "foreach_norm": lambda tensors, *_, **__: (list(tensors), []),  # the same kernel, in amp.clip_grad_norm_
    "_foreach_mul_": lambda tensors, factor: (list(tensors), list(tensors)),
    "adam_": lambda grads, masters, m, v, *_, **__: (
        [*grads, *_masters_read(masters), *m, *v],
        [*_masters_written(masters), *m, *v],
    ),
    "sgd_": lambda grads, masters, bufs, *_, first_step, **__: (
        [*grads, *_masters_read(masters), *([] if first_step else bufs)],
        [*_masters_written(masters), *bufs],
    ),
}


class Ledger:
    """Bytes read and written by each pass launched while it records, in launch order."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int, int]] = []
        self.recording = False

    def wrap(self, module: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self.recording:
                read, written = PASSES[name](*args, **kwargs)
                if read or written:  # empty lists launch nothing
                    self.passes.append((name, _bytes(read), _bytes(written)))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        self.passes, self.recording = [], True
        try:
            yield
        finally:
            self.recording = False

    def per_param(self, n: int) -> list[tuple[str, float]]:
        """Each pass's bytes (read + written) per parameter."""
        return [(name, (read + written) / n) for name, read, written in self.passes]


@pytest.fixture
def ledger(kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    book = Ledger()
    for name in ("check_finite_", "unscale_and_check_", "copy_", "mul_", "add_", "foreach_norm"):
        book.wrap(_torch_kernels, name, monkeypatch)
    for name in ("adam_", "sgd_"):
        book.wrap(kernels_on_cpu, name, monkeypatch)
    for name in ("_foreach_norm", "_foreach_mul_"):  # a clip's passes: torch's, or amp.clip_grad_norm_'s
        book.wrap(torch, name, monkeypatch)
    return book


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))  # every parameter half, with a master


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def amp_ledger(
    ledger: Ledger, level: str, make_opt: Callable[[Any], torch.optim.Optimizer], clip: str | None = None
) -> list[tuple[str, float]]:
    """The passes of the third step (the optimizer state exists) of ``level``, per parameter; ``clip``: clipped
    by Apex's pattern (``"apex"``) or by ``amp.clip_grad_norm_`` (``"amp"``) before the step."""
    model = _model()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        for step in range(3):
            with ledger.record() if step == 2 else contextlib.nullcontext():
                with amp.scale_loss(
                    model(_batch(step).to(torch.float16 if level == "O2" else torch.bfloat16)).float().pow(2).mean(),
                    opt,
                ) as scaled:
                    scaled.backward()
                if clip == "apex":
                    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)
                elif clip == "amp":
                    amp.clip_grad_norm_(opt, 1e-3)
                opt.step()
                opt.zero_grad()
        return ledger.per_param(_params(model))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_the_default_adamw_step_moves_the_byte_floor(ledger: Ledger, level: str) -> None:
    passes = amp_ledger(ledger, level, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    # The exit's overflow check (the half grads, read once), then the one-pass step at the floor; nothing else.
    assert passes == [("check_finite_", 2.0), ("adam_", 28.0)]


def test_sgd_with_momentum_moves_its_floor(ledger: Ledger) -> None:
    passes = amp_ledger(ledger, "O2", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    # Half grad 2, master 4, buffer 4 read; weight 2, master 4, buffer 4 written.
    assert passes == [("check_finite_", 2.0), ("sgd_", 20.0)]


def test_the_overflow_check_reads_less_than_native_grad_scaler(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native fp16 autocast + GradScaler pays an unscale pass too: it reads and writes the fp32 grads."""
    native: list[int] = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def unscale(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        native.append(2 * _bytes(grads))
        real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unscale)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(_batch(0)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    native_per_param = sum(native) / _params(model)
    assert native_per_param == 8.0
    ours = dict(amp_ledger(ledger, "O2", lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
    assert ours["check_finite_"] < native_per_param


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_master_grads_asked_for_cost_their_pass(ledger: Ledger, level: str) -> None:
    """Clipping through ``amp.master_params`` (Apex's pattern) makes the fp32 master grads (a copy of the half
    grads, unscaled at O2's dynamic scale), torch's clip reads them (4 bytes) and multiplies them (8), and the step
    reads them (4 bytes) instead of the half grads (2): 22 bytes of grads beside the update's 26."""
    passes = amp_ledger(ledger, level, lambda ps: torch.optim.AdamW(ps, lr=1e-3), clip="apex")
    unscale = [("mul_", 8.0)] if level == "O2" else []
    clip = [("_foreach_norm", 4.0), ("_foreach_mul_", 8.0)]
    assert passes == [("check_finite_", 2.0), ("copy_", 6.0), *unscale, *clip, ("adam_", 30.0)]


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_amp_clip_grad_norm_reads_the_half_grads_once_and_the_step_stays_at_its_floor(
    ledger: Ledger, level: str
) -> None:
    """``amp.clip_grad_norm_`` takes each half grad's norm (2 bytes read) and hands the coefficient to the step,
    which stays at the floor: 4 bytes of grads beside the update's 26."""
    passes = amp_ledger(ledger, level, lambda ps: torch.optim.AdamW(ps, lr=1e-3), clip="amp")
    assert passes == [("check_finite_", 2.0), ("foreach_norm", 2.0), ("adam_", 28.0)]
