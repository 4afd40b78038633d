"""Per-request sampling options (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: temperatures below this sample greedily (dividing logits by a smaller one overflows float32)
GREEDY_TEMPERATURE_EPS = 1e-5
#: the seeds a torch generator takes: child ``i`` of an ``n > 1`` request uses ``seed + i``, so
#: ``seed + n - 1`` must be in range too
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_TEMPERATURE_EPS`` (1e-5).
    ``logprobs=k`` returns the top-k logprobs (plus the sampled token)
    for each generated token; ``prompt_logprobs=k`` the same for each prompt token after the first.
    ``detokenize=False`` returns token ids only (no text, no decoded logprob tokens; no ``stop`` strings).
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
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the engine calls this, as params may be changed after they are made);
        raises ValueError naming the first bad field and its rule."""
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is not valid: {rule}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
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
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
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
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
