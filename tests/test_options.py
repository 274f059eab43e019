"""``ampinit._options``: every option checked once, in one pure function, into a frozen ``AmpOptions``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, get_args

import numpy
import pytest
import torch

import ampinit
from ampinit import amp
from ampinit._loss_scale import DynamicLossScale
from ampinit._opt_levels import LEVELS, unknown_level_message
from ampinit._options import AmpOptions, resolve_options
from ampinit._types import OPT_LEVELS, OptLevel
from tests.conftest import SmallNet

# The defaults come from initialize's signature, which is where users read them.
_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(ampinit.initialize).parameters.items()
    if name not in ("models", "optimizers")
}


def _resolve(**changes: Any) -> AmpOptions:
    return resolve_options(**{**_DEFAULTS, **changes})


def test_defaults_are_initializes() -> None:
    options = _resolve()
    assert options.properties == LEVELS["O1"].defaults
    assert options.loss_scale == DynamicLossScale(init_scale=2.0**16, min_scale=None, max_scale=2.0**24)
    assert (options.num_losses, options.verbosity, options.cast_model_outputs) == (1, 1, None)
    assert (options.cast_policy, options.allow_banned, options.sync_free) == ("auto", False, None)
    assert (options.skip_nonfinite, options.allow_half_model, options.enabled) == (True, False, True)


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _resolve().num_losses = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("level", "changes", "expected"),
    [
        ("O0", {}, 1.0),
        ("O3", {"loss_scale": "128.0"}, 128.0),
        ("O2", {"loss_scale": 4}, 4.0),
        ("O5", {"loss_scale": "dynamic"}, DynamicLossScale()),
        ("O2", {"min_loss_scale": 2.0, "max_loss_scale": 2.0**20}, DynamicLossScale(min_scale=2.0, max_scale=2.0**20)),
        ("O1", {"min_loss_scale": 0}, DynamicLossScale(min_scale=None)),
        ("O2", {"loss_scale": DynamicLossScale(hysteresis=3)}, DynamicLossScale(hysteresis=3)),
    ],
)
def test_loss_scale_setting(level: str, changes: dict[str, Any], expected: object) -> None:
    assert _resolve(opt_level=level, **changes).loss_scale == expected


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"num_losses": 0}, ValueError, "num_losses must be an int >= 1, got 0"),
        ({"num_losses": True}, ValueError, "num_losses must be an int >= 1, got True"),
        ({"verbosity": -1}, ValueError, "verbosity must be an int >= 0, got -1"),
        ({"verbosity": 1.0}, ValueError, "verbosity must be an int >= 0, got 1.0"),
        (
            {"sync_free": "yes"},
            TypeError,
            "sync_free must be True, False or None (the default: decide a dynamic scale's skips on the device "
            "wherever reading them would wait for it), got 'yes'",
        ),
        ({"allow_banned": 1}, TypeError, "allow_banned must be True or False, got 1"),
        ({"skip_nonfinite": None}, TypeError, "skip_nonfinite must be True or False, got None"),
        ({"allow_half_model": "False"}, TypeError, "allow_half_model must be True or False, got 'False'"),
        ({"cast_policy": "fast"}, ValueError, "cast_policy must be one of ['auto', 'apex', 'native'], got 'fast'"),
        (
            {"cast_policy": "Apex"},
            ValueError,
            "cast_policy must be one of ['auto', 'apex', 'native'], got 'Apex'. Did you mean 'apex'?",
        ),
        ({"cast_policy": None}, TypeError, "cast_policy must be a str, one of ['auto', 'apex', 'native'], got None"),
        ({"cast_model_outputs": "fp16"}, TypeError, "cast_model_outputs must be a torch.dtype or None, got 'fp16'"),
        (
            {"opt_level": "O2", "cast_model_outputs": torch.int32},
            ValueError,
            "cast_model_outputs must be a floating-point torch.dtype or None, got torch.int32",
        ),
        ({"cast_model_outputs": torch.bool}, ValueError, "cast_model_outputs must be a floating-point torch.dtype"),
        ({"opt_level": ["O1"]}, RuntimeError, "Unexpected optimization level ['O1']. Options are 'O0', 'O1'"),
        ({"opt_level": {"O2"}}, RuntimeError, "Unexpected optimization level {'O2'}. Options are 'O0', 'O1'"),
        ({"min_loss_scale": -1.0}, ValueError, "min_loss_scale must be a number >= 0, got -1.0"),
        ({"max_loss_scale": "big"}, ValueError, "max_loss_scale must be a number >= 0, got 'big'"),
        ({"max_loss_scale": float("nan")}, ValueError, "max_loss_scale must be a number >= 0, got nan"),
        (
            {"min_loss_scale": 8.0, "max_loss_scale": 4.0},
            ValueError,
            "min_loss_scale (8.0) must not exceed max_loss_scale (4.0)",
        ),
        (
            {"opt_level": "O2", "loss_scale": DynamicLossScale(), "max_loss_scale": 2.0**10},
            ValueError,
            "set min_scale and max_scale on the DynamicLossScale, not min_loss_scale=None / max_loss_scale=1024.0",
        ),
        (
            {"sync_free": True, "loss_scale": DynamicLossScale(min_scale=1.0, raise_at_min=True)},
            ValueError,
            "DynamicLossScale(raise_at_min=True) needs a host sync per step; it cannot be sync_free",
        ),
        ({"opt_level": "O2", "master_weights": "yes"}, ValueError, "found master_weights='yes'"),
    ],
)
def test_bad_option_names_the_value(changes: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _resolve(**changes)


@pytest.mark.parametrize("given", ["auto", "apex", "native", numpy.str_("native")])
def test_cast_policy_accepts_each_name_as_any_str(given: str) -> None:
    """A config reader's string (numpy's, say) is taken, and stored as the name itself."""
    policy = _resolve(cast_policy=given).cast_policy
    assert policy == given and type(policy) is str


@pytest.mark.parametrize(("typo", "meant"), [("o2", "O2"), ("02", "O2"), (" O5", "O5"), ("0", None), (2, None)])
def test_unknown_level_suggests_the_likely_one(typo: object, meant: str | None) -> None:
    with pytest.raises(RuntimeError) as caught:
        _resolve(opt_level=typo)
    message = str(caught.value)
    assert message.startswith(f"Unexpected optimization level {typo}. Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'.")
    assert message.endswith(f" Did you mean {meant!r}?") == (meant is not None)


def test_disabled_ignores_the_level_and_its_overrides_as_apex_does() -> None:
    options = _resolve(enabled=False, opt_level="bogus", master_weights="not checked")
    assert not options.enabled and options.properties.opt_level == "O0"
    assert _resolve(enabled=False, opt_level="O2").properties.opt_level == "O2"


def test_level_names_have_one_source() -> None:
    assert OPT_LEVELS == get_args(OptLevel) == tuple(LEVELS) == ("O0", "O1", "O2", "O3", "O4", "O5")
    assert all(LEVELS[level].defaults.opt_level == level for level in OPT_LEVELS)
    assert "Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'." in unknown_level_message("x")


def test_a_bad_option_leaves_nothing_behind() -> None:
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="sync_free must be True, False or None"):
        amp.initialize(model, opt, opt_level="O2", sync_free="yes")  # type: ignore[arg-type]
    assert ampinit.current_session() is None and ampinit.session_of(opt) is None
    assert all(p.dtype == torch.float32 for p in model.parameters()) and "step" not in vars(opt)


def test_session_keeps_its_option_names() -> None:
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0, cast_policy="native")
    session = ampinit.session_of(opt)
    assert session is not None
    try:
        assert session.options.num_losses == session.num_losses == len(session.scalers) == 2
        assert (session.verbosity, session.options.cast_policy, session.options.sync_free) == (0, "native", None)
        assert session.properties is session.options.properties
    finally:
        session.close()
