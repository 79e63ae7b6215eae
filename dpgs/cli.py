"""The ``dpgs`` command line: one sub-command per module of ``dpgs.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys

from dpgs import __version__

COMMANDS = ("train", "eval", "demo_data", "tile", "extract", "heatmap", "compare")


def is_override(arg: str) -> bool:
    """Whether a command-line word is a ``KEY=VALUE`` config override (and not an option)."""
    return "=" in arg and not arg.startswith("-")


class CommandParser(argparse.ArgumentParser):
    """The parser of one sub-command. :meth:`add_overrides` declares a ``KEY=VALUE ...`` positional that,
    unlike a plain argparse positional, may be split by options (``train.epochs=2 --tracking-uri X
    train.lr=1e-3``); the overrides keep their command-line order."""

    overrides_dest: str | None = None

    def add_overrides(self, dest: str, help: str) -> None:
        self.add_argument(dest, nargs="*", metavar="KEY=VALUE", help=help)
        self.overrides_dest = dest

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self.overrides_dest is not None:
            # argparse fills a positional from one run of words only; later runs come back as extras
            later = [arg for arg in extras if is_override(arg)]
            setattr(namespace, self.overrides_dest, [*getattr(namespace, self.overrides_dest), *later])
            extras = [arg for arg in extras if not is_override(arg)]
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpgs",
        description="Gradient-stacking trainer for multiple-instance learning on whole-slide images.",
    )
    parser.add_argument("--version", action="version", version=f"dpgs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
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
