"""The ``hybridserve`` command: ``generate``, ``serve``, ``plan``, ``env``, ``drift``, and ``--version``."""

from __future__ import annotations

import argparse
import importlib
import sys

from hybridserve.entrypoints.engine_args import HelpFormatter

#: subcommand -> module with ``add_parser(subparsers)``; each registers its own arguments and handler
SUBCOMMANDS = {
    "generate": "hybridserve.entrypoints.generate_cmd",
    "serve": "hybridserve.entrypoints.serve_cmd",
    "plan": "hybridserve.entrypoints.plan_cmd",
    "env": "hybridserve.entrypoints.env_cmd",
    "drift": "hybridserve.entrypoints.drift_cmd",
}
SUBCOMMAND_MODULES = tuple(SUBCOMMANDS.values())


def package_version() -> str:
    """The installed hybridserve's version (its distribution metadata), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridserve")
    except PackageNotFoundError:
        from hybridserve import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``: the installed version, looked up only when asked (importlib.metadata takes a while)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"hybridserve {package_version()}")
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one (so a command imports no other's modules)."""
    parser = argparse.ArgumentParser(prog="hybridserve", formatter_class=HelpFormatter,
                                     description="Serve hybrid attention/recurrent language models.")
    parser.add_argument("--version", action=_Version, help="print hybridserve's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, name in SUBCOMMANDS.items():
        if only is not None and command != only:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # subcommand not present in this build
            raise
        module.add_parser(sub)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first argument, when that is one), else None."""
    return argv[0] if argv and argv[0] in SUBCOMMANDS else None


def cap_torch_isa_from_argv(argv: list[str]) -> None:
    """Apply ``--cpu-isa`` to oneDNN and ATen before torch is imported (they read their caps once).
    A bad value is left to the parser, which names the allowed ones."""
    from hybridserve.kernels import isa

    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--cpu-isa=") else (
            argv[i + 1] if arg == "--cpu-isa" and i + 1 < len(argv) else None)
        if value in isa.CPU_ISA_CHOICES:
            isa.cap_torch(value)


#: the commands that run an engine (and have --cpu-wait-policy)
ENGINE_COMMANDS = ("generate", "serve", "env", "drift")


def apply_cpu_wait_policy_from_argv(argv: list[str]) -> None:
    """Set ``--cpu-wait-policy`` (``auto`` when not given) in the environment for the OpenMP runtime to read
    when torch loads: before the parser is built (a subcommand's modules may import torch). A bad value is
    left to the parser, which names the allowed ones; in a process that has torch loaded already nothing
    changes (the engine logs why)."""
    from hybridserve.kernels import threads

    if command_of(argv) not in ENGINE_COMMANDS:
        return
    policy = "auto"
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) >= len("--cpu-w") and "--cpu-wait-policy".startswith(name):  # argparse takes a unique prefix
            policy = value if eq else (argv[i + 1] if i + 1 < len(argv) else policy)
    if policy.lower() in threads.WAIT_POLICIES:
        threads.apply_wait_policy(policy)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cap_torch_isa_from_argv(argv)
    apply_cpu_wait_policy_from_argv(argv)
    parser = build_parser(only=command_of(argv))
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
