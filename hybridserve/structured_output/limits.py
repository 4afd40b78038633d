"""The bounds on structured-output grammars: the size of a request's constraint, the time to compile it, and the
bytes of compiled grammars kept in the cache (see docs/structured_output.md). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.options import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
    parse_cache_bytes,
)
from hybridserve.options import GRAMMAR_LIMIT_FLAGS as FLAGS

__all__ = ["DEFAULT_GRAMMAR_CACHE_BYTES", "DEFAULT_MAX_GRAMMAR_BYTES", "DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS", "FLAGS",
           "GrammarLimitError", "GrammarLimits", "check_grammar_size", "compile_timeout_error", "parse_cache_bytes"]



class GrammarLimitError(ValueError):
    """A constraint over one of the limits; the message names the field, the limit and its flag."""


@dataclass(frozen=True)
class GrammarLimits:
    """``max_grammar_bytes``: the longest constraint text (the JSON schema, regex, grammar, or the choices as a
    JSON list; UTF-8 bytes). ``max_grammar_compile_seconds``: the longest a request waits for its grammar to
    compile (queueing included). ``grammar_cache_bytes``: the estimated bytes of the compiled grammars kept for
    reuse (0: none kept)."""

    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    max_grammar_compile_seconds: float = DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES

    def __post_init__(self) -> None:
        if (not isinstance(self.max_grammar_bytes, int) or isinstance(self.max_grammar_bytes, bool)
                or self.max_grammar_bytes < 1):
            raise ValueError(f"max_grammar_bytes={self.max_grammar_bytes!r} must be an integer >= 1 "
                             f"({FLAGS['max_grammar_bytes']})")
        seconds = self.max_grammar_compile_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
            raise ValueError(f"max_grammar_compile_seconds={seconds!r} must be a number of seconds in (0, 3600] "
                             f"({FLAGS['max_grammar_compile_seconds']})")
        if (not isinstance(self.grammar_cache_bytes, int) or isinstance(self.grammar_cache_bytes, bool)
                or self.grammar_cache_bytes < 0):
            raise ValueError(f"grammar_cache_bytes={self.grammar_cache_bytes!r} must be a size >= 0 "
                             f"({FLAGS['grammar_cache_bytes']})")


def check_grammar_size(kind: str, text: str, limits: GrammarLimits) -> None:
    """GrammarLimitError if the constraint ``text`` of field ``kind`` is longer than ``max_grammar_bytes``."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise GrammarLimitError(f"structured_outputs.{kind} is {size} bytes, over the limit of "
                                f"{limits.max_grammar_bytes} bytes (max_grammar_bytes, set by "
                                f"{FLAGS['max_grammar_bytes']})")


def compile_timeout_error(kind: str, limits: GrammarLimits) -> GrammarLimitError:
    """The error of a grammar not compiled within ``max_grammar_compile_seconds``."""
    return GrammarLimitError(f"structured_outputs.{kind} did not compile within the limit of "
                             f"{limits.max_grammar_compile_seconds:g} s (max_grammar_compile_seconds, set by "
                             f"{FLAGS['max_grammar_compile_seconds']}); simplify it or raise the limit")
