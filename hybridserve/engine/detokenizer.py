"""Tokenizer access: encode prompts, decode outputs; works (token ids only) without a tokenizer."""

from __future__ import annotations

import os
from typing import Any

from hybridserve.outputs import PositionLogprobs

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Detokenizer:
    """Thin wrapper over a transformers tokenizer, or none."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "Detokenizer":
        """Load the tokenizer in ``path`` if it has tokenizer files, else an id-only detokenizer."""
        if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            return cls(None)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass prompts as {'prompt_token_ids': [...]}")
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_increment(self, token_ids: list[int], prefix: int, read: int, skip_special_tokens: bool = True
                         ) -> tuple[str, int, int]:
        """The text the tokens after ``read`` add to ``decode(token_ids[:read])``: ``(delta, prefix, read)``
        with the offsets to pass next time. Decodes only the short window from ``prefix`` (the tokens
        just before ``read``, which give the new ones their context: a leading space, a multi-token
        character), so a step costs the same at any length; a token that ends inside a multi-byte
        character adds nothing until the character is complete."""
        if self.tokenizer is None:
            return "", prefix, read
        before = self.tokenizer.decode(token_ids[prefix:read], skip_special_tokens=skip_special_tokens)
        after = self.tokenizer.decode(token_ids[prefix:], skip_special_tokens=skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            return after[len(before):], read, len(token_ids)
        return "", prefix, read

    def annotate(self, entry: PositionLogprobs) -> PositionLogprobs:
        """Fill ``decoded_token`` of each Logprob in a position's entry."""
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
        return entry

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
