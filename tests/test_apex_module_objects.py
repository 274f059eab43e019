"""``amp`` and the Apex aliases used as module objects: code that logs ``amp.__path__``/``__file__``/
``__version__`` to say which amp is loaded, and optimizer factories that import Apex modules by their names as
strings (``importlib.import_module("apex.optimizers")``, ``find_spec``, ``__import__``), under ``ampinit run``
(the aliases) and after ``migrate --to ampinit`` (where Apex is not installed, so the strings must name ampinit)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

import ampinit
from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

FACTORY = """
import importlib
import importlib.util
from apex import amp
location = (amp.__path__, amp.__file__, amp.__version__)
def optimizer_class(name):
    return getattr(importlib.import_module("apex.optimizers"), name)
found = importlib.util.find_spec("apex.optimizers") is not None
lamb = optimizer_class("FusedLAMB")
top = __import__("apex.optimizers").optimizers.FusedAdam
sub = __import__("apex.optimizers", fromlist=["FusedAdam"]).FusedAdam
"""


def test_ampinit_amp_answers_as_a_module_does() -> None:
    from ampinit import amp

    assert amp.__version__ == ampinit.__version__
    assert os.path.samefile(amp.__path__[0], os.path.dirname(ampinit.__file__))
    assert os.path.isfile(amp.__file__)


def test_module_names_as_strings_work_under_ampinit_run() -> None:
    from ampinit.optimizers import FusedAdam, FusedLAMB

    with as_apex_code(apex_aliases=True):
        namespace = exec_source(FACTORY, "factory.py")
    assert namespace["lamb"] is FusedLAMB and namespace["found"] is True
    assert namespace["top"] is FusedAdam and namespace["sub"] is FusedAdam
    path, file, version = namespace["location"]  # type: ignore[misc]
    assert version == ampinit.__version__ and os.path.isfile(file) and path


def test_migrated_factory_runs_without_apex() -> None:
    """After --to ampinit no string names apex, except __import__ without fromlist, which is flagged."""
    result = migrate_source(FACTORY, "ampinit", "factory.py")
    strings = [s.message for s in result.needs_human]
    assert len(strings) == 1 and strings[0].startswith('__import__("apex.optimizers")'), strings
    runnable = result.migrated.replace('top = __import__("apex.optimizers").optimizers.FusedAdam\n', "")
    assert '"apex' not in runnable
    namespace = exec_source(runnable, "factory.py")
    from ampinit.optimizers import FusedLAMB

    assert namespace["lamb"] is FusedLAMB and namespace["found"] is True


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ("amp.initialize(model, opt, verbosity=args.local_rank == 0)", "verbosity=args.local_rank == 0 is a bool"),
        ("amp.initialize(model, opt, num_losses=True)", "num_losses=True is a bool"),
        ("amp.initialize(model, opt, max_loss_scale='65536')", "max_loss_scale='65536' is a str"),
        ("amp.initialize(model, opt, bogus=1)", "unexpected keyword argument 'bogus'"),
        ("FusedAdam(params, eps_inside_sqrt=True)", "eps_inside_sqrt: Apex dropped it in 2019-08"),
    ],
)
def test_a_call_that_cannot_bind_is_not_reported_clean(call: str, reason: str) -> None:
    source = f"from apex import amp\nfrom apex.optimizers import FusedAdam\n{call}\n"
    result = migrate_source(source, "ampinit", "train.py")
    assert [s.line for s in result.needs_human] == [3]
    assert "does not bind to ampinit's signature" in result.needs_human[0].message
    assert reason in result.needs_human[0].message


def test_calls_that_bind_stay_clean() -> None:
    source = (
        "from apex import amp\nfrom apex.optimizers import FusedAdam\n"
        "opt = FusedAdam(params, lr=1e-3, max_grad_norm=1.0)\n"
        "model, opt = amp.initialize(model, opt, opt_level=args.level, verbosity=0, loss_scale='dynamic')\n"
    )
    result = migrate_source(source, "ampinit", "train.py")
    assert result.needs_human == []
    assert any("max_grad_norm" in s.message for s in result.sites)


def test_find_spec_of_an_apex_submodule_names_its_home() -> None:
    result = migrate_source('import importlib.util\nok = importlib.util.find_spec("apex.amp")\n', "ampinit", "x.py")
    assert '"ampinit.compat.apex.amp"' in result.migrated and result.needs_human == []
    assert importlib.util.find_spec("ampinit.compat.apex.amp") is not None
