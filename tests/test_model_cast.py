"""``ampinit._model_cast``: the cast model's weights stay on the device they were cast on, a checkpoint loaded into
the model reaches its fp32 masters on any supported torch, and recurrent layers get their flat weight buffer back
after teardown."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import fields
from typing import Any

import pytest
import torch
from torch import nn

from ampinit import amp
from ampinit._model_cast import cast_floating
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


class _ModelOutput(OrderedDict[str, Any]):
    """Hugging Face's ``transformers.utils.ModelOutput``, trimmed: a dataclass over an OrderedDict whose
    ``__post_init__`` reads a dict given as its first field as the output's items."""

    def __post_init__(self) -> None:
        class_fields = fields(self)  # type: ignore[arg-type]
        first = getattr(self, class_fields[0].name)
        others_none = all(getattr(self, f.name) is None for f in class_fields[1:])
        if others_none and isinstance(first, dict):
            for key, value in first.items():
                setattr(self, key, value)
                if value is not None:
                    self[key] = value
        else:
            for f in class_fields:
                if getattr(self, f.name) is not None:
                    self[f.name] = getattr(self, f.name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclasses.dataclass
class _LMOutput(_ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> _LMOutput:
        logits = self.fc(x)
        return _LMOutput(loss=None if labels is None else (logits.float() - labels).pow(2).mean(), logits=logits)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_model_output_dataclass_mapping_keeps_its_fields(level: str) -> None:
    """A Hugging Face style ``ModelOutput`` comes back as itself with fp32 tensors: a field that was ``None`` stays
    ``None`` (rebuilt as ``type(output)(items)``, its first field was bound to the dict of all items).

    Found by: the input/output casting audit.
    """
    model = _LM()
    amp.initialize(model, opt_level=level, verbosity=0)
    try:
        out = model(torch.randn(2, 4))
        assert type(out) is _LMOutput and out.loss is None and list(out.keys()) == ["logits"]
        assert out.logits is not None and out.logits.dtype == torch.float32 and out["logits"] is out.logits
        out = model(torch.randn(2, 4), labels=torch.randn(2, 4))
        assert list(out.keys()) == ["loss", "logits"] and out.loss is not None and out.loss.dtype == torch.float32
    finally:
        amp.deinitialize()


def test_mappings_keep_their_type_and_state_and_other_iterables_are_cast() -> None:
    """A ``defaultdict`` keeps its factory, a ``UserDict`` its attributes; sets and deques are cast as Apex's
    applier cast every iterable (they passed through in fp32 before, and a deque input failed in the fp16 model).

    Found by: the input/output casting audit.
    """
    from collections import UserDict, defaultdict, deque

    x = torch.randn(2)
    counts: defaultdict[str, list[torch.Tensor]] = defaultdict(list, a=[x])
    cast_counts = cast_floating(counts, torch.float16)
    assert type(cast_counts) is defaultdict and cast_counts.default_factory is list
    assert cast_counts["a"][0].dtype == torch.float16 and cast_counts["b"] == []
    assert counts["a"][0].dtype == torch.float32 and "b" not in counts  # the caller's mapping is not touched

    class Batch(UserDict):  # type: ignore[type-arg]
        def __init__(self, data: dict[str, torch.Tensor], tag: str = "") -> None:
            super().__init__(data)
            self.tag = tag

    batch = cast_floating(Batch({"x": x}, tag="t"), torch.float16)
    assert type(batch) is Batch and batch.tag == "t" and batch["x"].dtype == torch.float16
    for box in (deque([x]), {x}, frozenset([x])):
        cast_box = cast_floating(box, torch.float16)
        assert type(cast_box) is type(box) and next(iter(cast_box)).dtype == torch.float16

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, window: deque[torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = self.fc(window[-1])
            return out

    model = Head()
    amp.initialize(model, opt_level="O2", verbosity=0)
    try:
        assert model(deque([x, x])).dtype == torch.float32
    finally:
        amp.deinitialize()
