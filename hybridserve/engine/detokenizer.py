"""Tokenizer access: encode prompts, decode outputs; works (token ids only) without a tokenizer."""

from __future__ import annotations

import os
from typing import Any

from hybridserve.outputs import PositionLogprobs

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class IncrementalDecoder:
    """One sequence's output text, decoded as its tokens arrive: :meth:`add` returns what the new tokens
    add to the text (nothing while a character is incomplete), so the deltas always join into a prefix of
    the whole output decoded at once, and equal it once the last character is complete."""

    def add(self, token_ids: list[int]) -> str:
        """The text added by ``token_ids`` past the ones already seen (the whole output so far)."""
        raise NotImplementedError


class _WindowDecoder(IncrementalDecoder):
    """Decodes a short window before and after the new tokens with the tokenizer's own ``decode``."""

    def __init__(self, detokenizer: "Detokenizer", skip_special_tokens: bool) -> None:
        self.detokenizer, self.skip = detokenizer, skip_special_tokens
        self.prefix = self.read = 0

    def add(self, token_ids: list[int]) -> str:
        delta, self.prefix, self.read = self.detokenizer.decode_increment(token_ids, self.prefix, self.read,
                                                                          self.skip)
        return delta


class _StreamDecoder(IncrementalDecoder):
    """The tokenizers library's ``DecodeStream``: one step per token in Rust, no Python decode calls."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.seen = 0

    def add(self, token_ids: list[int]) -> str:
        parts = [self.stream.step(self.backend, t) for t in token_ids[self.seen:]]
        self.seen = len(token_ids)
        return "".join(p for p in parts if p)


class Detokenizer:
    """Thin wrapper over a transformers tokenizer, or none."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "Detokenizer":
        """Load the tokenizer in ``path`` if it has tokenizer files (or is a GGUF checkpoint with a vocabulary:
        ``models/gguf/tokenizer.py``), else an id-only detokenizer."""
        from hybridserve.models.gguf.reader import gguf_file

        file = gguf_file(path)
        if file is not None:
            from hybridserve.models.gguf.tokenizer import gguf_tokenizer

            return cls(gguf_tokenizer(file))
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

    def incremental(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A new sequence's incremental decoder: the tokenizers library's streaming decoder where its text is
        the tokenizer's own (a Rust backend that does not clean up spaces after decoding), else a window of
        :meth:`decode_increment` calls."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (backend is not None and _has_decode_stream()
                and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False)):
            return _StreamDecoder(backend, skip_special_tokens)
        return _WindowDecoder(self, skip_special_tokens)

    def annotate(self, entry: PositionLogprobs) -> PositionLogprobs:
        """Fill ``decoded_token`` of each Logprob in a position's entry."""
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
        return entry

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **template_kwargs) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template (or ``chat_template``)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        return list(self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False, **template_kwargs))


def _has_decode_stream() -> bool:
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return False
    return True
