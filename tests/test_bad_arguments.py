"""Bad arguments to the module-level functions get an error naming the value, raised before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampinit


@pytest.mark.parametrize("loss", [1.0, 3, None, [torch.tensor(1.0)]])
def test_scale_loss_refuses_a_loss_that_is_not_a_tensor(loss: object) -> None:
    model = nn.Linear(4, 2)
    model, opt = ampinit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    try:
        with pytest.raises(TypeError, match=r"scale_loss needs the loss as a torch\.Tensor"):
            with ampinit.scale_loss(loss, opt):  # type: ignore[arg-type]
                pass
        assert ampinit.stats().loss_scales == (2.0**16,)  # nothing scaled, nothing unscaled
    finally:
        ampinit.deinitialize()


@pytest.mark.parametrize("what", ["clip_grad_norm_", "master_params"])
def test_functions_of_an_optimizer_refuse_something_else(what: str) -> None:
    with pytest.raises(TypeError, match=rf"amp.{what} takes the optimizer .* got builtins.str"):
        if what == "clip_grad_norm_":
            ampinit.clip_grad_norm_("adam", 1.0)  # type: ignore[arg-type]
        else:
            list(ampinit.master_params("adam"))  # type: ignore[arg-type]
