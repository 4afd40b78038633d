"""``speculative_config``: which drafter proposes tokens, how many, and when speculation backs off.

Accepted forms (vLLM's keys): a dict, a JSON string (``--speculative-config``), or None (off)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"model": "path/to/small-checkpoint", "num_speculative_tokens": 4}     # method "draft_model"
    {"method": "mtp", "num_speculative_tokens": 2}                          # the checkpoint's MTP layers
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
#: drafts of one verification, plus its pending token, fit in one KV page (a captured step's most per sequence)
MAX_SPECULATIVE_TOKENS = 15
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 5, "draft_model": 4, "mtp": 2}
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "acceptance_floor", "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration.

    ``disable_by_batch_size``: no sequence speculates in a step with more running sequences than this (a
    large batch is compute-bound: verifying drafts there costs more than it saves); None (``"auto"``): the
    engine times its captured steps at start and picks it (``spec_decode/batch_limit.py``). ``acceptance_floor``:
    a sequence whose recent drafts were accepted at a lower rate stops drafting for a while (docs/spec_decode.md).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    acceptance_floor: float = 0.2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def max_batch_size(self) -> int:
        """The most running sequences a drafting step may have: the configured limit, or the largest the
        automatic one may pick (the captured verification steps go that far)."""
        return self.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE


def _positive_int(name: str, value: Any, upper: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (upper is not None and value > upper):
        bound = f" and at most {upper}" if upper is not None else ""
        raise ValueError(f"speculative_config {name}={value!r} must be an integer of at least 1{bound}")
    return value


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A :class:`SpeculativeConfig` from a dict, a JSON object string, an existing config, or None (off);
    ValueError naming the bad key or value and the allowed ones."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc.msg} at {exc.pos}): {value!r:.100}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {', '.join(_KEYS)}")
    method = value.get("method")
    model = value.get("model")
    if method is None:
        method = "draft_model" if model is not None else None
    if method not in METHODS:
        raise ValueError(f"speculative_config method={method!r} is not supported; allowed: {', '.join(METHODS)} "
                         "(or give 'model' for a draft model)")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': a checkpoint directory")
    elif model is not None:
        raise ValueError(f"speculative_config 'model' is only for a draft model, not method {method!r}")
    tp = value.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"speculative_config draft_tensor_parallel_size={tp!r}: only 1 is supported")
    k = _positive_int("num_speculative_tokens",
                      value.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[method]),
                      MAX_SPECULATIVE_TOKENS)
    lookup_max = _positive_int("prompt_lookup_max", value.get("prompt_lookup_max", 4))
    lookup_min = _positive_int("prompt_lookup_min", value.get("prompt_lookup_min", min(2, lookup_max)))
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
    if method != "ngram" and ("prompt_lookup_max" in value or "prompt_lookup_min" in value):
        raise ValueError(f"speculative_config prompt_lookup_max/min are for method 'ngram', not {method!r}")
    batch = value.get("disable_by_batch_size", "auto")
    batch = None if batch in ("auto", None) else _positive_int("disable_by_batch_size", batch)
    floor = value.get("acceptance_floor", 0.2)
    if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not 0.0 <= floor < 1.0:
        raise ValueError(f"speculative_config acceptance_floor={floor!r} must be a number in [0, 1)")
    return SpeculativeConfig(method, k, model, lookup_max, lookup_min, batch, float(floor))
