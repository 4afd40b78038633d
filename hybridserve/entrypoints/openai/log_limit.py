"""A log filter that bounds how many lines of one kind are written per minute.

A flood of connections or bad requests makes the same lines again and again (uvicorn's "Invalid HTTP
request received.", a refused connection, asyncio's "socket.accept() out of system resource"); without
a bound they fill the disk. A line's kind is its logger, its level and the first line of its message
template (so lines that differ only in their arguments are one kind). Each kind may write
``max_lines`` per window; the lines past it are dropped and counted, and the first line of that kind
in a later window carries the count (``[1,234 more like this dropped in the last 60 s]``), and
``report_dropped`` (called when the server stops) logs the counts not reported yet.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

#: kinds tracked at most: past it, lines are keyed by logger and level only (a message built without a
#: template would otherwise make a new kind each time)
MAX_KINDS = 1024
_DECISION = "_hybridserve_log_limit"  # set on a record once judged, so that every handler gives the same answer


class LogRateLimit(logging.Filter):
    """Let through at most ``max_lines`` records of one kind per ``window_s`` seconds (0: all)."""

    def __init__(self, max_lines: int, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.max_lines = max_lines
        self.window_s = window_s
        self.clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [window start, lines let through, lines dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        decision = getattr(record, _DECISION, None)
        if decision is None:
            decision = self._judge(record)
            setattr(record, _DECISION, decision)
        return decision

    def _judge(self, record: logging.LogRecord) -> bool:
        if self.max_lines <= 0:
            return True
        now = self.clock()
        kind = self._kind(record)
        counts = self._kinds.get(kind)
        if counts is None:
            counts = self._kinds[kind] = [now, 0, 0]
        elif now - counts[0] >= self.window_s:
            dropped, elapsed = counts[2], now - counts[0]
            counts[:] = [now, 0, 0]
            if dropped:
                record.msg = (f"{record.msg} [{dropped:,} more like this dropped in the last {elapsed:.0f} s "
                              f"(--max-log-lines-per-minute)]")
        if counts[1] >= self.max_lines:
            counts[2] += 1
            return False
        counts[1] += 1
        return True

    def report_dropped(self) -> None:
        """Log, for each kind with lines dropped and not yet reported, how many (then forget them)."""
        pending = [(kind, counts[2]) for kind, counts in self._kinds.items() if counts[2]]
        for kind, dropped in pending:
            self._kinds[kind][2] = 0
            what = kind[2] if len(kind) > 2 else f"level {logging.getLevelName(kind[1])}"
            logger.warning("%s log lines of %s like %r were dropped (--max-log-lines-per-minute)",
                           f"{dropped:,}", kind[0] or "root", what)

    def _kind(self, record: logging.LogRecord) -> tuple:
        first_line = str(record.msg).split("\n", 1)[0][:200]
        kind = (record.name, record.levelno, first_line)
        if kind not in self._kinds and len(self._kinds) >= MAX_KINDS:
            return (record.name, record.levelno)
        return kind


#: the loggers whose handlers write the server's log (uvicorn's do not propagate to the root)
SERVER_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access")


def install_log_limit(max_lines: int, window_s: float = 60.0) -> LogRateLimit | None:
    """Put one LogRateLimit on every handler of the server's loggers (after uvicorn configured them);
    None when ``max_lines`` is 0 (no limit)."""
    if max_lines <= 0:
        return None
    limit = LogRateLimit(max_lines, window_s)
    for name in SERVER_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(limit)
    return limit
