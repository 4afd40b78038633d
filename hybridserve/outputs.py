"""Result objects (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.cache.prefix_reason import PrefixCacheInfo


@dataclass
class Logprob:
    """The log-probability of one token, its rank among all tokens, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: token id -> Logprob, for one position
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed inside the engine (then finished, reason "error")
    #: its prefix-cache answer: cached tokens and why it hit or not (None before its prompt was admitted)
    prefix_cache: PrefixCacheInfo | None = None
