"""``--to torch`` across functions and with an ``opt_level`` from argparse (issue 15, point 7): the loop in another
method or function than ``amp.initialize`` migrates where the GradScaler is reachable there (``self.amp_scaler`` of
the same class, a module-level name, a closure) and the model and optimizer provably mean the initialized ones;
``args.opt_level`` migrates where argparse's ``choices=`` restrict it to O0/O1. Everything else is refused with
the reason. Every input here is synthetic (the shapes the legacy corpus has, written small); each expected output
was written by hand, and each migrated file is run against the original under the Apex aliases and against fp32.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest
import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

# FastSpeech's trainer, reduced: amp.initialize in __init__ under the trainer's flag, the loop in a method.
TRAINER = textwrap.dedent(
    """
    import torch
    from apex import amp


    class Trainer:
        def __init__(self, model, optimizer, use_amp):
            self.model = model
            self.optimizer = optimizer
            self.use_amp = use_amp
            if self.use_amp:
                self.model, self.optimizer = amp.initialize(self.model, self.optimizer, opt_level="O1")

        def train_step(self, x, y):
            self.optimizer.zero_grad()
            out = self.model(x)
            loss = torch.nn.functional.mse_loss(out, y)
            if self.use_amp:
                with amp.scale_loss(loss, self.optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            self.optimizer.step()  # noqa: the step
            return loss.item()

        def save(self):
            return {"amp": amp.state_dict()}


    def train(model, optimizer, data, fp16_run):
        trainer = Trainer(model, optimizer, fp16_run)
        for x, y in data:
            trainer.train_step(x, y)
        return trainer.save()
    """
)

TRAINER_TORCH = textwrap.dedent(
    """
    import torch


    class Trainer:
        def __init__(self, model, optimizer, use_amp):
            self.model = model
            self.optimizer = optimizer
            self.use_amp = use_amp
            self.amp_device = next(self.model.parameters()).device.type
            self.amp_scaler = torch.amp.GradScaler(self.amp_device, enabled=bool(self.use_amp))

        def train_step(self, x, y):
            self.optimizer.zero_grad()
            with torch.autocast(self.amp_device, dtype=torch.float16, enabled=self.amp_scaler.is_enabled()):
                out = self.model(x)
                loss = torch.nn.functional.mse_loss(out, y)
            if self.use_amp:
                self.amp_scaler.scale(loss).backward()
            else:
                loss.backward()
            self.amp_scaler.step(self.optimizer)  # noqa: the step
            self.amp_scaler.update()
            return loss.item()

        def save(self):
            return {"amp": self.amp_scaler.state_dict()}


    def train(model, optimizer, data, fp16_run):
        trainer = Trainer(model, optimizer, fp16_run)
        for x, y in data:
            trainer.train_step(x, y)
        return trainer.save()
    """
)

# amp.initialize at module level, the loop and the checkpoint in module-level functions.
MODULE_LEVEL = textwrap.dedent(
    """
    import torch
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")


    def step(x, y):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


    def checkpoint():
        return {"model": model.state_dict(), "amp": amp.state_dict()}
    """
)

MODULE_LEVEL_TORCH = textwrap.dedent(
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(amp_device)


    def step(x, y):
        optimizer.zero_grad()
        with torch.autocast(amp_device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


    def checkpoint():
        return {"model": model.state_dict(), "amp": scaler.state_dict()}
    """
)

# The step in a closure of the function that initializes.
CLOSURE = textwrap.dedent(
    """
    import torch
    from apex import amp


    def train(model, optimizer, data, fp16_run):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", enabled=fp16_run)

        def step(x, y):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

        for x, y in data:
            step(x, y)
    """
)

CLOSURE_TORCH = textwrap.dedent(
    """
    import torch


    def train(model, optimizer, data, fp16_run):
        amp_device = next(model.parameters()).device.type
        scaler = torch.amp.GradScaler(amp_device, enabled=bool(fp16_run))

        def step(x, y):
            optimizer.zero_grad()
            with torch.autocast(amp_device, dtype=torch.float16, enabled=scaler.is_enabled()):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        for x, y in data:
            step(x, y)
    """
)


