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
import json
import math
import os
import runpy
import sys
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
    sys.argv = [script, *args]
    if os.path.isfile(script) and not zipfile.is_zipfile(script):
        # `python script.py` puts the script's directory first on sys.path.
        script_dir = os.path.dirname(os.path.abspath(script))
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.insert(0, script_dir)
    elif sys.path:
        # `python DIR` (or a zip) puts DIR itself first; runpy.run_path inserts it in front of sys.path.
        del sys.path[0]
    runpy.run_path(script, run_name="__main__")
    # What the script left behind (its globals, and any reference cycle) is released now, while the interpreter is
    # whole: a DistributedDataParallel model still alive at interpreter teardown holds its gloo process group, whose
    # destruction then aborts the process now and then ("terminate called without an active exception", torch's
    # own, reproduced with plain torch: 7 of 42 two-rank runs under load, none of 46 with the model released first).
    gc.collect()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
