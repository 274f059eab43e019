"""The precision dial's encoders and decoders in flat slices (``precision.SLICE_ELEMENTS``): bitwise the results of
one slice over the whole tensor, in every format and through whole training steps, with a step's peak memory no
longer growing with 48 B of random bits (or 40 B of 8-bit quantization temporaries) per element of its largest
tensor.

References: the element-wise primitives called on the whole tensor with the whole tensor's bits
(``round_bf16_stochastic``, ``split8_``), the join written here in int64, and each function's result with a slice
larger than the tensor (one slice: the computation before slicing).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import precision
from ampinit._masters.dial_grads import Dial, StateStore
from benchmarks.cpu_peak_memory import trace_peak

SMALL = 2 * precision.QBLOCK  # two 8-bit blocks a slice
HUGE = 1 << 30  # larger than any tensor here: one slice
SHAPE = (7, 301)  # 2107 elements: four whole slices and a partial one, whose last 8-bit block is partial too
SEED = 1234


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(view[a.dtype]), b.view(view[b.dtype])) if a.dtype in view else torch.equal(a, b)


def values(shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """fp32 values over many binades, each row at its own scale (so 8-bit blocks get different absmax)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 3.0e38])
    return x


def key() -> torch.Tensor:
    return precision.keys(SEED, torch.tensor(7), torch.tensor(4 * 3 + 1))


def test_encode_bf16_in_slices_draws_each_elements_bits_of_the_whole_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    x = values()
    want = precision.round_bf16_stochastic(x, precision.tensor_bits(key(), x))
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    got = torch.empty(SHAPE, dtype=torch.bfloat16)
    precision.encode_bf16_keyed_(got, x, key())
    assert same_bits(got, want)


def test_split8_in_slices_draws_each_elements_bits_of_the_whole_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    master = values()
    want_weight = torch.empty(SHAPE, dtype=torch.bfloat16)
    want_remainder = torch.empty(SHAPE, dtype=torch.int8)
    precision.split8_(master, want_weight, want_remainder, precision.tensor_bits(key(), master))
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    weight, remainder = torch.empty_like(want_weight), torch.empty_like(want_remainder)
    precision.split8_keyed_(master, weight, remainder, key())
    assert same_bits(weight, want_weight) and torch.equal(remainder, want_remainder)


def test_strided_outputs_are_written_in_slices_and_keep_their_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channels_last weight's flat reshape is a copy: the slices must still land in the weight itself."""
    shape = (3, 5, 11, 13)  # 2145 elements
    master = values(shape)
    want_bf16 = precision.round_bf16_stochastic(master, precision.tensor_bits(key(), master))
    want_weight = torch.empty(shape, dtype=torch.bfloat16)
    want_remainder = torch.empty(shape, dtype=torch.int8)
    precision.split8_(master, want_weight, want_remainder, precision.tensor_bits(key(), master))
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    last = torch.channels_last
    out = torch.empty(shape, dtype=torch.bfloat16).to(memory_format=last)
    precision.encode_bf16_keyed_(out, master, key())
    weight = torch.empty(shape, dtype=torch.bfloat16).to(memory_format=last)
    remainder = torch.empty(shape, dtype=torch.int8).to(memory_format=last)
    precision.split8_keyed_(master, weight, remainder, key())
    assert all(t.is_contiguous(memory_format=last) and not t.is_contiguous() for t in (out, weight, remainder))
    assert same_bits(out.contiguous(), want_bf16)
    assert same_bits(weight.contiguous(), want_weight) and torch.equal(remainder.contiguous(), want_remainder)