@pytest.mark.parametrize(
    ("source", "expected"),
    [(TRAINER, TRAINER_TORCH), (MODULE_LEVEL, MODULE_LEVEL_TORCH), (CLOSURE, CLOSURE_TORCH)],
    ids=["method", "module-level", "closure"],
)
def test_the_loop_in_another_function_migrates_where_the_scaler_is_reachable(source: str, expected: str) -> None:
    result = migrate_source(source, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert result.migrated == expected
    again = migrate_source(result.migrated, "torch")
    assert again.migrated == result.migrated and not again.sites  # a second pass finds nothing left


def _problem() -> tuple[torch.nn.Linear, torch.optim.SGD, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def _run(source: str, call: Callable[[dict[str, object]], object], apex_aliases: bool = False) -> dict[str, object]:
    """Execute ``source`` (as ``ampinit run`` would with ``apex_aliases``) and ``call`` into its namespace."""
    with as_apex_code(apex_aliases):
        namespace = exec_source(source, "synthetic.py")
        namespace["result"] = call(namespace)
    return namespace


def _fp32() -> torch.Tensor:
    model, optimizer, data = _problem()
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.weight.detach().clone()


def _train(source: str, fp16_run: bool, apex_aliases: bool = False) -> tuple[torch.Tensor, object]:
    model, optimizer, data = _problem()
    namespace = _run(source, lambda ns: ns["train"](model, optimizer, data, fp16_run), apex_aliases)  # type: ignore[operator]
    return model.weight.detach().clone(), namespace["result"]


@pytest.mark.parametrize("source", [TRAINER, CLOSURE], ids=["method", "closure"])
def test_the_migrated_loop_trains_as_the_original_and_as_fp32(source: str, session_cleanup: None) -> None:
    migrated = migrate_source(source, "torch").migrated
    # amp off: bitwise the fp32 loop, as the original was (a disabled GradScaler is a pass-through)
    torch.testing.assert_close(_train(migrated, False)[0], _fp32(), rtol=0, atol=0)
    (native, state), (original, apex_state) = _train(migrated, True), _train(source, True, apex_aliases=True)
    torch.testing.assert_close(native, original, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(native, _fp32(), rtol=1e-2, atol=1e-2)
    if state is not None:  # the checkpoint: GradScaler's state, with Apex's scale (no overflow in 4 steps)
        assert state["amp"]["scale"] == apex_state["amp"]["loss_scaler0"]["loss_scale"]  # type: ignore[index]


def test_the_migrated_module_level_loop_trains_as_the_original(session_cleanup: None) -> None:
    migrated = migrate_source(MODULE_LEVEL, "torch").migrated
    _, _, data = _problem()

    def loop(namespace: dict[str, object]) -> object:
        for x, y in data:
            namespace["step"](x, y)  # type: ignore[operator]
        return namespace["checkpoint"]()  # type: ignore[operator]

    native, original = _run(migrated, loop), _run(MODULE_LEVEL, loop, apex_aliases=True)
    weights = [ns["model"].weight.detach() for ns in (native, original)]  # type: ignore[attr-defined]
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(weights[0], _fp32(), rtol=1e-2, atol=1e-2)


# semantic-segmentation's shape: amp.initialize in train(), the loop in a module-level step() given the objects.
SEPARATE_FUNCTIONS = textwrap.dedent(
    """
    import torch
    from apex import amp


    def step(model, optimizer, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


    def train(model, optimizer, data, fp16_run):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        for x, y in data:
            step(model, optimizer, x, y)
    """
)


# A module-level flag guards initialize, and a function can turn it off after the GradScaler was created.
GLOBAL_FLAG = textwrap.dedent(
    """
    import torch
    from apex import amp

    fp16 = True
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if fp16:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")


    def off():
        global fp16
        fp16 = False


    def step(x):
        loss = model(x).sum()
        if fp16:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
    """
)


def _variant(source: str, old: str, new: str) -> str:
    assert old in source, old
    return source.replace(old, new)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (  # setup() may run after train_step(): with the flag off that stepped without amp
            _variant(
                TRAINER, "def __init__(self, model, optimizer, use_amp):", "def setup(self, model, optimizer, use_amp):"
            ),
            "amp.initialize sits under `if <flag>:` in setup(), and save(), train_step() may run before it",
        ),
        (  # the loop gets the optimizer as a parameter: it may not be the initialized one
            _variant(CLOSURE, "    def step(x, y):", "    def step(x, y, optimizer=optimizer):"),
            "`optimizer` in step() is step()'s own name (a parameter or a local)",
        ),
        (  # train()'s GradScaler would be a local that step() cannot see
            SEPARATE_FUNCTIONS,
            "the GradScaler would be a local of train(), which step() cannot reach",
        ),
        (  # another method assigns the optimizer: the loop could step another one
            _variant(
                TRAINER,
                "    def save(self):",
                "    def reset(self):\n        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)\n\n"
                "    def save(self):",
            ),
            "`self.optimizer` is assigned again (line",
        ),
        (  # the trainer's flag is changed by another method
            _variant(
                TRAINER,
                "    def save(self):",
                "    def off(self):\n        self.use_amp = False\n\n    def save(self):",
            ),
            "the flag `self.use_amp` that guards amp.initialize is assigned in another function (self.use_amp)",
        ),
        (  # __init__ runs the loop before it creates the GradScaler
            _variant(
                TRAINER,
                "        if self.use_amp:\n            self.model",
                "        self.train_step(None, None)\n        if self.use_amp:\n            self.model",
            ),
            "train_step() is called before amp.initialize's `if <flag>:` in __init__()",
        ),
        (  # a function rebinds the module's optimizer: the loop could step another one
            MODULE_LEVEL
            + "\n\ndef reset():\n    global optimizer\n    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)\n",
            "`optimizer` is assigned again (line",
        ),
        (  # the module-level flag that guards initialize is turned off through `global` in a function
            GLOBAL_FLAG,
            "the flag `fp16` that guards amp.initialize is assigned in another function (fp16)",
        ),
        (  # a subclass's own __init__ may skip the one that creates the GradScaler
            TRAINER
            + "\n\nclass Quiet(Trainer):\n    def __init__(self, model, optimizer):\n        self.use_amp = False\n",
            "Quiet, a subclass of Trainer in this file, defines its own __init__",
        ),
        (  # instances with __slots__ cannot take the GradScaler attribute
            _variant(
                TRAINER, "class Trainer:\n", "class Trainer:\n    __slots__ = ('model', 'optimizer', 'use_amp')\n\n"
            ),
            "Trainer defines __slots__: the GradScaler cannot be kept as an attribute of its instances",
        ),
        (  # a function of another class cannot read self.amp_scaler
            TRAINER + "\n\nclass Other:\n    def save(self):\n        return amp.state_dict()\n",
            "save() is not a method of the class whose __init__() calls amp.initialize",
        ),
    ],
    ids=[
        "setup",
        "parameter",
        "local",
        "reassigned",
        "flag-changed",
        "called-early",
        "global",
        "global-flag",
        "subclass",
        "slots",
        "other-class",
    ],
)
def test_the_loop_in_another_function_is_refused_where_it_cannot_be_proven(source: str, reason: str) -> None:
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    assert any(reason in site.message for site in result.needs_human), [s.render() for s in result.sites]


def test_disable_casts_in_a_function_that_cannot_reach_the_device_is_refused() -> None:
    """This used to be rewritten to `torch.autocast(amp_device, ...)` in a function where `amp_device` (a local of
    the function that initializes) does not exist: a NameError at run time."""
    source = textwrap.dedent(
        """
        import torch
        from apex import amp


        def matmul(x):
            with amp.disable_casts():
                return x @ x


        def main(model, optimizer, x):
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
            loss = matmul(model(x)).sum()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        """
    )
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    assert [s.render() for s in result.needs_human] == [
        "  line 7: [needs a human] amp.disable_casts: the GradScaler would be a local of main(), which matmul() "
        "cannot reach: pass it there by hand (a parameter), or use --to ampinit"
    ]


# -- opt_level from argparse ------------------------------------------------------------------------------------------

ARGPARSE = textwrap.dedent(
    """
    import argparse

    import torch
    from apex import amp


    def parse_args(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--opt-level", choices=["O0", "O1"], default="O1")
        parser.add_argument("--lr", type=float, default=0.1)
        return parser.parse_args(argv)


    def train(model, optimizer, data, argv):
        args = parse_args(argv)
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
        for x, y in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    """
)

ARGPARSE_TORCH = textwrap.dedent(
    """
    import argparse

    import torch


    def parse_args(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--opt-level", choices=["O0", "O1"], default="O1")
        parser.add_argument("--lr", type=float, default=0.1)
        return parser.parse_args(argv)


    def train(model, optimizer, data, argv):
        args = parse_args(argv)
        amp_device = next(model.parameters()).device.type
        scaler = torch.amp.GradScaler(amp_device, enabled=bool(args.opt_level == "O1"))
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast(amp_device, dtype=torch.float16, enabled=bool(args.opt_level == "O1")):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    """
)


def test_an_argparse_opt_level_restricted_to_o0_o1_migrates_and_trains(session_cleanup: None) -> None:
    result = migrate_source(ARGPARSE, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert result.migrated == ARGPARSE_TORCH
    assert migrate_source(result.migrated, "torch").migrated == result.migrated
    assert (
        result.sites[0].message
        == 'amp (O0 or O1: args.opt_level == "O1") -> torch.autocast + torch.amp.GradScaler (scaler)'
    )
    # --opt-level O0: bitwise fp32, as Apex's O0 was
    torch.testing.assert_close(_train(result.migrated, ["--opt-level", "O0"])[0], _fp32(), rtol=0, atol=0)  # type: ignore[arg-type]
    native = _train(result.migrated, [])[0]  # type: ignore[arg-type]
    original = _train(ARGPARSE, [], apex_aliases=True)[0]  # type: ignore[arg-type]
    torch.testing.assert_close(native, original, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(native, _fp32(), rtol=1e-2, atol=1e-2)


def test_a_module_level_parser_with_one_choice_gives_that_level() -> None:
    source = textwrap.dedent(
        """
        import argparse

        import torch
        from apex import amp

        parser = argparse.ArgumentParser()
        group = parser.add_argument_group("amp")
        group.add_argument("--amp-level", dest="level", choices=("O1",), default="O1")
        args, _ = parser.parse_known_args()


        def train(model, optimizer, x):
            model, optimizer = amp.initialize(model, optimizer, opt_level=args.level)
            loss = model(x).sum()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        """
    )
    result = migrate_source(source, "torch")
    assert not result.refused, [s.render() for s in result.sites]
    assert "    scaler = torch.amp.GradScaler(amp_device)\n" in result.migrated
    assert result.sites[0].message == "amp (O1) -> torch.autocast + torch.amp.GradScaler (scaler)"
    rebound = migrate_source(source + "\n\ndef reload():\n    global args\n    args = None\n", "torch")
    assert rebound.refused and any(
        "`args` is assigned through `global args` in reload()" in s.message for s in rebound.needs_human
    ), [s.render() for s in rebound.sites]


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        ('choices=["O0", "O1"], ', "", '"--opt-level" has no literal choices=, so it takes any level'),
        ('["O0", "O1"]', '["O0", "O1", "O2"]', "`args.opt_level` could hold ['O0', 'O1', 'O2']"),
        ('default="O1"', 'default="O2"', "`args.opt_level` could hold ['O0', 'O1', 'O2']"),
        ('default="O1")', 'default="O1", nargs="?")', '"--opt-level" has nargs=, which lets other values through'),
        ('default="O1")', 'default="O1", type=str.upper)', '"--opt-level" has type=str.upper'),
        ('default="O1")', 'default="O1")\n    parser.set_defaults(opt_level="O3")', "could hold ['O0', 'O1', 'O3']"),
        (
            "return parser.parse_args(argv)",
            "add_model_args(parser)\n    return parser.parse_args(argv)",
            "`parser` is handed to add_model_args(), outside this file",
        ),
        (
            "args = parse_args(argv)",
            "args = parse_args(argv)\n    args.opt_level = argv[-1]",
            "`args.opt_level` is assigned in this file",
        ),
        (
            "opt_level=args.opt_level)",
            'opt_level=config["amp"]["opt_level"])',
            "is neither a literal nor an argparse value (a config?): it could hold any level",
        ),
        (
            "args = parse_args(argv)",
            "args = load_config(argv)",
            "`load_config()` is not a function of this file that returns parse_args()",
        ),
        (
            "def train(model, optimizer, data, argv):\n    args = parse_args(argv)",
            "def train(model, optimizer, data, args):",
            "`args` is a parameter of train()",
        ),
    ],
    ids=[
        "no-choices",
        "o2-choice",
        "o2-default",
        "nargs",
        "type",
        "set-defaults",
        "escaping-parser",
        "assigned",
        "config-dict",
        "config",
        "parameter",
    ],
)
def test_an_argparse_opt_level_that_could_be_another_level_is_refused(old: str, new: str, reason: str) -> None:
    source = _variant(ARGPARSE, old, new)
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    messages = [s.message for s in result.needs_human]
    assert any(m.startswith("opt_level is not a literal") and reason in m for m in messages), messages
