"""The ``hybridserve`` command: ``generate``, ``serve``, ``plan``, ``env``."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> module with ``add_parser(subparsers)``; each registers its own arguments and handler
SUBCOMMAND_MODULES = (
    "hybridserve.entrypoints.generate_cmd",
    "hybridserve.entrypoints.serve_cmd",
    "hybridserve.entrypoints.plan_cmd",
    "hybridserve.entrypoints.env_cmd",
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


def cap_torch_isa_from_argv(argv: list[str]) -> None:
    """Apply ``--cpu-isa`` to oneDNN and ATen before torch is imported (they read their caps once).
    A bad value is left to the parser, which names the allowed ones."""
    from hybridserve.kernels import isa

    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--cpu-isa=") else (
            argv[i + 1] if arg == "--cpu-isa" and i + 1 < len(argv) else None)
        if value in isa.CPU_ISA_CHOICES:
            isa.cap_torch(value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cap_torch_isa_from_argv(argv)
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


__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    sys.exit(main())
