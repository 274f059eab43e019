"""aten ops dispatched per training step, against native autocast: a deterministic stand-in for host time.

A step of a small decoder (the layout of ``benchmarks/gpu_train_step.py``, a few layers) is counted op by op with a
``TorchDispatchMode``, in two phases: the *model* (zero_grad, forward, loss, backward) and the *step* (leaving
``scale_loss``, where grads are unscaled into the masters, and ``optimizer.step()``; for native autocast,
GradScaler's step and update). Every op is a dispatcher round trip, a Python frame here and a kernel launch on a GPU,
so the counts bound the host work a level adds:

- O2/O5 dispatch no more than native autocast in total (no per-forward weight casts pay for the master step);
- O1/O4 dispatch native autocast's count plus a constant, with the same numerics: ``cast_policy="native"``
  against plain autocast, and the default Apex lists against autocast with the one Apex fp32 op of this model that
  CPU and CUDA autocast lack (``gelu``) written out as ``F.gelu(x.float())``;
- the step phase is the same count for 2 and 4 layers: work per parameter tensor in the step is one multi-tensor
  op per list, never one op per tensor.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampinit import amp
from ampinit._types import CastPolicyName, OptLevel

#: What O1/O4 may add to a whole step over native autocast with the same numerics, whatever the depth: the
#: session's scaler (its unscale-and-check, its update, one read of the overflow flag at a dynamic fp16 scale)
#: and the bookkeeping around it. Measured 7-13 on CPU with torch 2.13; the depth must not change it.
O1_O4_EXTRA_OPS = 16

LEVELS: dict[OptLevel, torch.dtype] = {
    "O1": torch.float16,
    "O2": torch.float16,
    "O4": torch.bfloat16,
    "O5": torch.bfloat16,
}


class PhaseCounter(TorchDispatchMode):
    """aten ops by phase: the test sets ``phase`` as the step goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "model"
        self.ops: dict[str, Counter[str]] = {"model": Counter(), "step": Counter()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[self.phase][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def total(self, phase: str | None = None) -> int:
        phases = [phase] if phase is not None else list(self.ops)
        return sum(sum(self.ops[p].values()) for p in phases)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, gelu_in_fp32: bool) -> None:
        super().__init__()
        self.heads, self.gelu_in_fp32 = heads, gelu_in_fp32
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.fc(self.ln2(x))
        return x + self.out(F.gelu(h.float() if self.gelu_in_fp32 else h, approximate="tanh"))


class Decoder(nn.Module):
    """GPT-2's layout at toy size: pre-LayerNorm blocks, learned positions, a tied embedding and head."""

    def __init__(self, layers: int, gelu_in_fp32: bool = False, d_model: int = 16, seq: int = 8, vocab: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, 2, gelu_in_fp32) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _problem(layers: int, device: torch.device, gelu_in_fp32: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    tokens = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(1))
    return Decoder(layers, gelu_in_fp32).to(device), tokens.to(device)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _count(step: Callable[[PhaseCounter], None]) -> PhaseCounter:
    """The ops of a steady step: after two (the first creates the optimizer state, or is skipped by an fp16 scale
    that starts too high, and then the second creates it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the counts do not depend on it; on busy shared cores, toy ops wait for threads
    try:
        for _ in range(2):
            step(PhaseCounter())
        with PhaseCounter() as counter:
            step(counter)
        return counter
    finally:
        torch.set_num_threads(threads)


# Each count is a few steps of a toy model; cached, since the tests compare the same runs in several ways.
@functools.cache
def count_native(layers: int, dtype: torch.dtype, device: torch.device, gelu_in_fp32: bool = False) -> PhaseCounter:
    """Native ``torch.autocast`` (+ GradScaler for fp16), fused AdamW."""
    model, tokens = _problem(layers, device, gelu_in_fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step(counter: PhaseCounter) -> None:
        counter.phase = "model"
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = _loss(model, tokens)
        scaler.scale(loss).backward()
        counter.phase = "step"
        scaler.step(opt)
        scaler.update()

    return _count(step)


@functools.cache
def count_amp(
    layers: int, level: OptLevel, device: torch.device, cast_policy: CastPolicyName = "apex", sync_free: bool = False
) -> PhaseCounter:
    """ampinit at ``level``, fused AdamW."""
    model, tokens = _problem(layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level=level, verbosity=0, cast_policy=cast_policy, sync_free=sync_free)

    def step(counter: PhaseCounter) -> None:
        counter.phase = "model"
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, tokens)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            counter.phase = "step"
        opt.step()

    try:
        counter = _count(step)
        session = amp.current_session()
        assert session is not None and not session.step_was_skipped(), "the counted step must be a real one"
        return counter
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_master_levels_dispatch_no_more_than_native_autocast(level: OptLevel, device: torch.device) -> None:
    for layers in (2, 4):
        ours, native = (
            count_amp(layers, level, device, "apex", False),
            count_native(layers, LEVELS[level], device, False),
        )
        assert ours.total() <= native.total(), (layers, ours.ops, native.ops)


@pytest.mark.parametrize(
    ("level", "cast_policy", "gelu_in_fp32"),
    [("O1", "native", False), ("O4", "native", False), ("O1", "apex", True), ("O4", "apex", True)],
)
def test_cast_levels_add_a_constant_to_native_autocast(
    level: OptLevel, cast_policy: CastPolicyName, gelu_in_fp32: bool, device: torch.device
) -> None:
    extra = {}
    for layers in (2, 4):
        ours = count_amp(layers, level, device, cast_policy, False)
        native = count_native(layers, LEVELS[level], device, gelu_in_fp32)
        extra[layers] = ours.total() - native.total()
        assert extra[layers] <= O1_O4_EXTRA_OPS, (layers, ours.ops, native.ops)
    assert extra[4] <= extra[2], f"O1/O4's extra ops grow with the depth: {extra}"


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_the_step_is_a_constant_number_of_ops(level: OptLevel, sync_free: bool, device: torch.device) -> None:
    # 2 more layers are 24 more parameter tensors: one op each anywhere in the step shows as 24.
    shallow = count_amp(2, level, device, "apex", sync_free).ops["step"]
    deep = count_amp(4, level, device, "apex", sync_free).ops["step"]
    assert deep == shallow, {op: deep[op] - shallow[op] for op in deep | shallow if deep[op] != shallow[op]}
