"""Bounds on the work one HTTP request may ask for, each a ``serve`` flag (no server dependencies here).

Every limit's error is a 4xx whose message names the limit, its value and the flag that sets it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from hybridserve.options import parse_size


@dataclass(frozen=True)
class ServerLimits:
    """The per-request limits of the server (defaults: what ``hybridserve serve`` uses)."""

    max_body_bytes: int = 2 * 2 ** 20  # request body, in bytes (413 past it, before it is parsed)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_n: int = 128  # completions per prompt
    max_completions: int = 256  # n x prompts
    max_stop_strings: int = 16  # entries of `stop`
    max_stop_chars: int = 256  # characters of each stop string
    max_stop_token_ids: int = 256  # entries of `stop_token_ids`
    max_messages: int = 1024  # chat messages (and text parts of their contents, together)
    max_response_entries: int = 1_000_000  # tokens a response may return, each counted with its top logprobs

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{FLAGS[f.name]}={value!r} must be a positive integer")

    def exceeded(self, name: str, subject: str) -> str:
        """The message of a request over limit ``name``: ``subject`` says what it sent."""
        limit = getattr(self, name)
        return f"{subject}: more than this server's limit of {limit:,} {UNITS[name]} (set by {FLAGS[name]})"


#: field -> (flag, unit in messages, help)
_SPECS = {
    "max_body_bytes": ("--max-request-body-size", "bytes",
                       "largest request body (bytes, or a size such as 512KiB); a larger one gets 413 before it is "
                       "parsed"),
    "max_prompts": ("--max-prompts-per-request", "prompts per request",
                    "most prompts in one /v1/completions request"),
    "max_n": ("--max-n", "completions per prompt (n)", "largest n (completions per prompt)"),
    "max_completions": ("--max-completions-per-request", "completions per request (n x prompts)",
                        "most completions one request may ask for: n times the number of prompts"),
    "max_stop_strings": ("--max-stop-strings", "stop strings", "most entries of a request's stop list"),
    "max_stop_chars": ("--max-stop-string-length", "characters per stop string",
                       "longest stop string, in characters"),
    "max_stop_token_ids": ("--max-stop-token-ids", "stop token ids", "most entries of a request's stop_token_ids"),
    "max_messages": ("--max-chat-messages", "chat messages (or text parts)",
                     "most messages in a chat request (also bounds their text parts, all messages together)"),
    "max_response_entries": ("--max-response-entries", "response entries (returned tokens, each counted with its "
                             "top logprobs)",
                             "most entries one response may hold: n x (echoed prompt tokens + max_tokens) x "
                             "(1 + logprobs), summed over the prompts; checked before the request is queued"),
}
FLAGS = {name: spec[0] for name, spec in _SPECS.items()}
UNITS = {name: spec[1] for name, spec in _SPECS.items()}


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size: use bytes or a size such as 512KiB") from None


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per limit, with its default in the help."""
    defaults = ServerLimits()
    group = parser.add_argument_group("per-request limits")
    for name, (flag, _, help_text) in _SPECS.items():
        default = getattr(defaults, name)
        shown = f"{default // 2 ** 20}MiB" if name == "max_body_bytes" else str(default)
        group.add_argument(flag, dest=f"limit_{name}", type=_size if name == "max_body_bytes" else int,
                           default=default, metavar="SIZE" if name == "max_body_bytes" else "N",
                           help=f"{help_text} (default: {shown})")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{name: getattr(args, f"limit_{name}") for name in _SPECS})
