"""The ``hybridserve`` command itself: ``--version``, defaults in every ``--help``, ``--served-model-name``."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from hybridserve.entrypoints.cli import SUBCOMMANDS, build_parser, main


def _help(monkeypatch, command: str) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # one flag's help on one line where it fits
    sub = next(a for a in build_parser(only=command)._actions if a.dest == "command")
    return sub.choices[command].format_help()


def _flag_help(text: str, flag: str) -> str:
    """The help text of ``flag`` (its line and the indented ones after it)."""
    match = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match is not None, f"{flag} not in the help"
    return " ".join(match.group(0).split())


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hybridserve {version('hybridserve')}"


@pytest.mark.parametrize("command, flag, default", [
    ("serve", "--port", "8000"), ("serve", "--cache-memory", "1GiB"), ("serve", "--max-num-seqs", "64"),
    ("serve", "--max-num-batched-tokens", "2048"), ("serve", "--block-size", "16"), ("serve", "--host", "127.0.0.1"),
    ("serve", "--enable-prefix-caching", "True"), ("serve", "--log-level", "info"),
    ("serve", "--max-request-body-size", "2MiB"), ("serve", "--shutdown-timeout", "30.0"),
    ("generate", "--cache-memory", "512MiB"), ("generate", "--max-tokens", "the model's max_new_tokens, else 64"),
    ("generate", "--top-p", "the model's, else 1"), ("generate", "--generation-config", "auto"),
    ("generate", "--seed", "0"), ("generate", "--dtype", "auto"),
    ("plan", "--cache-memory", "1GiB"), ("plan", "--block-size", "16"), ("plan", "--device", "auto"),
    ("env", "--cache-memory", "64MiB"), ("env", "--max-num-seqs", "64"),
])
def test_help_shows_defaults(monkeypatch, command, flag, default):
    assert f"(default: {default})" in _flag_help(_help(monkeypatch, command), flag)


def test_every_subcommand_uses_the_defaults_formatter():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(SUBCOMMANDS)
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "(default: " in text, name
        assert "(default: None)" not in text and "(default: False)" not in text, name


def test_one_command_builds_only_its_own_parser():
    sub = next(a for a in build_parser(only="plan")._actions if a.dest == "command")
    assert list(sub.choices) == ["plan"]


def test_served_model_names():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "a"])
    assert args.served_model_names == ["a", "b"] and args.served_model_name == "a"
    args = build_parser().parse_args(["serve"])
    assert args.served_model_name is None and getattr(args, "served_model_names", None) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--served-model-name", " "])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--served-model-name"])


def test_generate_penalty_flags_reach_the_sampler(capsys):
    prompt = "Once upon a time"
    assert main(["generate", prompt, "--max-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", prompt, "--max-tokens", "24", "--repetition-penalty", "1.3"]) == 0
    penalized = capsys.readouterr().out
    assert plain.startswith(prompt) and penalized.startswith(prompt) and plain != penalized
    assert main(["generate", prompt, "--presence-penalty", "5"]) == 2
    assert "presence_penalty=5.0 is not valid" in capsys.readouterr().err
