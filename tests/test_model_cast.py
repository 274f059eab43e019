"""``ampinit._model_cast``: the cast model's weights stay on the device they were cast on, a checkpoint loaded into
the model reaches its fp32 masters on any supported torch, and recurrent layers get their flat weight buffer back
after teardown."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampinit import amp
from tests._device import on_device
from tests.conftest import make_problem


def test_master_weights_load_without_the_public_pre_hook_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint loaded into an O2 model reaches the fp32 masters on a torch without the public pre-hook API.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    # torch < 2.5 has only Module._register_load_state_dict_pre_hook.
    monkeypatch.delattr(nn.Module, "register_load_state_dict_pre_hook", raising=False)
    model, _, _ = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = {k: v + 1e-4 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    try:
        model.load_state_dict(checkpoint)
        masters = dict(zip((n for n, _ in model.named_parameters()), amp.master_params(opt)))
        for name, master in masters.items():
            assert torch.equal(master, checkpoint[name])  # the fp32 value, not the fp16 rounding of it
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_model_moved_after_initialize_is_refused(level: str) -> None:
    """A model moved to another device after ``initialize()`` is refused at its next forward, naming both devices.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    model, x, _ = make_problem()
    model = on_device(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        model.to("meta")  # stands in for cuda -> cpu or cpu -> cuda: the weights leave their device
        with pytest.raises(RuntimeError, match=r"moved from \w+(:\d+)? to meta after amp.initialize\(\)"):
            model(on_device(x))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_moving_a_model_without_masters_or_cast_policy_is_allowed(level: str) -> None:
    """At O0 and O3 (no masters, no cast policy) nothing stays behind on the old device: moving the model is allowed.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    model, x, _ = make_problem()
    amp.initialize(model, opt_level=level, verbosity=0)
    try:
        model.to("meta")
        assert model(x.to("meta")).device.type == "meta"  # no masters, no cast policy: nothing stays behind
    finally:
        amp.deinitialize()


def test_rnn_weights_are_regrouped_after_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """An RNN's weights are regrouped (``flatten_parameters``) at initialize and again after teardown.

    Found by: the device review (what a GPU or an older torch would break, shown on the CPU).
    """
    calls: list[str] = []
    original = nn.RNNBase.flatten_parameters

    def spy(self: nn.RNNBase) -> None:
        calls.append(type(self).__name__)
        original(self)

    model = nn.LSTM(4, 8)
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", spy)
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert calls == ["LSTM"]
    amp.deinitialize()
    # cuDNN needs its flat weight buffer rebuilt after the weights got fp32 storage back.
    assert calls == ["LSTM", "LSTM"]
