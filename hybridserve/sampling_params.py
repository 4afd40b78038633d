"""Per-request sampling options (vLLM's names and defaults)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from hybridserve.cache.salt import check_cache_salt
from hybridserve.structured_output.params import StructuredOutputsParams

#: temperatures below this sample greedily (dividing logits by a smaller one overflows float32)
GREEDY_TEMPERATURE_EPS = 1e-5
#: the seeds a torch generator takes: child ``i`` of an ``n > 1`` request uses ``seed + i``, so
#: ``seed + n - 1`` must be in range too
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
#: the largest temperature: past float32's range a temperature is infinite, and a masked (-inf) logit divided by
#: it is NaN; far below that, every logit is already ~0 (uniform sampling)
MAX_TEMPERATURE = 100.0
#: ``repetition_penalty`` bounds: a penalty that float32 rounds to 0 or to inf turns logits into inf or NaN
REPETITION_PENALTY_RANGE = (0.01, 100.0)
#: the fields a checkpoint's generation_config.json may give defaults for (hybridserve/generation_config.py):
#: a request that leaves one unset gets the model's default, one that sets it keeps its own value
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_TEMPERATURE_EPS`` (1e-5); at most
    ``MAX_TEMPERATURE`` (100).
    ``logprobs=k`` returns the top-k logprobs (plus the sampled token)
    for each generated token; ``prompt_logprobs=k`` the same for each prompt token after the first.
    ``max_tokens=0`` only runs the prompt (for its ``prompt_logprobs``): no token is generated and each
    completion ends empty with finish reason "length".
    ``detokenize=False`` returns token ids only (no text, no decoded logprob tokens; no ``stop`` strings).
    ``repetition_penalty`` (HF's, in [0.01, 100]: > 1 discourages every token already in the prompt or the output),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2]: subtracted once per token present in
    the output / per occurrence) and ``logit_bias`` ({token id: bias in [-100, 100]}, added to the logits) change
    which token is drawn; reported logprobs stay those of the model's own distribution.
    ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or a grammar
    (:class:`StructuredOutputsParams`; see docs/structured_output.md).
    ``cache_salt`` (vLLM's): the prefix-cache tenant of the request; requests with different salts never share
    cached pages or state snapshots, and unsalted ones share only with each other (:mod:`hybridserve.cache.salt`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar
    cache_salt: str | None = None  # the prefix-cache tenant: None shares with every unsalted request
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)
    _adjusts_logits: bool = field(default=False, init=False, repr=False)
    _set_fields: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MODEL_DEFAULT_FIELDS and "_set_fields" in self.__dict__:  # assigned after construction
            object.__setattr__(self, "_set_fields", self._set_fields | {name})
        object.__setattr__(self, name, value)

    def is_set(self, name: str) -> bool:
        """Whether ``name`` (one of ``MODEL_DEFAULT_FIELDS``) was given a value, at construction or since; an
        unset one takes the model's default."""
        return name in self._set_fields

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A validated copy with ``defaults`` in those of its fields that are unset (they stay unset: the copy
        reports them as defaults, not as the caller's values)."""
        params = copy.copy(self)
        for name, value in defaults.items():
            if name not in MODEL_DEFAULT_FIELDS:
                raise ValueError(f"{name!r} cannot take a model default; allowed: {', '.join(MODEL_DEFAULT_FIELDS)}")
            if not self.is_set(name):
                object.__setattr__(params, name, value)
        params.validate()
        return params

    def validate(self) -> None:
        """Check every field (again: the engine calls this, as params may be changed after they are made);
        raises ValueError naming the first bad field and its rule."""
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is not valid: {rule}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise bad("seed", "must be an integer or None")
            if not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
                rule = f"must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}]"
                raise bad("seed", rule + (f" (with n={self.n}, completion i samples with seed + i)"
                                          if self.n > 1 else ""))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", "must be an integer >= 0 (0: prefill only, no token generated) or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0 or value > 20):
                raise bad(name, "must be an integer between 0 and 20, or None")
        if isinstance(self.stop, str) and self.stop:
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop):
            self._stop_list = list(self.stop)
        else:
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not (
                isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0
                                                                      for t in self.stop_token_ids)):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be True or False")
        if not self.detokenize and self._stop_list:
            raise ValueError(f"stop={self.stop!r} needs detokenize=True: stop strings are matched on the text")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be a number in [{low:g}, {high:g}] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "must be a number in [-2, 2] (0 disables it)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict {token id: bias} or None")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias={self.logit_bias!r:.200} is not valid: key {token!r} must be a "
                                     "non-negative integer token id")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias={self.logit_bias!r:.200} is not valid: the bias of token {token} "
                                     f"is {bias!r}; it must be a number in [-100, 100]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
            self.structured_outputs.validate()
        check_cache_salt(self.cache_salt)
        if self.top_k == -1:
            self.top_k = 0
        self._adjusts_logits = (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                                or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything in these params may change the distribution tokens are drawn from."""
        return self._adjusts_logits

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list


_POSITIONAL = tuple(f.name for f in fields(SamplingParams) if f.init)
_dataclass_init = SamplingParams.__init__


def _init_recording_set_fields(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    """The dataclass constructor, then the record of which model-defaultable fields the caller passed."""
    _dataclass_init(self, *args, **kwargs)
    passed = set(_POSITIONAL[:len(args)]) | set(kwargs)
    object.__setattr__(self, "_set_fields", frozenset(passed & set(MODEL_DEFAULT_FIELDS)))


SamplingParams.__init__ = _init_recording_set_fields  # type: ignore[method-assign]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
