"""The precision dial's first step: the moments start in the dial's stored format, so that the step that creates
them peaks no higher than a later one (the chunked step: CPU, or any device without the Triton kernels) or holds one
parameter's fp32 zeros at a time (the kernel step), with bitwise the results of starting from torch's fp32 zero
moments.

References: the stored zeros written out here (bf16 +0, the 8-bit map's code of 0 with absmax 0) and the encoder run
on fp32 zeros; for whole runs, the same run whose optimizer state was first made in torch's layout (fp32 zeros, as
torch's ``Adam._init_group`` makes them), which the step decodes as it decoded every first step before; for memory,
a later step's peak plus the stored state it started with.
"""

from __future__ import annotations

import copy
import io
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampinit
from ampinit import amp
from ampinit._masters import precision
from ampinit._masters.dial_grads import Dial, StateStore
from ampinit.optimizers import FusedAdam
from benchmarks.cpu_peak_memory import trace_peak
from tests._host_work import NoLaunch
from tests.test_dial_slices import same_bits, square_mean_backward

SEED = 1234


def same_entries(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if got.keys() != want.keys():
        return False
    return all(same_bits(g, w) if isinstance(w, torch.Tensor) else g == w for g, w in ((got[k], want[k]) for k in want))


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_zero_moments_are_what_encoding_fp32_zeros_stores(state: str) -> None:
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    store = StateStore(optimizer, Dial("remainder", state, SEED))  # type: ignore[arg-type]
    like = torch.empty(7, 301)  # a partial last 8-bit block
    try:
        for key, purpose in (("exp_avg", 1), ("exp_avg_sq", 2)):
            got = store.zeros(key, like)
            encoded = store.encode(key, torch.zeros(like.shape), torch.tensor(1), 4 * 5 + purpose)
            assert same_entries(got, encoded)
            if state == "bf16":
                assert same_bits(got[key], torch.zeros(like.shape, dtype=torch.bfloat16))
                continue
            zero_code = precision.dynamic_map(signed=key == "exp_avg").tolist().index(0.0)
            assert zero_code == (127 if key == "exp_avg" else 0)
            assert torch.equal(got[key], torch.full(like.shape, zero_code, dtype=torch.uint8))
            assert same_bits(got[key + "_absmax"], torch.zeros(-(-like.numel() // precision.QBLOCK)))
    finally:
        store.remove()


# -- whole runs: bitwise those that started from fp32 zero moments ----------------------------------------------
def make_net() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 40), nn.GELU(), nn.Linear(40, 300), nn.GELU(), nn.Linear(300, 4))
    gen = torch.Generator().manual_seed(1)
    return net, torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)


def torch_zero_state(opt: torch.optim.Optimizer) -> None:
    """Every parameter's Adam state as torch's ``Adam._init_group`` makes it: fp32 zero moments, a zero step (a 0-d
    float32 on the parameter's device for a fused group, a CPU float64-default scalar otherwise)."""
    for group in opt.param_groups:
        for p in group["params"]:
            fused = group["fused"] or group["capturable"]
            step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
            moments = {
                key: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for key in ("exp_avg", "exp_avg_sq")
            }
            opt.state[p] = {"step": step, **moments}


def amp_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    opt.zero_grad(set_to_none=True)
    with amp.scale_loss(nn.functional.mse_loss(net(x).float(), y) * scale, opt) as scaled:
        scaled.backward()
    opt.step()


def train(masters: Any, state: str, fused: bool, skip_first: bool, torch_zeros: bool) -> dict[str, Any]:
    """A first step (overflowing: skipped, where ``skip_first``), two more, a ``state_dict`` round trip through
    bytes, one more: the weights, joined masters and optimizer state after the second and the last."""
    net, x, y = make_net()
    opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=masters, optimizer_state=state, verbosity=0)
    session = ampinit.session_of(opt)
    if torch_zeros:
        torch_zero_state(opt)
    seen: dict[str, Any] = {}
    try:
        amp_step(net, opt, x, y, float("inf") if skip_first else 1.0)
        assert amp.step_was_skipped(opt) == skip_first
        for _ in range(2):
            amp_step(net, opt, x, y, 1.0)
        seen["mid"] = snapshot(net, opt, session)
        buffer = io.BytesIO()
        torch.save({"optimizer": opt.state_dict(), "amp": session.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        amp_step(net, opt, x, y, 1.0)
        opt.load_state_dict(saved["optimizer"])
        session.load_state_dict(saved["amp"])
        amp_step(net, opt, x, y, 1.0)
        seen["end"] = snapshot(net, opt, session)
        return seen
    finally:
        ampinit.deinitialize()


def snapshot(net: nn.Module, opt: torch.optim.Optimizer, session: Any) -> dict[str, Any]:
    weights = [p.detach().clone() for p in net.parameters()]
    masters = [m for p in net.parameters() if (m := session.master_for(p)) is not None]
    return {"weights": weights, "masters": masters, "state": copy.deepcopy(opt.state_dict()["state"])}


@pytest.mark.parametrize(
    ("masters", "state", "fused", "skip_first"),
    [
        *((m, s, True, True) for m in (True, "remainder", "remainder8", "stochastic") for s in ("bf16", "8bit")),
        ("remainder", "bf16", True, False),
        ("remainder", "8bit", False, False),
        ("remainder8", "bf16", False, True),  # not fused: the host reads the flag and skips
    ],
)
def test_a_first_step_is_bitwise_the_one_from_fp32_zero_moments(
    masters: Any, state: str, fused: bool, skip_first: bool
) -> None:
    want = train(masters, state, fused, skip_first, torch_zeros=True)
    got = train(masters, state, fused, skip_first, torch_zeros=False)
    for moment in ("mid", "end"):
        for name in ("weights", "masters"):
            assert len(got[moment][name]) == len(want[moment][name]) > 0
            assert all(same_bits(g, w) for g, w in zip(got[moment][name], want[moment][name])), (moment, name)
        assert got[moment]["state"].keys() == want[moment]["state"].keys()
        for index, entry in want[moment]["state"].items():
            assert same_entries(got[moment]["state"][index], entry), (moment, index)


# -- memory ------------------------------------------------------------------------------------------------------
LARGE = (1024, 2048)  # one parameter of 2**21 elements: its step's tensors dwarf everything else
PEAK_SLICE = 1 << 16
# What a first step allocates once, besides the moments: 0-d tensors (step counts, the skip flag) and the two 8-bit
# maps (256 values and 256 decision points in fp32: 2 KiB each, built at their first use). Nothing per element.
ONCE = 8 << 10


def first_and_later_peaks(
    net: nn.Module, width: int, fused: bool, state: str, optimizer: str = "AdamW"
) -> tuple[int, int, int]:
    """O5 with remainder masters and ``state`` moments over ``net`` (inputs of ``width`` features) stepped by torch's
    AdamW or ampinit's FusedAdam (its own state layout): the traced peak of its first step, the bytes of the
    optimizer state the second step starts with, and the second step's peak."""
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)
        if optimizer == "AdamW"
        else FusedAdam(net.parameters(), lr=1e-3)
    )
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights="remainder", optimizer_state=state, verbosity=0)
    backward = square_mean_backward(net, opt, torch.randn(2, width))
    try:
        backward()
        first = trace_peak(opt.step).peak
        backward()
        kept = sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        later = trace_peak(opt.step).peak
    finally:
        ampinit.deinitialize()
    return first, kept, later