def test_join8_in_slices_is_the_int64_join(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(6)
    weight = values().bfloat16()
    remainder = torch.randint(-128, 128, SHAPE, generator=gen, dtype=torch.int8)
    joined = ((weight.view(torch.int16).to(torch.int64) << 8) + remainder.to(torch.int64)) << 8
    want = joined.to(torch.int32).view(torch.float32)
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    assert same_bits(precision.join8(weight, remainder), want)


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_quantization_in_slices_is_that_of_one_slice(monkeypatch: pytest.MonkeyPatch, signed: bool) -> None:
    qmap = precision.QuantMap.build(signed)
    x = values() if signed else values().abs()
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", HUGE)
    want_codes, want_absmax = precision.quantize_blockwise(x, qmap)
    want_decoded = precision.dequantize_blockwise(want_codes, want_absmax, qmap)
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    codes, absmax = precision.quantize_blockwise(x, qmap)
    assert torch.equal(codes, want_codes) and same_bits(absmax, want_absmax)
    padded = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % precision.QBLOCK))
    assert same_bits(absmax, padded.reshape(-1, precision.QBLOCK).abs().amax(dim=1))  # partial last block too
    assert same_bits(precision.dequantize_blockwise(codes, absmax, qmap), want_decoded)


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_the_state_stores_moments_in_slices_as_in_one(monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    store = StateStore(optimizer, Dial("remainder", state, SEED))  # type: ignore[arg-type]
    step = torch.tensor(3)
    try:
        results = {}
        for size in (HUGE, SMALL):
            monkeypatch.setattr(precision, "SLICE_ELEMENTS", size)
            entries = {}
            for name, purpose in (("exp_avg", 1), ("exp_avg_sq", 2)):
                moment = values() if name == "exp_avg" else values().abs()
                entries.update(store.encode(name, moment, step, 4 * 3 + purpose))
            opened = dict(entries)
            store.open(opened)
            results[size] = (entries, opened)
        for want, got in zip(results[HUGE], results[SMALL]):
            assert want.keys() == got.keys()
            assert all(same_bits(got[name], want[name]) for name in want)
    finally:
        store.remove()


def test_a_slice_size_that_would_split_an_8bit_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", 300)
    message = "SLICE_ELEMENTS must be a positive multiple of QBLOCK (256), got 300"
    with pytest.raises(ValueError, match=re.escape(message)):
        precision.quantize_blockwise(torch.ones(10), precision.QuantMap.build(True))


# -- whole steps (on CPU: the chunked step, not the Triton kernels) ----------------------------------------------
def train(masters: str, state: str, optimizer: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[Any, Any]]:
    """Weights, joined masters and optimizer state after three dial steps of a small model (12,000 elements in
    its largest tensor, not a multiple of a slice)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 40), nn.GELU(), nn.Linear(40, 300), nn.GELU(), nn.Linear(300, 4))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    if optimizer == "AdamW":
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=masters, optimizer_state=state, verbosity=0)
    try:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with amp.scale_loss(nn.functional.mse_loss(net(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
        session = ampinit.session_of(opt)
        joined = [session.master_for(p) for p in net.parameters()]
        weights = [p.detach().clone() for p in net.parameters()]
        return weights, [m for m in joined if m is not None], opt.state_dict()["state"]
    finally:
        ampinit.deinitialize()


@pytest.mark.parametrize(
    ("masters", "state", "optimizer"),
    [
        ("remainder", "bf16", "AdamW"),
        ("remainder", "8bit", "AdamW"),
        ("remainder8", "8bit", "AdamW"),
        ("stochastic", "8bit", "SGD"),
    ],
)
def test_dial_steps_in_slices_are_bitwise_those_in_one(
    monkeypatch: pytest.MonkeyPatch, masters: str, state: str, optimizer: str
) -> None:
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", HUGE)
    want = train(masters, state, optimizer)
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", SMALL)
    got = train(masters, state, optimizer)
    for got_list, want_list in zip(got[:2], want[:2]):
        assert len(got_list) == len(want_list) > 0
        assert all(same_bits(g, w) for g, w in zip(got_list, want_list))
    assert got[2].keys() == want[2].keys()
    for index, entry in want[2].items():
        assert entry.keys() == got[2][index].keys()
        assert all(same_bits(got[2][index][name], value) for name, value in entry.items()), index


# -- peak memory -------------------------------------------------------------------------------------------------
LARGE = (1024, 2048)  # one parameter of 2**21 elements


def square_mean_backward(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    """A backward of ``net`` on ``x`` under amp (grads cleared first, the loss the output's mean square): called
    before each traced step."""

    def backward() -> None:
        opt.zero_grad(set_to_none=True)
        with amp.scale_loss(net(x).float().square().mean(), opt) as scaled:
            scaled.backward()

    return backward


PEAK_SLICE = 1 << 16
# At the step's peak (the update itself): the fp32 master, grad and two moments of the whole parameter (16 B per
# element, kept: the update needs them whole) and torch's single-tensor AdamW's two fp32 temporaries (8 B). The
# slices' own temporaries (random bits, float64 quotients, int64 codes) may add up to 64 B per element of a slice.
# main drew the bits and quantized over the whole tensor: 64 B/element (bf16 moments), 36 B (8-bit moments).
BOUND = 24 * LARGE[0] * LARGE[1] + 64 * PEAK_SLICE


@pytest.mark.parametrize(("masters", "state"), [("remainder", "bf16"), ("remainder", "8bit"), ("remainder8", "8bit")])
def test_a_dial_steps_peak_does_not_grow_with_the_largest_tensors_temporaries(
    monkeypatch: pytest.MonkeyPatch, masters: str, state: str
) -> None:
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", PEAK_SLICE)
    torch.manual_seed(0)
    net = nn.Linear(LARGE[1], LARGE[0], bias=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=masters, optimizer_state=state, verbosity=0)
    backward = square_mean_backward(net, opt, torch.randn(2, LARGE[1]))
    try:
        backward()
        opt.step()  # the first step creates the moments: the traced one only replaces them
        backward()
        peak = trace_peak(opt.step).peak
    finally:
        ampinit.deinitialize()
    assert 16 * LARGE[0] * LARGE[1] < peak <= BOUND
