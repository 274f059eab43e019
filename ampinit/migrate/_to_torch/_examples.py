"""A file for each refusal of :mod:`._refusals`: :data:`LOOP` (which migrates) with the one change that makes
exactly that row refuse it. They document the rows, and the tests run every one.
"""

from __future__ import annotations

LOOP = """\
import torch
from apex import amp

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1")


def train(batches):
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).sum()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
"""
INIT = 'model, optimizer = amp.initialize(model, optimizer, opt_level="O1")\n'
BLOCK = "        with amp.scale_loss(loss, optimizer) as scaled_loss:\n            scaled_loss.backward()\n"
STEP = "        optimizer.step()\n"


def edit(old: str, new: str, source: str = LOOP) -> str:
    """``source`` with its one ``old`` replaced by ``new``."""
    assert source.count(old) == 1, old
    return source.replace(old, new)


def _initialize(arguments: str) -> str:
    return edit(INIT, f"model, optimizer = amp.initialize(model, optimizer, {arguments})\n")


def _with(*lines: str) -> str:
    """:data:`LOOP` with ``lines`` (indented for the loop) between the scale_loss block and the step."""
    return edit(BLOCK, BLOCK + "".join(f"        {line}\n" for line in lines))


def _check(*body: str) -> str:
    """:data:`LOOP` with a function ``check(loss)`` of ``body`` (amp used outside the loop)."""
    return LOOP + "\n\ndef check(loss):\n" + "".join(f"    {line}\n" for line in body)


_OPTION_VALUES = {
    "cast_model_type": "torch.float16",
    "patch_torch_functions": "True",
    "keep_batchnorm_fp32": "True",
    "master_weights": "False",
    "cast_model_outputs": "torch.float16",
    "min_loss_scale": "1.0",
    "max_loss_scale": "2.0**24",
}


def initialize_with(option: str) -> str:
    return _initialize(f'opt_level="O1", {option}={_OPTION_VALUES[option]}')


