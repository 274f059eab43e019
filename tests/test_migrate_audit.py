"""Regressions found by an adversarial audit of ``ampinit migrate``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from ampinit.migrate import migrate_source


def test_inline_name_defined_as_a_fallback_is_not_rewritten() -> None:
    """`def to_python_float(t):` in the `except ImportError:` fallback was rewritten to `def torch.Tensor.item(t):`,
    so the migration crashed (and the CLI refused a valid file as "cannot be parsed as Python 3"); a parameter or a
    `global` of the name was rewritten too."""
    source = textwrap.dedent(
        """
        try:
            from apex.fp16_utils import to_python_float
        except ImportError:
            def to_python_float(t):
                return t.item()
        def f(to_python_float):
            return to_python_float(1)
        def g():
            global to_python_float
            to_python_float = None
        x = to_python_float(y)
        """
    )
    result = migrate_source(source)
    assert not result.refused
    compile(result.migrated, "<migrated>", "exec")
    assert "    def to_python_float(t):\n" in result.migrated
    assert "def f(to_python_float):\n    return to_python_float(1)\n" in result.migrated
    assert "    global to_python_float\n    to_python_float = None\n" in result.migrated
    assert "x = y.item()\n" in result.migrated
    assert migrate_source(result.migrated).migrated == result.migrated


def test_bare_package_name_stays_bound() -> None:
    """`import apex` used as a value (`getattr(apex, "amp")`, `print(apex)`) was rewritten to imports that do not
    bind `apex`: the migrated file raised NameError, reported clean."""
    source = 'import apex\namp = getattr(apex, "amp")\nprint(hasattr(amp, "initialize"), apex.fp16_utils is not None)\n'
    result = migrate_source(source)
    assert not result.refused
    assert "import ampinit.compat.apex as apex\n" in result.migrated
    run = subprocess.run([sys.executable, "-c", result.migrated], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "True True\n"
    assert migrate_source(result.migrated).migrated == result.migrated


def test_to_torch_enabled_int_becomes_a_bool() -> None:
    """Apex's `enabled=args.fp16` (an int: Apex only tested its truth) was passed on as given, and torch.autocast
    raises TypeError on a non-bool `enabled`."""
    source = textwrap.dedent(
        """
        import torch
        from apex import amp
        fp16 = 1
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, enabled=fp16, opt_level="O1")
        loss = model(torch.ones(1, 2)).sum()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        """
    )
    result = migrate_source(source, "torch")
    assert not result.refused
    assert "enabled=bool(fp16)" in result.migrated
    exec(compile(result.migrated, "<migrated>", "exec"), {"torch": torch})  # raised TypeError before


def test_import_sharing_a_line_stays_before_its_use() -> None:
    """`from apex.parallel import DistributedDataParallel as DDP; model = DDP(model)` put the statement before the
    import it uses (NameError), reported clean."""
    source = "from apex.parallel import DistributedDataParallel as DDP; model = DDP(model, delay_allreduce=True)\n"
    result = migrate_source(source)
    assert result.migrated == (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(model, find_unused_parameters=True)\n"
    )
    assert migrate_source(result.migrated).migrated == result.migrated


def test_import_as_one_line_body_is_migrated() -> None:
    """`try: import apex` (a one-line body) was left as it was while the uses were rewritten to torch's names: the
    file used `torch` without importing it (NameError) and kept importing Apex, reported clean; `try: from apex.parallel
    import DistributedDataParallel as DDP` kept Apex's DDP and gave it torch's keyword."""
    source = textwrap.dedent(
        """
        try: import apex
        except ImportError: apex = None
        x = apex.parallel.SyncBatchNorm(3)
        try: from apex.parallel import DistributedDataParallel as DDP
        except ImportError: DDP = None
        m = DDP(model, delay_allreduce=True)
        if fp16: from apex import amp
        """
    )
    result = migrate_source(source)
    assert "try: import torch\n" in result.migrated
    assert "try: from torch.nn.parallel import DistributedDataParallel as DDP\n" in result.migrated
    assert "if fp16: from ampinit import amp\n" in result.migrated
    assert "apex." not in result.migrated and "from apex" not in result.migrated
    compile(result.migrated, "<migrated>", "exec")
    assert migrate_source(result.migrated).migrated == result.migrated
