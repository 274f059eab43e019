"""The ``ampinit`` command line (also ``python -m ampinit``).

* ``ampinit run script.py [args...]``: run a script as ``python script.py args...`` would (``sys.argv``,
  ``__main__``, ``sys.path[0]``), with ``import apex`` / ``import amp_C`` resolving to ampinit's Apex aliases;
* ``ampinit migrate PATH... [--write] [--diff] [--to ampinit|torch]``: rewrite Apex code (see docs/migration.md);
  exits 1 when a file was refused (left unchanged), naming each with its reason on stderr;
* ``ampinit demo``: train two small tasks at every opt level and report measured figures (docs/quickstart.md);
* ``ampinit doctor``: what this machine offers for mixed precision and which level to pick.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import json
import math
import os
import pkgutil
import runpy
import sys
import types
import zipfile
from collections.abc import Sequence
from typing import Any

from ampinit._version import __version__
from ampinit.demo.cli import add_demo_parser, positive_seconds

DOCTOR_DESCRIPTION = (
    "Print the torch version, the CPU flags that decide bf16/fp16 speed, devices, autocast dtypes, an fp16 probe of "
    "matmuls and convolutions, whether fused optimizers run here, how fast the opt levels train the demo's small MLP "
    "(timed as `ampinit demo` times it: levels interleaved in blocks, median ms/step), and the level the demo's "
    "verdict picks from that: TENTATIVE on a busy machine, none when the step times were too noisy to compare."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampinit",
        description="Automatic mixed precision for PyTorch with the NVIDIA Apex amp API.",
    )
    parser.add_argument("--version", action="version", version=f"ampinit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a Python script with `import apex` resolving to ampinit's Apex aliases",
        description="Run SCRIPT as `python SCRIPT ARGS...` would, with `import apex` and `import amp_C` "
        "resolving to ampinit.compat.apex.",
    )
    run.add_argument("script", help="the Python script to run (or a directory or zip file with __main__.py)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    migrate = commands.add_parser(
        "migrate",
        help="rewrite Apex amp code to ampinit or to native torch.amp",
        description="Rewrite Apex code. Without --write, nothing is changed on disk: the report says what would be.",
    )
    migrate.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories")
    migrate.add_argument("--write", action="store_true", help="write the rewritten files in place")
    migrate.add_argument("--diff", action="store_true", help="print a unified diff of each change")
    migrate.add_argument(
        "--to",
        choices=("ampinit", "torch"),
        default="ampinit",
        help="ampinit (default): Apex API -> ampinit; torch: O0/O1 single-loss code -> torch.autocast + GradScaler",
    )
    add_demo_parser(commands)
    add_doctor_parser(commands)
    return parser


def _finite_seconds(text: str) -> float:
    """``doctor --budget``: the benchmark runs until the budget is spent, so it must be finite."""
    value = positive_seconds(text)
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` on an ``argparse`` subparsers object (``parser.add_subparsers()``) and set ``func``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="what this machine offers for mixed precision, and which level to use",
        description=DOCTOR_DESCRIPTION,
    )
    parser.add_argument(
        "--budget",
        type=_finite_seconds,
        default=2.0,
        metavar="SECONDS",
        help="time for the training-step benchmark (default 2)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=doctor_command)
    return parser


def doctor_command(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: `ampinit --help` builds this parser and must answer at once.
    from ampinit.doctor import diagnose, format_report

    report = diagnose(budget_s=args.budget)
    text = json.dumps(report.as_dict(), indent=1) if args.json else format_report(report)
    sys.stdout.write(text + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `run` passes everything after the script through untouched, including options such as --help.
    if argv[:1] == ["run"] and len(argv) > 1 and not argv[1].startswith("-"):
        return run_script(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_script(args.script, args.args)
    if args.command == "migrate":
        if importlib.util.find_spec("libcst") is None:
            sys.stderr.write(
                "ampinit migrate: error: it rewrites code with libcst, which is not installed; "
                "install it with: pip install 'ampinit[migrate]' (or pip install libcst)\n"
            )
            return 2
        from ampinit.migrate import migrate_paths

        missing = [path for path in args.paths if not os.path.exists(path)]
        if missing:
            sys.stderr.write(f"ampinit migrate: error: no such file or directory: {missing[0]!r}\n")
            return 2
        try:
            report = migrate_paths(args.paths, to=args.to, write=args.write)
        except OSError as error:
            sys.stderr.write(f"ampinit migrate: error: {error.strerror or error}: {error.filename!r}\n")
            return 1
        if args.diff:
            for result in report.files:
                if result.diff:
                    sys.stdout.write(result.diff)
        sys.stdout.write(report.summary(written=args.write) + "\n")
        # a refused file is left as it was: a script or CI step that migrates must not take that for success
        refused = [result for result in report.files if result.refused]
        for result in refused:
            reason = result.needs_human[0].message if result.needs_human else "no reason recorded"
            sys.stderr.write(f"ampinit migrate: {result.path}: refused, left unchanged: {reason}\n")
        return 1 if refused else 0
    if hasattr(args, "func"):  # demo, doctor
        code: int = args.func(args)
        return code
    # No command: like argparse's own usage errors, print the usage to stderr and exit with status 2.
    parser.print_help(sys.stderr)
    return 2


def run_script(script: str, args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` with the Apex import alias installed; returns its exit status."""
    if not os.path.exists(script):
        sys.stderr.write(f"ampinit run: no such file: {script!r}\n")
        return 2
    # `python DIR` runs DIR/__main__.py (a zip file, likewise its __main__.py; runpy checks that one).
    if os.path.isdir(script) and not any(
        os.path.isfile(os.path.join(script, name)) for name in ("__main__.py", "__main__.pyc")
    ):
        sys.stderr.write(f"ampinit run: can't find '__main__' module in {script!r}\n")
        return 2
    from ampinit.compat import apex

    apex.install()
    _aliases_in_child_processes()
    sys.argv = [script, *args]
    if os.path.isfile(script) and not zipfile.is_zipfile(script):
        path = os.path.abspath(script)
        # `python script.py` puts the script's directory first on sys.path.
        if sys.path:
            sys.path[0] = os.path.dirname(path)
        else:
            sys.path.insert(0, os.path.dirname(path))
        _run_file_as_main(path)
    else:
        if sys.path:
            # `python DIR` (or a zip) puts DIR itself first; runpy.run_path inserts it in front of sys.path.
            del sys.path[0]
        runpy.run_path(script, run_name="__main__")
    # What the script left behind (its globals, and any reference cycle) is released now, while the interpreter is
    # whole: a DistributedDataParallel model still alive at interpreter teardown holds its gloo process group, whose
    # destruction then aborts the process now and then ("terminate called without an active exception", torch's
    # own, reproduced with plain torch: 7 of 42 two-rank runs under load, none of 46 with the model released first).
    gc.collect()
    return 0


