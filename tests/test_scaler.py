"""The device-side loss scaler against plain host re-implementations of Apex's and Megatron/Apex-kernel rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ampinit import DynamicLossScale
from ampinit._scaler import LossScaler


class ApexReference:
    """apex/amp/scaler.py's update_scale, written out plainly (scale_factor hard-coded to 2 as in Apex)."""

    def __init__(self, max_scale: float, min_scale: float | None, window: int) -> None:
        self.scale = min(max_scale, 2.0**16)
        self.unskipped = 0
        self.max, self.min, self.window = max_scale, min_scale, window

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0


def run(scaler: LossScaler, overflows: list[bool]) -> list[tuple[float, int]]:
    scaler.materialize(torch.device("cpu"))
    trace = []
    for overflow in overflows:
        scaler.clear_overflow()
        if overflow:
            scaler.found_inf.fill_(1.0)
        scaler.update()
        trace.append((scaler.loss_scale(), scaler.unskipped()))
    return trace


@settings(max_examples=60, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    window=st.integers(1, 5),
    min_scale=st.sampled_from([None, 1.0, 4096.0]),
    max_scale=st.sampled_from([2.0**24, 2.0**17, 2.0**10]),
)
def test_dynamic_scaling_matches_apex(
    overflows: list[bool], window: int, min_scale: float | None, max_scale: float
) -> None:
    assume(min_scale is None or min_scale <= max_scale)
    ref = ApexReference(max_scale, min_scale, window)
    expected = []
    for overflow in overflows:
        ref.update(overflow)
        expected.append((ref.scale, ref.unskipped))
    config = DynamicLossScale(growth_interval=window, min_scale=min_scale, max_scale=max_scale)
    assert run(LossScaler(config), overflows) == expected


@settings(max_examples=40, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=30), hysteresis=st.integers(1, 4))
def test_hysteresis_backs_off_at_the_nth_overflow_in_a_row(overflows: list[bool], hysteresis: int) -> None:
    # Apex's update_scale_hysteresis kernel: the tracker counts down on overflow, backs off at <= 0 and is
    # reset by a clean step; growth as usual.
    scale, growth, left, expected = 2.0**16, 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            growth = 0
            left -= 1
            if left <= 0:
                scale *= 0.5
        else:
            left = hysteresis
            growth += 1
            if growth == 3:
                scale, growth = scale * 2.0, 0
        expected.append(scale)
    config = DynamicLossScale(growth_interval=3, hysteresis=hysteresis)
    assert [s for s, _ in run(LossScaler(config), overflows)] == expected


def test_static_scale_never_changes_and_counts_clean_steps() -> None:
    trace = run(LossScaler(128.0), [False, True, False, False])
    assert [s for s, _ in trace] == [128.0] * 4
    assert [u for _, u in trace] == [1, 0, 1, 2]  # Apex counts _unskipped for static scalers too


def test_growth_respects_custom_factors() -> None:
    config = DynamicLossScale(init_scale=100.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    trace = run(LossScaler(config), [False, False, True])
    assert [s for s, _ in trace] == [100.0, 300.0, 75.0]


def test_state_dict_round_trip_before_and_after_materialize() -> None:
    a = LossScaler(DynamicLossScale(growth_interval=10, hysteresis=3))
    run(a, [False, True, False])
    state = a.state_dict()
    assert state == {"loss_scale": 65536.0, "unskipped": 1, "hysteresis_left": 3}
    b = LossScaler(DynamicLossScale(growth_interval=10, hysteresis=3))
    b.load_state_dict(state)  # not yet on a device
    assert b.state_dict() == state
    c = LossScaler(DynamicLossScale(growth_interval=10, hysteresis=3))
    run(c, [True, True])
    c.load_state_dict(state)  # already materialized
    assert c.state_dict() == state
    # Continuing gives the same trace as the original.
    assert run(b, [False, True]) == run(a, [False, True])


def test_apex_format_has_only_apex_keys_without_hysteresis() -> None:
    assert set(LossScaler(DynamicLossScale()).state_dict()) == {"loss_scale", "unskipped"}


@pytest.mark.parametrize("bad", [{}, {"loss_scale": "x", "unskipped": 0}, {"loss_scale": 1.0}])
def test_bad_scaler_entry(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="needs 'loss_scale'"):
        LossScaler(DynamicLossScale()).load_state_dict(bad)


def test_unscale_uses_reciprocal_and_flags_non_finite() -> None:
    scaler = LossScaler(DynamicLossScale(init_scale=4.0))
    scaler.materialize(torch.device("cpu"))
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0], dtype=torch.bfloat16)]
    scaler.clear_overflow()
    scaler.unscale_(grads)
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].item() == 0.5
    assert scaler.found_inf.item() == 0.0
    scaler.unscale_([torch.tensor([float("nan")])])
    assert scaler.found_inf.item() == 1.0


def test_apex_field_assignments_change_one_field_and_keep_the_rest() -> None:
    scaler = LossScaler(DynamicLossScale(init_scale=2.0**10, hysteresis=3))
    scaler.materialize(torch.device("cpu"))
    scaler.found_inf.fill_(1.0)
    scaler.update()  # one overflow: hysteresis 3 -> 2, the scale kept
    assert (scaler.loss_scale(), scaler.hysteresis_left()) == (2.0**10, 2)
    scaler.set_unskipped(7)
    scaler.set_loss_scale(96.0)
    assert (scaler.loss_scale(), scaler.unskipped(), scaler.hysteresis_left()) == (96.0, 7, 2)
    assert scaler.inv_scale.item() == torch.tensor(1 / 96.0, dtype=torch.float32).item()