@pytest.mark.parametrize("fused", [True, False], ids=["fused-flag", "host-skip"])
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_the_first_step_peaks_no_higher_than_a_later_one(
    monkeypatch: pytest.MonkeyPatch, state: str, fused: bool
) -> None:
    """A later step's peak, with the stored state it started with (allocated before its trace, all of it live
    at the peak, which comes before the first moment's stored form is replaced), bounds the first step's, which
    allocates that state itself. main held torch's fp32 zero moments beside their decoded copies through the first
    step, 8 B per element more (and a fused step's skip select copied each moment once more)."""
    monkeypatch.setattr(precision, "SLICE_ELEMENTS", PEAK_SLICE)
    torch.manual_seed(0)
    first, kept, later = first_and_later_peaks(nn.Linear(LARGE[1], LARGE[0], bias=False), LARGE[1], fused, state)
    elements = LARGE[0] * LARGE[1]
    assert kept >= {"bf16": 4, "8bit": 2}[state] * elements  # the stored moments: the bound is not slack
    assert first <= later + kept + ONCE


# -- the kernel step (Triton; on CPU through its interpreter) ----------------------------------------------------
@pytest.mark.parametrize(
    ("masters", "state", "skip_first"),
    [("remainder", "bf16", True), ("remainder8", "8bit", False), ("stochastic", "bf16", False)],
)
def test_a_first_kernel_step_is_bitwise_the_one_from_fp32_zero_moments(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, masters: Any, state: str, skip_first: bool
) -> None:
    from ampinit._masters import triton_dial

    launches: list[int] = []
    adam_dial = triton_dial.adam_dial_
    monkeypatch.setattr(triton_dial, "adam_dial_", lambda *a, **k: launches.append(1) or adam_dial(*a, **k))
    # The interpreter runs the kernels in numpy, which warns at inf/inf in the lanes an overflowed step masks out.
    with np.errstate(all="ignore"):
        want = train(masters, state, True, skip_first, torch_zeros=True)
        taken = len(launches)
        got = train(masters, state, True, skip_first, torch_zeros=False)
    assert taken == len(launches) - taken > 0  # both runs stepped through the kernels, as often
    for moment in ("mid", "end"):
        for name in ("weights", "masters"):
            assert all(same_bits(g, w) for g, w in zip(got[moment][name], want[moment][name], strict=True))
        for index, entry in want[moment]["state"].items():
            assert same_entries(got[moment]["state"][index], entry), (moment, index)


@pytest.mark.parametrize("optimizer", ["AdamW", "FusedAdam"])
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_a_first_kernel_step_holds_one_parameters_fp32_zeros_at_a_time(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, state: str, optimizer: str
) -> None:
    """The kernel step's first step makes each parameter's state with its moments in the dial's format before the
    next one's (main made every parameter's fp32 zeros first: 8 B per parameter of the model at once). The kernels
    are stand-ins that do nothing: what is traced is the step's own memory."""
    from ampinit._masters import triton_dial

    stand_in = NoLaunch()
    monkeypatch.setattr(triton_dial, "_adam_dial_kernel", stand_in)
    torch.manual_seed(0)
    width, layers = 256, 16
    net = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    first, kept, later = first_and_later_peaks(net, width, True, state, optimizer)
    assert stand_in.launches == 2
    assert kept >= {"bf16": 4, "8bit": 2}[state] * width * width * layers  # the bound is not slack
    assert first <= later + kept + 8 * width * width + ONCE