def _run_file_as_main(path: str) -> None:
    """Run the file at absolute ``path`` as ``__main__`` as ``python path`` does: ``__file__`` is the absolute path
    (Python 3.9+: a script that changes directory still finds the files beside it), ``sys.argv[0]`` stays as typed
    (``runpy.run_path`` would set it to the path it runs), and ``sys.modules["__main__"]`` is the script's module
    while it runs (pickling and multiprocessing find its functions there)."""
    with io.open_code(path) as file:
        code = pkgutil.read_code(file)  # a .pyc: `python script.pyc` runs it
    if code is None:
        with io.open_code(path) as file:
            code = compile(file.read(), path, "exec", dont_inherit=True)  # not this module's __future__ imports
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    main = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = main


_CHILD_ALIASES = "ampinit.compat.apex._in_children"


def _aliases_in_child_processes() -> None:
    """Install the aliases in the processes the script starts with the "spawn" or "forkserver" start method (macOS'
    and Windows' default, torch.multiprocessing.spawn, Python 3.14's default on Linux): each re-imports the script,
    whose ``import apex`` would otherwise fail there. ``fork`` children inherit them."""
    import multiprocessing.forkserver
    import multiprocessing.spawn

    command_line = multiprocessing.spawn.get_command_line
    if not getattr(command_line, "_ampinit_aliases", False):

        def get_command_line(**kwds: Any) -> list[str]:
            line: list[str] = command_line(**kwds)
            if "-c" in line:  # a frozen executable has no program to prefix
                at = line.index("-c") + 1
                line[at] = f"import {_CHILD_ALIASES}; {line[at]}"
            return line

        get_command_line._ampinit_aliases = True  # type: ignore[attr-defined]
        multiprocessing.spawn.get_command_line = get_command_line
    server = multiprocessing.forkserver._forkserver
    preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if _CHILD_ALIASES not in preload:
        # preloaded in this order: the script (as __mp_main__; its failed `import apex` is ignored there), then the
        # aliases, which every child forked from the server then has when it imports the script itself
        multiprocessing.forkserver.set_forkserver_preload([*preload, _CHILD_ALIASES])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
