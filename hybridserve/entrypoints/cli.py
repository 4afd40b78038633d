"""The ``hybridserve`` command: ``generate``, ``serve``, ``plan``."""

from __future__ import annotations

import argparse
import importlib
import sys

from hybridserve.entrypoints.engine_args import add_engine_args, engine_kwargs

#: subcommand -> module with ``add_parser(subparsers)``; each registers its own arguments and handler
SUBCOMMAND_MODULES = (
    "hybridserve.entrypoints.generate_cmd",
    "hybridserve.entrypoints.serve_cmd",
    "hybridserve.entrypoints.plan_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve",
                                     description="Serve hybrid attention/recurrent language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # subcommand not present in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["main", "build_parser", "add_engine_args", "engine_kwargs"]

if __name__ == "__main__":
    sys.exit(main())
