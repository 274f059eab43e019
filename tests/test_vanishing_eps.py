"""``initialize`` warns where an optimizer will step fp16 parameters itself (no fp32 masters) with an ``eps`` that
fp16 cannot hold (docs/faq.md, "O3 gives NaN after the first step"); the warning's claim is checked against what
such a step does, and it stays silent where the step is sound."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp

Make = Callable[[Any], torch.optim.Optimizer]


def initialize(level: str, make_opt: Make, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    return amp.initialize(model, make_opt(model.parameters()), opt_level=level, verbosity=0, **options)


def test_o3_with_adams_default_eps_is_warned_of_and_the_warning_is_true() -> None:
    with pytest.warns(UserWarning, match=r"AdamW's param group 0 steps float16 .* eps=1e-08, which is 0 in float16"):
        model, opt = initialize("O3", lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    try:
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).half() * 1e-3  # small grads
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        assert all(bool(p.grad.isfinite().all()) for p in model.parameters())
        opt.step()
        assert not all(bool(p.isfinite().all()) for p in model.parameters())  # what the warning says
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(
    ("level", "make_opt", "options"),
    [
        ("O3", lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4), {}),  # the FAQ's eps
        ("O3", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),  # no eps
        ("O2", lambda ps: torch.optim.AdamW(ps, lr=1e-3), {}),  # fp32 masters: eps is applied in fp32
        ("O5", lambda ps: torch.optim.AdamW(ps, lr=1e-3), {"master_weights": False}),  # 1e-8 is a bf16 value
        ("O0", lambda ps: torch.optim.AdamW(ps, lr=1e-3), {}),
    ],
    ids=["O3-eps-1e-4", "O3-SGD", "O2", "O5-no-masters", "O0"],
)
def test_no_warning_where_eps_survives(level: str, make_opt: Make, options: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        initialize(level, make_opt, **options)
    amp.deinitialize()


def test_o3_with_adams_default_eps_is_a_warning_not_a_refusal() -> None:
    """A warning, not a refusal: Apex's O3 (a speed baseline) runs as it did; the model is fp16 all the same."""
    with pytest.warns(UserWarning, match="eps=1e-08"):
        model, _ = initialize("O3", lambda ps: torch.optim.Adam(ps))
    try:
        assert {p.dtype for p in model.parameters()} == {torch.float16}
    finally:
        amp.deinitialize()


def test_the_warning_raised_as_an_error_leaves_the_model_as_it_was() -> None:
    # Where warnings are errors (python -W error, pytest's filterwarnings = error), initialize raises the warning;
    # it must come before the cast, since O3 has no masters to give the weights their fp32 values back.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {name: (t.clone(), t) for name, t in (*model.named_parameters(), *model.named_buffers())}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="eps=1e-08, which is 0 in float16"):
            amp.initialize(model, opt, opt_level="O3", verbosity=0)
    assert amp.current_session() is None and "step" not in vars(opt)
    after = dict((*model.named_parameters(), *model.named_buffers()))
    for name, (value, tensor) in before.items():
        assert after[name] is tensor, name
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