def test_an_update_replaces_the_reciprocal_and_leaves_the_one_taken_as_it_was() -> None:
    # A pending master step keeps the 1/scale its half grads were multiplied by (OptimizerGrads.post_backward) and
    # applies it after the exit's update: the update must hand out a new tensor, not write the one taken.
    scaler = LossScaler(DynamicLossScale(init_scale=2.0**4, growth_interval=1))
    scaler.materialize(torch.device("cpu"))
    taken = scaler.inv_scale
    scaler.update()  # a clean step: grows (growth_interval 1)
    assert scaler.loss_scale() == 2.0**5
    assert float(taken) == 2.0**-4 and float(scaler.inv_scale) == 2.0**-5
    scaler.found_inf.fill_(1.0)
    again = scaler.inv_scale
    scaler.update()  # an overflow: backs off
    assert float(again) == 2.0**-5 and float(scaler.inv_scale) == 2.0**-4


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=100),
    st.sets(st.integers(0, 99), max_size=6),
    st.one_of(st.none(), st.integers(0, 99)),
)
def test_a_static_scales_clean_step_count_is_apexs_at_every_read(
    raised: list[bool], reads: set[int], load_at: int | None
) -> None:
    # A static scale counts its clean steps from flags kept over several updates (no kernel per update): read at
    # any update, across the folds, and after a count loaded in between, it is the count one update at a time
    # gives (a clean step adds one, an overflow restarts from 0: ampinit's static scales skip them).
    scaler = LossScaler(128.0)
    scaler.materialize(torch.device("cpu"))
    load_at = None if load_at is None else load_at % len(raised)
    reads = {read % len(raised) for read in reads}
    want = 0
    for index, value in enumerate(raised):
        scaler.clear_overflow()
        if value:
            scaler.check_([torch.tensor([float("nan")])])
        scaler.update()
        want = 0 if value else want + 1
        if index in reads:
            assert scaler.unskipped() == want, index
        if index == load_at:
            scaler.load_state_dict({"loss_scale": 128.0, "unskipped": 7})  # a checkpoint's count
            want = 7
    assert scaler.unskipped() == want
    assert scaler.loss_scale() == 128.0


# -- amp.load_state_dict: a bad checkpoint is refused, naming the value, before any scaler changes -------------------
def _two_loss_session() -> tuple[object, list[tuple[float, int]]]:
    import ampinit

    model = torch.nn.Linear(4, 2)
    ampinit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", num_losses=2, verbosity=0)
    session = ampinit.current_session()
    assert session is not None
    return session, [(s.loss_scale(), s.unskipped()) for s in session.scalers]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        # the first entry is good: it must not be loaded when the second is refused
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler1": {"bad": 1}}, "needs 'loss_scale'"),
        (
            {
                "loss_scaler0": {"loss_scale": 8.0, "unskipped": 3},
                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3, "hysteresis_left": None},
            },
            "'hysteresis_left' must be an int >= 0",
        ),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0, "hysteresis_left": "abc"}}, "'hysteresis_left'"),
        ({"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}}, "'loss_scale' must be a finite number > 0"),
        ({"loss_scaler0": {"loss_scale": -4.0, "unskipped": 0}}, "'loss_scale' must be a finite number > 0"),
        ({"loss_scaler0": {"loss_scale": 0.0, "unskipped": 0}}, "'loss_scale' must be a finite number > 0"),
        ({"loss_scaler0": {"loss_scale": float("inf"), "unskipped": 0}}, "'loss_scale' must be a finite number > 0"),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": -5}}, "'unskipped' must be an int >= 0"),
    ],
)
def test_amp_load_state_dict_refuses_a_bad_entry_before_loading_any(state: dict[str, object], match: str) -> None:
    import warnings

    import ampinit

    session, before = _two_loss_session()
    try:
        versions = [s.version for s in session.scalers]  # type: ignore[attr-defined]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the entry-count warning of a one-entry dict
            with pytest.raises(ValueError, match=match):
                ampinit.load_state_dict(state)  # type: ignore[arg-type]
        assert [(s.loss_scale(), s.unskipped()) for s in session.scalers] == before  # type: ignore[attr-defined]
        assert [s.version for s in session.scalers] == versions  # type: ignore[attr-defined]
    finally:
        ampinit.deinitialize()


@pytest.mark.parametrize("state", [None, [1, 2], "loss_scaler0", {0: {"loss_scale": 2.0, "unskipped": 0}}])
def test_amp_load_state_dict_refuses_what_is_not_a_state_dict(state: object) -> None:
    import ampinit

    _two_loss_session()
    try:
        with pytest.raises(TypeError, match=r"amp.load_state_dict takes what amp.state_dict\(\) returns"):
            ampinit.load_state_dict(state)  # type: ignore[arg-type]
    finally:
        ampinit.deinitialize()


def test_bad_hysteresis_entry_leaves_an_unmaterialised_scaler_alone() -> None:
    scaler = LossScaler(DynamicLossScale(hysteresis=3))
    with pytest.raises(ValueError, match="'hysteresis_left' must be an int >= 0"):
        scaler.load_state_dict({"loss_scale": 8.0, "unskipped": 1, "hysteresis_left": "x"})
    assert (scaler.loss_scale(), scaler.unskipped(), scaler.hysteresis_left(), scaler.version) == (2.0**16, 0, 3, 0)
