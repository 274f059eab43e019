"""Peak live tensor bytes of a training step (issue 24's memory target, measured on CPU by
``benchmarks/cpu_peak_memory.py``): the proxy against known answers, and remainder masters against a pure bf16
model by byte counts."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cpu_peak_memory
from benchmarks.gpu_train_step import PURE_BF16, GPTShape

# One decoder layer with a tied embedding, small enough for a few seconds and large enough that the activations of
# backward, not the CPU step's chunk temporaries, make the peak (as they do on the GPU).
SHAPE = GPTShape(layers=1, d_model=64, heads=2, seq=64, vocab=2048)
BATCH = 4
STEPS = 2
# amp's 0-d tensors (loss scale, its inverse, growth tracker, step counters, the skip flag): eight of 4 bytes at
# this writing, independent of the model's size. 64 bytes leaves room for a few more, not for a per-parameter one.
SCALAR_STATE = 64


@pytest.fixture(scope="module")
def peaks() -> tuple[cpu_peak_memory.PeakTrace, cpu_peak_memory.PeakTrace, int]:
    """Pure bf16's and O5 remainder's traces over build + STEPS steps, and the parameter count."""
    baseline, params = cpu_peak_memory.measure(PURE_BF16, SHAPE, BATCH, STEPS)
    remainder, _ = cpu_peak_memory.measure("O5 remainder", SHAPE, BATCH, STEPS)
    return baseline, remainder, params


def test_peak_of_known_allocations_is_their_sum_at_the_worst_moment() -> None:
    def run() -> None:
        first = torch.empty(1000, dtype=torch.float32)
        second = torch.empty(500, dtype=torch.bfloat16)
        del first
        third = torch.empty(3000, dtype=torch.int8)
        del second, third

    trace = cpu_peak_memory.trace_peak(run)
    assert trace.peak == 4000 + 1000
    assert sorted(a.size for a in trace.live_at_peak) == [1000, 4000]
    assert trace.live_at_end == ()


def test_peak_ignores_frees_of_blocks_allocated_before_tracing() -> None:
    before = torch.empty(10_000, dtype=torch.float32)

    def run() -> None:
        nonlocal before
        del before
        kept = torch.empty(250, dtype=torch.float64)
        del kept

    assert cpu_peak_memory.trace_peak(run).peak == 2000


def test_remainder_masters_peak_is_pure_bf16_plus_remainders_and_wider_moments(
    peaks: tuple[cpu_peak_memory.PeakTrace, cpu_peak_memory.PeakTrace, int],
) -> None:
    """Issue 24: O5 remainder's peak <= pure bf16's + 2 B/param of remainders, + 4 B/param because its AdamW keeps
    fp32 moments where pure bf16's keeps bf16 ones; the 32 B of amp's scalars aside, nothing else may be live."""
    baseline, remainder, params = peaks
    assert baseline.at is not None and "backward" in baseline.at.phase
    assert remainder.peak <= baseline.peak + 6 * params + SCALAR_STATE
    # The allowance is used: the remainders and moments are live at the peak, so the bound is not slack.
    assert remainder.peak >= baseline.peak + 6 * params


def test_the_difference_at_the_peak_is_named_by_who_allocated_it(
    peaks: tuple[cpu_peak_memory.PeakTrace, cpu_peak_memory.PeakTrace, int],
) -> None:
    baseline, remainder, params = peaks
    rows = cpu_peak_memory.live_difference(remainder, baseline)
    remainders = sum(row["extra"] for row in rows if row["frame"].endswith("remainder.py: new_storages"))
    assert remainders == 2 * params  # one int16 per bf16 parameter; every parameter of this model is bf16
