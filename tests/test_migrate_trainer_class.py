"""``--to torch`` for a training loop that lives in a class (issue 25, point 5): AllenNLP's and FastSpeech's trainer
shape, written small. A ``try: from apex import amp / except ImportError: amp = None`` guard, ``amp.initialize``
under ``if self.fp16:`` in ``__init__`` after ``self.model.train()``, the model wrapped again after it, the
``scale_loss`` block under ``with`` and ``if self.fp16:`` in the train step, ``amp.master_params`` clipping,
``amp.state_dict()`` in ``save`` and ``amp.load_state_dict`` in ``load``. The GradScaler becomes
``self.amp_scaler``, created where ``amp.initialize`` was; the expected output was written by hand, and the
migrated class is run against the original under the Apex aliases (as ``ampinit run`` runs it), loss by loss,
through a checkpoint, and with fp16 off against fp32. The reasons it is refused for where it is not equivalent
are each pinned below.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from ampinit.migrate import migrate_source
from tests._device import on_device
from tests._scripts import as_apex_code, exec_source

TRAINER = textwrap.dedent(
    """
    import torch
    from torch.nn.utils import clip_grad_norm_

    try:
        from apex import amp
    except ImportError:
        amp = None


    class Trainer:
        def __init__(self, model, optimizer, fp16):
            self.model = model
            self.optimizer = optimizer
            self.fp16 = fp16
            self.model.train()
            if self.fp16:
                self.model, self.optimizer = amp.initialize(self.model, self.optimizer, opt_level="O1")
            self.model = torch.nn.DataParallel(self.model)

        def train_step(self, x, y):
            self.optimizer.zero_grad()
            out = self.model(x)
            loss = torch.nn.functional.mse_loss(out, y)
            with torch.autograd.set_detect_anomaly(False):
                if self.fp16:
                    with amp.scale_loss(loss, self.optimizer) as scaled_loss:
                        scaled_loss.backward()
                else:
                    loss.backward()
            if self.fp16:
                clip_grad_norm_(amp.master_params(self.optimizer), 1.0)
            else:
                clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            return loss.item()

        def save(self):
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            if self.fp16:
                state["amp"] = amp.state_dict()
            return state

        def load(self, state):
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.fp16:
                amp.load_state_dict(state["amp"])
    """
)

TRAINER_TORCH = textwrap.dedent(
    '''
    import torch
    from torch.nn.utils import clip_grad_norm_


    def grad_scaler_state(state):
        """GradScaler state from a checkpoint written after the migration (GradScaler.state_dict()) or before it
        (Apex's amp.state_dict(): loss scale and clean steps, on Apex's schedule, which is GradScaler's default);
        written by ampinit migrate --to torch."""
        if "loss_scaler0" not in state:
            return state
        apex_state = state["loss_scaler0"]
        return {
            "scale": float(apex_state["loss_scale"]),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": int(apex_state["unskipped"]),
        }


    class Trainer:
        def __init__(self, model, optimizer, fp16):
            self.model = model
            self.optimizer = optimizer
            self.fp16 = fp16
            self.model.train()
            self.amp_device = next(self.model.parameters()).device.type
            self.amp_scaler = torch.amp.GradScaler(self.amp_device, enabled=bool(self.fp16))
            self.model = torch.nn.DataParallel(self.model)

        def train_step(self, x, y):
            self.optimizer.zero_grad()
            with torch.autocast(self.amp_device, dtype=torch.float16, enabled=self.amp_scaler.is_enabled()):
                out = self.model(x)
                loss = torch.nn.functional.mse_loss(out, y)
            with torch.autograd.set_detect_anomaly(False):
                if self.fp16:
                    self.amp_scaler.scale(loss).backward()
                else:
                    loss.backward()
            if self.fp16:
                self.amp_scaler.unscale_(self.optimizer)
                clip_grad_norm_((p for group in self.optimizer.param_groups for p in group["params"]), 1.0)
            else:
                clip_grad_norm_(self.model.parameters(), 1.0)
            self.amp_scaler.step(self.optimizer)
            self.amp_scaler.update()
            return loss.item()

        def save(self):
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            if self.fp16:
                state["amp"] = self.amp_scaler.state_dict()
            return state

        def load(self, state):
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.fp16:
                self.amp_scaler.load_state_dict(grad_scaler_state(state["amp"]))
    '''
)


def test_the_trainer_class_migrates_to_a_grad_scaler_attribute() -> None:
    result = migrate_source(TRAINER, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert result.migrated == TRAINER_TORCH
    again = migrate_source(result.migrated, "torch")
    assert again.migrated == result.migrated and not again.sites  # a second pass finds nothing left


def _problem() -> tuple[torch.nn.Linear, torch.optim.SGD, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model and data on the test device: the trainer wraps its model in ``DataParallel``, which on a GPU
    machine moves it to ``cuda:0`` (after ``amp.initialize``, which amp refuses), so a CUDA run starts there."""
    torch.manual_seed(0)
    model = on_device(torch.nn.Linear(4, 2))
    data = [on_device((torch.randn(8, 4), torch.randn(8, 2))) for _ in range(6)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def _train(source: str, fp16: bool, apex_aliases: bool) -> tuple[list[float], dict[str, object], list[float]]:
    """Three steps, a checkpoint, and three more steps of a fresh trainer that loads it (each half in its own
    session, as a resumed run is): the losses of both halves and the checkpoint."""
    model, optimizer, data = _problem()
    with as_apex_code(apex_aliases):
        trainer = exec_source(source, "trainer.py")["Trainer"](model, optimizer, fp16)  # type: ignore[operator]
        first = [trainer.train_step(x, y) for x, y in data[:3]]
        state = trainer.save()
    resumed_model, resumed_optimizer, _ = _problem()
    with as_apex_code(apex_aliases):
        resumed = exec_source(source, "trainer.py")["Trainer"](resumed_model, resumed_optimizer, fp16)  # type: ignore[operator]
        resumed.load(state)
        second = [resumed.train_step(x, y) for x, y in data[3:]]
    return first, state, second


def _fp32_losses() -> list[float]:
    """The same six steps in plain fp32, written here: the reference for the flag-off path."""
    model, optimizer, data = _problem()
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_migrated_trainer_trains_as_the_original_loss_by_loss(session_cleanup: None) -> None:
    migrated = migrate_source(TRAINER, "torch").migrated
    native_first, native_state, native_second = _train(migrated, True, apex_aliases=False)
    apex_first, apex_state, apex_second = _train(TRAINER, True, apex_aliases=True)
    torch.testing.assert_close(native_first + native_second, apex_first + apex_second, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(native_first + native_second, _fp32_losses(), rtol=1e-2, atol=1e-2)
    # the checkpoint carries the scaler's state: Apex's scale (no overflow in three steps) in GradScaler's format
    assert native_state["amp"]["scale"] == apex_state["amp"]["loss_scaler0"]["loss_scale"]  # type: ignore[index]


def test_the_migrated_trainer_with_fp16_off_is_the_fp32_loop(session_cleanup: None) -> None:
    migrated = migrate_source(TRAINER, "torch").migrated
    first, state, second = _train(migrated, False, apex_aliases=False)
    assert first + second == _fp32_losses()  # a disabled GradScaler and autocast are pass-throughs, bit for bit
    assert "amp" not in state


def test_an_apex_checkpoint_resumes_in_the_migrated_trainer(session_cleanup: None) -> None:
    """A run checkpointed before the migration (Apex's amp.state_dict()) resumes after it with Apex's scale."""
    migrated = migrate_source(TRAINER, "torch").migrated
    _, apex_state, apex_second = _train(TRAINER, True, apex_aliases=True)
    model, optimizer, data = _problem()
    trainer = exec_source(migrated, "trainer.py")["Trainer"](model, optimizer, True)  # type: ignore[operator]
    trainer.load(apex_state)
    assert trainer.amp_scaler.get_scale() == apex_state["amp"]["loss_scaler0"]["loss_scale"]  # type: ignore[index]
    torch.testing.assert_close([trainer.train_step(x, y) for x, y in data[3:]], apex_second, rtol=1e-3, atol=1e-3)


def _variant(old: str, new: str) -> str:
    assert TRAINER.count(old) == 1, old
    return TRAINER.replace(old, new)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (  # the trainer's own train() before the GradScaler exists: with fp16 off it ran without amp
            _variant("        self.model.train()\n", "        self.train_step(torch.zeros(1, 4), torch.zeros(1, 2))\n"),
            "self.train_step() is called before amp.initialize's `if <flag>:` in __init__() and may reach",
        ),
        (  # `self` handed to other code, which may call back into the trainer
            _variant("        self.model.train()\n", "        callbacks.register(self)\n"),
            "`self` itself is handed to other code before amp.initialize's `if <flag>:` in __init__()",
        ),
        (  # the optimizer replaced after amp.initialize processed it
            _variant(
                "        self.model = torch.nn.DataParallel(self.model)\n",
                "        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2)\n",
            ),
            "`self.optimizer` is assigned again (line 19) after amp.initialize returned it",
        ),
        (  # the fallback is read: after the rewrite `amp` would be unbound
            _variant("        self.fp16 = fp16\n", "        self.fp16 = fp16 and amp is not None\n"),
            "the amp module is used as an object (`self.fp16 = fp16 and amp is not None`)",
        ),
        (  # a fallback that is not `amp = None`: the code's other path is the fallback's, which would change
            _variant("    amp = None\n", "    amp = FallbackAmp()\n"),
            "the Apex import sits under `try` (an availability guard or a switch)",
        ),
        (  # a guard that catches more than a failed import
            _variant("except ImportError:\n", "except Exception:\n"),
            "the Apex import sits under `try` (an availability guard or a switch)",
        ),
    ],
    ids=["own-method-first", "self-escapes", "optimizer-replaced", "fallback-read", "other-fallback", "broad-except"],
)
def test_a_trainer_class_that_is_not_equivalent_is_refused_with_the_reason(source: str, reason: str) -> None:
    result = migrate_source(source, "torch")
    assert result.refused and result.migrated == source
    messages = [site.message for site in result.needs_human]
    assert any(message.startswith(reason) for message in messages), messages


def test_the_autocast_note_of_a_class_held_scaler_names_its_attributes() -> None:
    """Where the forward cannot be located (the loss is computed inside the scale_loss call), the note tells the
    human which autocast to write: in a trainer class the device lives in ``self.amp_device``; a bare
    ``amp_device`` there is an unbound name."""
    source = _variant(
        "with amp.scale_loss(loss, self.optimizer) as scaled_loss:",
        "with amp.scale_loss(loss * 1.0, self.optimizer) as scaled_loss:",
    )
    result = migrate_source(source, "torch")
    assert not result.refused
    header = "torch.autocast(self.amp_device, dtype=torch.float16, enabled=self.amp_scaler.is_enabled())"
    notes = [site.message for site in result.needs_human]
    assert notes == [
        f"run the forward pass and the loss under `with {header}:` (it could not be located next to this block)"
    ]
    assert f"# ampinit: {notes[0]}" in result.migrated


_INIT_TAIL = (
    "        if self.fp16:\n"
    '            self.model, self.optimizer = amp.initialize(self.model, self.optimizer, opt_level="O1")\n'
    "        self.model = torch.nn.DataParallel(self.model)\n"
)
_CLIPPING = (
    "        if self.fp16:\n"
    "            clip_grad_norm_(amp.master_params(self.optimizer), 1.0)\n"
    "        else:\n"
    "            clip_grad_norm_(self.model.parameters(), 1.0)\n"
)
#: The trainer with amp.initialize under `if self.fp16:` in a setup() that __init__ calls, and the master_params
#: clipping in a helper method that the train step calls between its scale_loss block and its step.
SET_UP_TRAINER = (
    TRAINER.replace(
        _INIT_TAIL,
        "        self.setup()\n        self.model = torch.nn.DataParallel(self.model)\n\n"
        "    def setup(self):\n" + _INIT_TAIL.replace("        self.model = torch.nn.DataParallel(self.model)\n", ""),
    )
    .replace(_CLIPPING, "        self.clip_gradients()\n")
    .replace("    def save(self):\n", "    def clip_gradients(self):\n" + _CLIPPING + "\n    def save(self):\n")
)


def test_a_setup_method_and_a_clipping_helper_migrate() -> None:
    assert "    def setup(self):\n" in SET_UP_TRAINER and "        self.clip_gradients()\n" in SET_UP_TRAINER
    result = migrate_source(SET_UP_TRAINER, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert (
        "    def setup(self):\n"
        "        self.amp_device = next(self.model.parameters()).device.type\n"
        "        self.amp_scaler = torch.amp.GradScaler(self.amp_device, enabled=bool(self.fp16))\n"
    ) in result.migrated
    assert (
        "    def clip_gradients(self):\n        if self.fp16:\n            self.amp_scaler.unscale_(self.optimizer)\n"
    ) in result.migrated


def test_the_set_up_trainer_trains_as_the_original_loss_by_loss(session_cleanup: None) -> None:
    migrated = migrate_source(SET_UP_TRAINER, "torch").migrated
    native_first, _, native_second = _train(migrated, True, apex_aliases=False)
    apex_first, _, apex_second = _train(SET_UP_TRAINER, True, apex_aliases=True)
    torch.testing.assert_close(native_first + native_second, apex_first + apex_second, rtol=1e-3, atol=1e-3)
    off_first, _, off_second = _train(migrated, False, apex_aliases=False)
    assert off_first + off_second == _fp32_losses()


def _set_up_variant(old: str, new: str) -> str:
    assert SET_UP_TRAINER.count(old) == 1, old
    return SET_UP_TRAINER.replace(old, new)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (  # setup() left to the caller: train_step() may run first, which with fp16 off worked without amp
            _set_up_variant("        self.setup()\n", ""),
            "amp.initialize sits under `if <flag>:` in setup(), and clip_gradients(), load(), save(), train_step() "
            "may run before it",
        ),
        (  # setup() called again later: a second GradScaler would replace the first
            _set_up_variant(
                "    def save(self):\n", "    def reset(self):\n        self.setup()\n\n    def save(self):\n"
            ),
            "__init__() calls setup(), whose `if <flag>:` creates the GradScaler, but setup is named elsewhere",
        ),
        (  # __init__ steps before it sets up
            _set_up_variant(
                "        self.setup()\n",
                "        self.train_step(torch.zeros(1, 4), torch.zeros(1, 2))\n        self.setup()\n",
            ),
            "self.train_step() is called in __init__() before it calls setup()",
        ),
        (  # the helper clips twice before one step
            _set_up_variant(
                "        self.clip_gradients()\n", "        self.clip_gradients()\n        self.clip_gradients()\n"
            ),
            "amp.master_params clipped in clip_gradients(), whose scaler.unscale_(optimizer) must run once between "
            "each scaled backward and scaler.step(), but it may run twice before one step",
        ),
        (  # the helper handed out: whoever calls it is not in this file
            _set_up_variant(
                "        self.setup()\n", "        self.setup()\n        self.hooks = [self.clip_gradients]\n"
            ),
            "amp.master_params clipped in clip_gradients(), whose scaler.unscale_(optimizer) must run once between "
            "each scaled backward and scaler.step(), but `clip_gradients` is used other than by a call",
        ),
        (  # clipped before the backward: Apex clipped the previous gradients, unscale_ would come too early
            _set_up_variant(
                "        self.optimizer.zero_grad()\n",
                "        self.optimizer.zero_grad()\n        self.clip_gradients()\n",
            ).replace(
                "        self.clip_gradients()\n        self.optimizer.step()\n", "        self.optimizer.step()\n"
            ),
            "amp.master_params clipped in clip_gradients(), whose scaler.unscale_(optimizer) must run once between "
            "each scaled backward and scaler.step(), but its call at line 26 is not between a scale_loss block",
        ),
        (  # the helper clips once per parameter group: unscale_ would run again before update()
            _set_up_variant(
                "            clip_grad_norm_(amp.master_params(self.optimizer), 1.0)\n",
                "            for _ in self.optimizer.param_groups:\n"
                "                if self.fp16:\n"
                "                    clip_grad_norm_(amp.master_params(self.optimizer), 1.0)\n",
            ),
            "amp.master_params clipped in clip_gradients(), whose scaler.unscale_(optimizer) must run once between "
            "each scaled backward and scaler.step(), but it clips in a loop",
        ),
    ],
    ids=[
        "setup-by-caller",
        "setup-twice",
        "step-in-init-first",
        "helper-twice",
        "helper-handed-out",
        "helper-early",
        "helper-loops",
    ],
)
def test_a_set_up_trainer_that_is_not_equivalent_is_refused_with_the_reason(source: str, reason: str) -> None:
    result = migrate_source(source, "torch")
    assert result.refused and result.migrated == source
    messages = [site.message for site in result.needs_human]
    assert len(messages) == 1 and messages[0].startswith(reason), messages
