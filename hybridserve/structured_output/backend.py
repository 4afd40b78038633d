"""The grammar engine, llguidance: its tokenizer view and grammars from :class:`StructuredOutputsParams`
(compiling them is ``compiler.py``'s; see docs/structured_output.md for why llguidance)."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from hybridserve.structured_output.params import StructuredOutputsParams

#: JSON schemas compile to compact JSON (no whitespace between tokens: ``{"a":1,"b":[2,3]}``), so a schema with
#: bounded strings and arrays bounds the output; a schema's own ``"x-guidance"`` options override these
JSON_DEFAULTS = {"whitespace_flexible": False}
_ERROR_CHARS = 400

_lock = threading.Lock()
_tokenizers: dict[tuple[str, int, int | None], Any] = {}


def llguidance_module():
    """The ``llguidance`` module; ImportError saying how to install it when it is missing."""
    try:
        import llguidance
    except ImportError as exc:
        raise ImportError("structured output needs the llguidance package (a core dependency of hybridserve): "
                          "pip install 'llguidance==1.9.1'") from exc
    return llguidance


def short_error(message: str) -> str:
    """An engine error message cut to its first lines (llguidance appends its parser state)."""
    message = message.strip().split("\n<state>", 1)[0].strip()
    return message if len(message) <= _ERROR_CHARS else message[:_ERROR_CHARS] + " ..."


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params``; ValueError naming the field when it cannot be read."""
    llg = llguidance_module()
    kind, text = params.key()
    try:
        if kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llg.grammar_from("choice", text)
        return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except Exception as exc:  # noqa: BLE001 - the engine reports bad grammars with assorted exception types
        raise ValueError(f"structured_outputs.{kind} is not valid: {short_error(str(exc))}") from None


def tokenizer_key(hf_tokenizer: Any) -> str:
    """What identifies a tokenizer's vocabulary: the hash of its tokenizers JSON."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"structured output needs a fast (tokenizers) tokenizer; {type(hf_tokenizer).__name__} "
                         "has none")
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """llguidance's view of ``hf_tokenizer`` with ``vocab_size`` token ids (the model's logits width, which may
    exceed the tokenizer's: ids it lacks are never allowed), cached per process."""
    key = (tokenizer_key(hf_tokenizer), vocab_size, eos_token_id)
    with _lock:
        tok = _tokenizers.get(key)
    if tok is None:
        llg = llguidance_module()
        tok = llg.LLTokenizer(hf_tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)
        with _lock:
            tok = _tokenizers.setdefault(key, tok)
    return tok
