"""The tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata), built by transformers' GGUF support, with
the file's chat template (``tokenizer.chat_template``)."""

from __future__ import annotations

import os
from typing import Any


def gguf_tokenizer(file: str) -> Any | None:
    """A fast tokenizer from the file's metadata; None when the file has no vocabulary. A vocabulary transformers
    cannot rebuild is a ValueError naming the file."""
    from hybridserve.models.gguf import reader

    values = reader.metadata(reader.open_gguf(file))
    if "tokenizer.ggml.tokens" not in values:
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(file)),
                                                            gguf_file=os.path.basename(file))
    except Exception as exc:  # transformers raises assorted types for vocabularies it cannot convert
        message = " ".join(str(exc).split())
        raise ValueError(f"{file}: its tokenizer could not be built ({type(exc).__name__}: {message})") from None
    template = values.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer
