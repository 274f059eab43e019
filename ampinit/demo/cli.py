"""The ``demo`` subcommand, for ``ampinit`` (``ampinit/cli.py``) and ``python -m ampinit.demo``.

``add_demo_parser(subparsers)`` registers it on an ``argparse`` subparsers object and sets ``func``:
``args.func(args)`` runs it and returns the exit code. The doctor is ``ampinit doctor`` (``ampinit/cli.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampinit.demo._names import TASKS

if TYPE_CHECKING:
    from ampinit.demo.config import DemoConfig

# torch is imported where a command runs, not here: `ampinit --help` builds these parsers and must answer at once.

DEMO_DESCRIPTION = (
    "Train a checkerboard CNN and an MLP classifier on built-in synthetic data at every opt level, the same steps "
    "for each, the levels interleaved so that other processes slow them alike; print a table per task (dtypes, "
    "final loss, accuracy, ms/step and its spread, speedup vs O0, peak memory, skipped steps, loss scale), warn "
    "loudly when the machine was too busy to trust the timings, end with the level to use here and why, and write "
    "it all as JSON and Markdown, with a PNG of loss against steps and against time (PNG needs matplotlib)."
)


_UNSET: Any = object()  # --time-budget not given: the preset's budget


def _level_list(text: str) -> tuple[str, ...]:
    from ampinit.demo.config import check_levels

    levels = tuple(dict.fromkeys(part.strip().upper() for part in text.replace(" ", ",").split(",") if part.strip()))
    try:
        check_levels(levels)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return levels


def _task_list(text: str) -> tuple[str, ...]:
    tasks = tuple(dict.fromkeys(part.strip() for part in text.replace(" ", ",").split(",") if part.strip()))
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(f"unknown task {(unknown or [text])[0]!r}; allowed: {', '.join(TASKS)}")
    return tasks


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _budget(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    return positive_seconds(text)


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (the demo's and the doctor's budgets)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def configure_demo_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options to ``parser`` and set ``func``."""
    parser.add_argument("--levels", type=_level_list, help="comma-separated opt levels (default: all six, O0 to O5)")
    parser.add_argument(
        "--tasks", type=_task_list, default=TASKS, help=f"comma-separated tasks (default {','.join(TASKS)})"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default cpu)")
    parser.add_argument(
        "--out", type=Path, default=Path("ampinit-demo"), help="output directory (default ./ampinit-demo/)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small tasks, 60 steps per level: about 10 seconds on a quiet 2-core CPU"
    )
    parser.add_argument("--steps", type=_positive_int, help="steps per level, the same for every level (default 300)")
    parser.add_argument(
        "--block", type=_positive_int, help="steps per level per interleaved round (default 10, --quick 5)"
    )
    parser.add_argument(
        "--time-budget",
        type=_budget,
        default=_UNSET,
        metavar="SECONDS",
        help="training time for all runs together, checked between rounds, so that every level stops at the same "
        "step; 'none' for no limit (default 240, --quick 60)",
    )
    parser.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.set_defaults(func=demo_command)
    return parser


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on an ``argparse`` subparsers object (``parser.add_subparsers()``)."""
    parser = subparsers.add_parser(
        "demo", help="train small models at every opt level and compare them", description=DEMO_DESCRIPTION
    )
    return configure_demo_parser(parser)


def demo_config(args: argparse.Namespace) -> DemoConfig:
    """The :class:`DemoConfig` that parsed demo options describe."""
    from ampinit.demo.config import OPT_LEVELS, DemoConfig, quick_config

    settings: dict[str, Any] = {
        "levels": OPT_LEVELS if args.levels is None else args.levels,
        "tasks": args.tasks,
        "device": args.device,
        "out": args.out,
        "seed": args.seed,
        "threads": args.threads,
        "progress": not args.no_progress,
        "plot": not args.no_plot,
    }
    if args.steps is not None:
        settings["steps"] = args.steps
    if args.block is not None:
        settings["block"] = args.block
    if args.time_budget is not _UNSET:
        settings["time_budget_s"] = args.time_budget
    return quick_config(**settings) if args.quick else DemoConfig(**settings)


def demo_command(args: argparse.Namespace) -> int:
    from ampinit.demo.run import run_demo

    try:
        config = demo_config(args)
        run_demo(config)
    except (ValueError, RuntimeError) as error:
        sys.stderr.write(f"ampinit demo: error: {error}\n")
        return 2
    except OSError as error:  # writing the results failed after training
        sys.stderr.write(f"ampinit demo: error: cannot write the results: {error}\n")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ampinit.demo [options]``: the demo."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["doctor"]:
        # The doctor used to answer here too; whoever still types it learns where it went.
        sys.stderr.write(
            "python -m ampinit.demo: error: the doctor is not part of the demo: run `ampinit doctor` "
            "(or `python -m ampinit doctor`), with the same options\n"
        )
        return 2
    parser = configure_demo_parser(argparse.ArgumentParser(prog="python -m ampinit.demo", description=DEMO_DESCRIPTION))
    args = parser.parse_args(arguments)
    result: int = args.func(args)
    return result
