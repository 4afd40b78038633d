"""The HTTP edge's bounds on connections, each a ``serve`` flag (no server dependencies here).

How long a client may take to send its request head and its body, how long an idle kept-alive
connection stays open, how many connections the server holds at once, and how many log lines of one
kind it writes per minute. The protocol that enforces them is :mod:`http_edge`; the log filter is
:mod:`log_limit`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

#: file descriptors kept free beyond the connection limit: the refusals (a quick 503 needs an accepted
#: socket), the engine's and the log's files, so that the server never runs out and stops answering
FD_RESERVE = 64
#: the connection limit when --max-connections is not given, if the file descriptor limit allows it
DEFAULT_MAX_CONNECTIONS = 1024


@dataclass(frozen=True)
class EdgeLimits:
    """The HTTP edge's bounds (defaults: what ``hybridserve serve`` uses, except ``max_connections``,
    which ``edge_limits_from_args`` derives from the file descriptor limit)."""

    header_timeout: float = 10.0  # seconds from a request's first byte (a new connection: its opening) to its full head
    body_timeout: float = 60.0  # seconds from a request's head to the end of its body
    keep_alive_timeout: float = 5.0  # seconds an idle kept-alive connection stays open
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # connections held at once; past it, 503 and close
    max_log_lines_per_minute: int = 600  # log lines of one kind per minute, then a count of those dropped (0: all)

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{FLAGS[name]}={value!r} must be a positive number of seconds")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"--max-connections={self.max_connections!r} must be a positive integer")
        if isinstance(self.max_log_lines_per_minute, bool) or not isinstance(self.max_log_lines_per_minute, int) \
                or self.max_log_lines_per_minute < 0:
            raise ValueError(f"--max-log-lines-per-minute={self.max_log_lines_per_minute!r} must be an integer "
                             ">= 0 (0: no limit)")


FLAGS = {"header_timeout": "--header-timeout", "body_timeout": "--body-timeout",
         "keep_alive_timeout": "--keep-alive-timeout", "max_connections": "--max-connections",
         "max_log_lines_per_minute": "--max-log-lines-per-minute"}


def add_edge_args(parser: argparse.ArgumentParser) -> None:
    """The edge's flags, with their defaults in the help."""
    d = EdgeLimits()
    group = parser.add_argument_group("connection limits (the HTTP edge)")
    group.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="S",
                       help="seconds a client has to send a request's line and headers, from the request's first "
                            "byte (a new connection: from its opening); then 408 and close "
                            f"(default: {d.header_timeout:g})")
    group.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="S",
                       help="seconds a client has to send a request's whole body, from the end of its headers; "
                            f"then 408 and close (default: {d.body_timeout:g})")
    group.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout, metavar="S",
                       help="seconds an idle kept-alive connection stays open between requests "
                            f"(default: {d.keep_alive_timeout:g})")
    group.add_argument("--max-connections", type=int, default=None, metavar="N",
                       help="open connections held at once; past it a new connection gets 503 and is closed "
                            f"(default: {DEFAULT_MAX_CONNECTIONS}, or fewer if the file descriptor limit (ulimit -n) "
                            f"leaves less room: it always keeps {FD_RESERVE} descriptors free)")
    group.add_argument("--max-log-lines-per-minute", type=int, default=d.max_log_lines_per_minute, metavar="N",
                       help="log lines of one kind (same logger, level and message) written per minute; past it "
                            "they are counted, and the count is logged when the minute ends (0: no limit; "
                            f"default: {d.max_log_lines_per_minute})")


def free_descriptors() -> tuple[int, int] | None:
    """(this process's soft file descriptor limit, descriptors open now), or None where unknown."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return soft, in_use


def connection_room(descriptors: tuple[int, int] | None) -> int | None:
    """How many connections the descriptors allow: the limit less those open and FD_RESERVE (None: no bound)."""
    if descriptors is None:
        return None
    soft, in_use = descriptors
    return soft - in_use - FD_RESERVE


def check_max_connections(requested: int | None, descriptors: tuple[int, int] | None) -> int:
    """The connection limit: ``requested`` (--max-connections) if the descriptors allow it, else
    ValueError; by default DEFAULT_MAX_CONNECTIONS or the room the descriptors leave, if less."""
    room = connection_room(descriptors)
    if room is not None and room < 1:
        assert descriptors is not None  # (a room is only computed from them)
        soft, in_use = descriptors
        raise ValueError(f"the file descriptor limit (ulimit -n {soft}) leaves no room for connections: {in_use} are "
                         f"open and {FD_RESERVE} are kept free; raise ulimit -n")
    if requested is None:
        return DEFAULT_MAX_CONNECTIONS if room is None else min(DEFAULT_MAX_CONNECTIONS, room)
    if requested < 1:
        raise ValueError(f"--max-connections={requested} must be >= 1")
    if room is not None and requested > room:
        assert descriptors is not None  # (a room is only computed from them)
        soft, in_use = descriptors
        raise ValueError(f"--max-connections={requested} needs more file descriptors than this process may open "
                         f"(ulimit -n {soft}, {in_use} open, {FD_RESERVE} kept free): at most {room}; raise ulimit -n "
                         "or lower --max-connections")
    return requested


def edge_limits_from_args(args: argparse.Namespace) -> EdgeLimits:
    """The flags' values, checked (ValueError naming the flag)."""
    return EdgeLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      keep_alive_timeout=args.keep_alive_timeout,
                      max_connections=check_max_connections(args.max_connections, free_descriptors()),
                      max_log_lines_per_minute=args.max_log_lines_per_minute)
