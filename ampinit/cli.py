"""The ``ampinit`` command line (also ``python -m ampinit``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ampinit._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampinit",
        description="Automatic mixed precision for PyTorch with the NVIDIA Apex amp API.",
    )
    parser.add_argument("--version", action="version", version=f"ampinit {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stdout)
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