INITIALIZE_TWICE = edit(INIT, INIT * 2)
NO_INITIALIZE = edit(INIT, "")
INITIALIZE_NOT_CALLED = "from apex import amp\n\ninitialize = amp.initialize\n"
INITIALIZE_STAR_ARGS = "from apex import amp\n\nmodel, optimizer = amp.initialize(*objects)\n"
INITIALIZE_LISTS = "from apex import amp\n\nmodels, optimizer = amp.initialize([a, b], optimizer)\n"
INITIALIZE_WITHOUT_OPTIMIZER = 'from apex import amp\n\nmodel = amp.initialize(model, opt_level="O1")\n'
OPT_LEVEL_HALF = _initialize('opt_level="O2"')
OPT_LEVEL_UNKNOWN = _initialize("opt_level=config.opt_level")
NUM_LOSSES = _initialize('opt_level="O1", num_losses=2')
STATIC_LOSS_SCALE = _initialize('opt_level="O1", loss_scale=128.0')
INITIALIZE_IN_EXPRESSION = edit(INIT, 'pair = list(amp.initialize(model, optimizer, opt_level="O1"))\n')
INITIALIZE_NOT_ALONE = edit(INIT, INIT.rstrip() + "; ready = True\n")
INITIALIZE_NOT_UNPACKED = edit(INIT, 'pair = amp.initialize(model, optimizer, opt_level="O1")\n')
INITIALIZE_ON_SOME_PATHS = edit(INIT, f"if use_amp:\n    {INIT}else:\n    pass\n")
FLAG_ASSIGNED_AGAIN = edit(INIT, f"if use_amp:\n    {INIT}use_amp = False\n")
APEX_IMPORT_GUARDED = edit("from apex import amp\n", "if use_amp:\n    from apex import amp\n")
AMP_USE_UNREACHABLE = (
    edit(INIT, "")
    .replace("def train(batches):", "def train(model, optimizer, batches):\n    " + INIT.rstrip())
    .replace("optimizer.step()\n", "optimizer.step()\n\n\ndef save():\n    return amp.state_dict()\n")
)
AMP_AS_OBJECT = edit(INIT, INIT + 'to_save = {"model": model, "amp": amp}\n')
AMP_USE_NOT_NATIVE = edit(INIT, INIT + 'amp.register_half_function(torch, "mm")\n')
SCALE_LOSS_NOT_IN_WITH = edit(INIT, INIT + "context = amp.scale_loss\n")
SCALE_LOSS_WITHOUT_AS = _check("with amp.scale_loss(loss, optimizer):", "    pass")
SCALE_LOSS_ONE_LINE = _check("with amp.scale_loss(loss, optimizer) as scaled: pass")
SCALE_LOSS_STAR_ARGS = _check("with amp.scale_loss(*loss) as scaled:", "    pass")
SCALE_LOSS_OTHER_OPTIMIZER = _check("with amp.scale_loss(loss, other) as scaled:", "    pass")
LOSS_ID = edit("scale_loss(loss, optimizer)", "scale_loss(loss, optimizer, loss_id=1)")
DELAY_UNSCALE = edit("scale_loss(loss, optimizer)", "scale_loss(loss, optimizer, delay_unscale=True)")
DELAY_OVERFLOW_CHECK = edit("scale_loss(loss, optimizer)", "scale_loss(loss, optimizer, delay_overflow_check=True)")
MASTER_PARAMS_OUTSIDE_CLIPPING = edit(INIT, INIT + "parameters = list(amp.master_params(optimizer))\n")
MASTER_PARAMS_OTHER_OPTIMIZER = _with("torch.nn.utils.clip_grad_norm_(amp.master_params(other), 1.0)")
MASTER_PARAMS_NOT_ALONE = _with("torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0); ready = True")
MASTER_PARAMS_IN_SCALE_LOSS = edit(
    BLOCK, BLOCK + "            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)\n"
)
AMP_CALL_NOT_CALLED = edit(INIT, INIT + "save = amp.state_dict\n")
LOAD_STATE_DICT_ARGUMENTS = edit(INIT, INIT + "amp.load_state_dict(state, strict=True)\n")
AMP_STATE_INTERNALS = edit(INIT, INIT + "handle = amp._amp_state.handle\n")
LOSS_SCALE_READ_BEFORE_STEP = _with("scale = amp._amp_state.loss_scalers[0].loss_scale()")
NO_STEP = edit(STEP, "")
STEP_WITH_CLOSURE = edit(STEP, "        optimizer.step(closure)\n")
STEP_IN_EXPRESSION = edit(STEP, "        done = [optimizer.step()]\n")
STEP_NOT_ALONE = edit(STEP, "        optimizer.step(); ready = True\n")
STEP_IN_SCALE_LOSS = edit(BLOCK + STEP, BLOCK + "            optimizer.step()\n")
# a step that cannot mean the initialized optimizer, in a function that scales no loss (where a use of amp could
# not reach the GradScaler either): refused for that path too, see the tests
STEP_UNREACHABLE = LOOP + "\n\ndef finish(optimizer):\n    optimizer.step()\n"
_TRAINER = """\
import torch
from apex import amp


class Trainer:
    __slots__ = ("model", "optimizer")

    def __init__(self, model, optimizer):
        self.model, self.optimizer = amp.initialize(model, optimizer, opt_level="O1")

    def train(self, batches):
        for x in batches:
            self.optimizer.zero_grad()
            loss = self.model(x).sum()
            with amp.scale_loss(loss, self.optimizer) as scaled_loss:
                scaled_loss.backward()
            self.optimizer.step()
"""
SCALER_ATTRIBUTE_SLOTS = _TRAINER
# the optimizer replaced after amp.initialize processed it (a model wrapped or replaced there is no reason: autocast
# casts whatever module runs under it)
OPTIMIZER_ASSIGNED_AGAIN = edit(INIT, INIT + "optimizer = torch.optim.SGD(model.parameters(), lr=0.2)\n")
_FLAGGED = edit(INIT, f"use_amp = True\nif use_amp:\n    {INIT}")
FLAG_DIFFERS_ELSEWHERE = """\
import torch
from apex import amp

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
use_amp = True
if use_amp:
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")


def train(batches, use_amp):
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).sum()
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
"""
FLAG_ASSIGNED_ELSEWHERE = _FLAGGED + "\n\ndef disable():\n    global use_amp\n    use_amp = False\n"
SCALER_CREATED_LATE = edit(INIT, "") + f"\n\ntrain([])\nif use_amp:\n    {INIT}"
STEP_BEFORE_INITIALIZE = edit(INIT, "optimizer.step()\n" + INIT)
STEP_WITHOUT_SCALE_LOSS = LOOP + "\n\ndef finish():\n    optimizer.step()\n"
BACKWARD_OUTSIDE_SCALE_LOSS = edit(BLOCK, "        loss.backward()\n" + BLOCK)
CLIPPING_NOT_THROUGH_AMP = _with("torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)")
GRAD_USED_BY_HAND = _with("norm = model.weight.grad.norm()")
MASTER_PARAMS_TWICE = _with(
    "torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)",
    "torch.nn.utils.clip_grad_value_(amp.master_params(optimizer), 1.0)",
)
MASTER_PARAMS_WITHOUT_STEP = _with(
    "if x is not None:", "    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)"
)
MASTER_PARAMS_HELPER_UNPROVEN = (
    _with("if x is not None:", "    clip()")
    + "\n\ndef clip():\n    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)\n"
)
