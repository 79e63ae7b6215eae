"""The ``dpgs`` command line: one sub-command per module of ``dpgs.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys

from dpgs import __version__

COMMANDS = ("train", "eval", "demo_data", "tile", "extract", "heatmap", "compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpgs",
        description="Gradient-stacking trainer for multiple-instance learning on whole-slide images.",
    )
    parser.add_argument("--version", action="version", version=f"dpgs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"dpgs.commands.{name}")
        command = module.add_parser(sub)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
