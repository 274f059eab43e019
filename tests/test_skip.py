"""``ampinit._skip``: where a skip is decided (host or device), flags folded as a max, and thinned-out logging."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from ampinit import DynamicLossScale, _scaler, _skip
from ampinit._scaler import LossScaler


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3))]


def test_flags_fold_into_their_maximum_and_no_flag_is_written() -> None:
    # The flags are scalers' lent ones (LossScaler.lend_flag), which several records may hold: a fold makes a new
    # tensor and leaves every flag it read as it was.
    values = [0.0, 1.0, 0.0, 1.0, 0.0]
    flags = [torch.tensor([value]) for value in values]
    flag = None
    for found_inf in flags:
        flag = _skip.fold_flag(flag, found_inf)
    assert flag is not None and flag.item() == max(values)
    assert [f.item() for f in flags] == values


def test_a_lent_flag_is_never_written_again() -> None:
    # What the scaler writes after lending its flag (a clear, a check, Apex's setter) goes to a new tensor, and the
    # flag it lends next is that one; an unlent flag is written in place (no allocation per clear).
    scaler = LossScaler(DynamicLossScale())
    scaler.materialize(torch.device("cpu"))
    scaler.check_([torch.tensor([float("inf")])])
    lent = scaler.lend_flag()
    assert lent.item() == 1.0
    scaler.clear_overflow()
    assert lent.item() == 1.0 and scaler.found_inf.item() == 0.0 and scaler.found_inf is not lent
    own = scaler.found_inf
    scaler.clear_overflow()
    assert scaler.found_inf is own  # not lent: cleared in place
    again = scaler.lend_flag()
    scaler.set_overflow(True)
    scaler.check_([torch.tensor([1.0])])
    assert again.item() == 0.0 and scaler.found_inf.item() == 1.0


def test_the_flags_after_lent_ones_are_new_zero_flags_filled_once_a_pool() -> None:
    # A lent flag's clear takes a new zero flag from a pool (one fill launch per FLAG_POOL, where a zeros_like per
    # iteration was one launch each): each a one-element flag of its own memory, zero when taken, starting on 16
    # bytes (what Triton specialises a pointer on), and writing one moves no other, lent or pooled.
    scaler = LossScaler(DynamicLossScale())
    scaler.materialize(torch.device("cpu"))
    steps = 2 * _scaler.FLAG_POOL + 3
    lent: list[torch.Tensor] = []
    fills = 0
    zeros = torch.zeros

    def counted_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal fills
        fills += 1
        return zeros(*args, **kwargs)

    for step in range(steps):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "zeros", counted_zeros)
            scaler.clear_overflow()
        flag = scaler.found_inf
        assert flag.shape == (1,) and flag.dtype == torch.float32 and flag.is_contiguous()
        assert flag.item() == 0.0 and flag.data_ptr() % 16 == 0
        assert all(flag.data_ptr() != other.data_ptr() for other in lent)
        scaler.check_([torch.tensor([float("inf") if step % 3 == 0 else 1.0])])
        lent.append(scaler.lend_flag())
    assert [f.item() for f in lent] == [1.0 if step % 3 == 0 else 0.0 for step in range(steps)]
    # Step 0 clears the materialized flag in place (never lent); steps 1-64, 65-128 and 129-130 take three pools.
    assert fills == 3


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_an_optimizer_without_the_amp_protocol_reads_the_flag_on_the_host(value: float) -> None:
    opt = torch.optim.SGD(_params(), lr=0.1)
    assert _skip.settle_on_host(opt, torch.tensor([value]), closure_given=False) == (value == 1.0, None)


def test_a_fused_optimizer_gets_the_flag_unless_a_closure_must_run() -> None:
    opt = torch.optim.Adam(_params(), lr=0.1, fused=True)
    flag = torch.tensor([1.0])
    skip, kept = _skip.settle_on_host(opt, flag, closure_given=False)
    assert not skip and kept is flag
    assert _skip.settle_on_host(opt, flag, closure_given=True) == (True, None)
    assert _skip.settle_on_host(opt, None, closure_given=False) == (False, None)


def test_fused_sgd_with_momentum_decides_on_the_host_until_its_buffers_exist() -> None:
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    assert not _skip.skips_on_device(opt)
    params[0].grad = torch.ones(3)
    opt.step()
    assert _skip.skips_on_device(opt)
    assert _skip.skips_on_device(torch.optim.SGD(_params(), lr=0.1, fused=True))


class _Recorder(torch.optim.SGD):
    def __init__(self) -> None:
        super().__init__(_params(), lr=0.1)
        self.seen: dict[str, Any] = {}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.seen = {"found_inf": getattr(self, "found_inf", None), "grad_scale": getattr(self, "grad_scale", 1)}


@pytest.mark.parametrize("own_scale", [False, True])
def test_run_step_hands_the_flag_over_and_takes_it_back(own_scale: bool) -> None:
    opt = _Recorder()
    if own_scale:
        opt.grad_scale = "mine"  # type: ignore[attr-defined]
    _skip.run_step(opt, opt.step, torch.tensor([1.0]), (), {})
    assert opt.seen["grad_scale"] is None and opt.seen["found_inf"].shape == () and opt.seen["found_inf"] == 1
    assert "found_inf" not in vars(opt)
    assert vars(opt).get("grad_scale", "absent") == ("mine" if own_scale else "absent")
    _skip.run_step(opt, opt.step, None, (), {})
    assert opt.seen == {"found_inf": None, "grad_scale": "mine" if own_scale else 1}


def test_overflow_messages_thin_out_to_powers_of_two(caplog: pytest.LogCaptureFixture) -> None:
    log = _skip.OverflowLog()
    scaler = LossScaler(8.0)
    with caplog.at_level(logging.INFO, logger="ampinit"):
        for _ in range(40):
            log.overflow(scaler, 8.0, verbosity=1)
        log.overflow(scaler, 8.0, verbosity=0)
    logged = [int(r.getMessage().split("(")[1].split()[0]) if "(" in r.getMessage() else None for r in caplog.records]
    assert logged == [None] * 8 + [16, 32] and log.count == 41
    first = "Gradient overflow.  Skipping step, loss scaler 0 keeping loss scale at 8.0"
    assert caplog.records[0].getMessage() == first
