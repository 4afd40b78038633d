"""The server's tokenizer, in one thread of its own.

A HF tokenizer must not be used from several threads, and tokenizing or templating a long input on
the event loop would stall every stream and ``/health``. So a single-thread executor owns the
tokenizer (it is loaded there too); the event loop only hands it work and awaits the result.

Before any text is tokenized its length is checked: no token of the vocabulary stands for more than
``max_token_chars`` characters (the longest token's length), so a text of more than
``max_model_len x max_token_chars`` characters cannot fit and is refused at once (400).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from hybridserve.engine.detokenizer import Detokenizer
from hybridserve.entrypoints.openai.errors import APIError


class TokenizerWorker:
    """Encodes prompts and renders chats off the event loop; refuses texts too long to fit first."""

    def __init__(self, path: str, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridserve-tokenizer")
        self._tokenizer: Any = None  # touched only in the executor's thread
        self.vocab_size = 0  # token ids 0 .. vocab_size - 1 (added tokens included), set by _load
        self.chat_template_takes_tools = False  # the chat template reads a ``tools`` variable, set by _load
        self.added_tokens: dict[str, int] = {}  # the added tokens' texts and ids (tags of tool calls, reasoning)
        self.special_texts: set[str] = set()  # the texts of the special tokens (which decoding may skip)
        self.has_tokenizer, self.has_chat_template, self.max_token_chars = (
            self._executor.submit(self._load, path).result())

    @property
    def max_chars(self) -> int:
        """The most characters a text can have and still fit in ``max_model_len`` tokens."""
        return self.max_model_len * self.max_token_chars

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def encode_prompts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of each prompt (with the tokenizer's special tokens, as offline, unless told not to)."""
        if not self.has_tokenizer:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids", param="prompt")
        for i, text in enumerate(texts):
            self._check_length(text, f"prompt {i}" if len(texts) > 1 else "the prompt", "prompt")
        return await self._run(self._encode_all, texts, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False) -> list[int]:
        """The token ids of the chat template applied to ``messages`` (with the generation prompt unless told
        not to; the template writes the special tokens, so none are added unless asked)."""
        ids, _ = await self._run(self._encode_chat, messages, add_generation_prompt, add_special_tokens)
        return ids

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """The token ids and the text of the chat template applied to ``messages`` with the generation prompt,
        ``tools`` (OpenAI's tool definitions) passed to the template when given, and ``template_kwargs`` (further
        template variables)."""
        return await self._run(self._encode_chat, messages, True, False, tools, template_kwargs)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens kept); a 400 naming the first id outside the vocabulary."""
        self._check_ids(token_ids)
        return await self._run(lambda: self._tokenizer.decode(token_ids, skip_special_tokens=False))

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token id's string in the vocabulary (``convert_ids_to_tokens``)."""
        self._check_ids(token_ids)
        return await self._run(lambda: [str(t) for t in self._tokenizer.convert_ids_to_tokens(token_ids)])

    # ------------------------------------------------------- executor thread
    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _load(self, path: str) -> tuple[bool, bool, int]:
        tokenizer = Detokenizer.from_path(path).tokenizer
        self._tokenizer = tokenizer
        if tokenizer is None:
            return False, False, 0
        self.vocab_size = len(tokenizer)
        self.added_tokens = {text: int(i) for text, i in tokenizer.get_added_vocab().items()}
        self.special_texts = {str(t.content) for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.special_texts |= {str(t) for t in tokenizer.all_special_tokens}
        self.chat_template_takes_tools = _template_reads(getattr(tokenizer, "chat_template", None), "tools")
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
        return True, bool(getattr(tokenizer, "chat_template", None)), max(1, longest)

    def _check_ids(self, token_ids: list[int]) -> None:
        if not self.has_tokenizer:
            raise APIError(400, "this model has no tokenizer: token ids cannot be turned into text", param="tokens")
        for i, t in enumerate(token_ids):
            if not 0 <= t < self.vocab_size:
                raise APIError(400, f"tokens[{i}]: token id {t} is not in this tokenizer's vocabulary "
                                    f"(ids 0 to {self.vocab_size - 1})", param="tokens")

    def _check_length(self, text: str, subject: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(400, f"{subject} has {len(text):,} characters: more than fit in max_model_len="
                                f"{self.max_model_len} tokens (a token of this tokenizer stands for at most "
                                f"{self.max_token_chars} characters, so at most {self.max_chars:,} fit)", param=param)

    def _encode(self, text: str, subject: str, param: str, **kwargs: Any) -> list[int]:
        try:
            return list(self._tokenizer.encode(text, **kwargs))
        except (TypeError, UnicodeError) as exc:
            raise APIError(400, f"{subject} could not be tokenized ({type(exc).__name__}): it must be "
                                "valid text", param=param) from None

    def _encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self._encode(text, f"prompt {i}" if len(texts) > 1 else "the prompt", "prompt",
                             add_special_tokens=add_special_tokens)
                for i, text in enumerate(texts)]

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                     add_special_tokens: bool = False, tools: list[dict] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        from jinja2 import TemplateError

        try:
            text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False, tools=tools, **(template_kwargs or {}))
        except TemplateError as exc:
            raise APIError(400, f"the chat template refused these messages: {_short(exc)}", param="messages") from None
        except (TypeError, UnicodeError) as exc:
            raise APIError(400, f"the chat template could not render these messages ({type(exc).__name__}): "
                                "their roles and contents must be valid text", param="messages") from None
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        self._check_length(text, "the chat, rendered by its template,", "messages")
        # what apply_chat_template(tokenize=True) does: the template writes the special tokens itself
        return self._encode(text, "the rendered chat", "messages", add_special_tokens=add_special_tokens), text


def _template_reads(template: Any, name: str) -> bool:
    """Whether a chat template (a Jinja source, or a dict of named ones) reads the variable ``name``."""
    if not template:
        return False
    import re

    from jinja2 import Environment, meta

    sources = [src for src in (template.values() if isinstance(template, dict) else [template])
               if isinstance(src, str)]
    env = Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return any(name in meta.find_undeclared_variables(env.parse(src)) for src in sources)
    except Exception:  # noqa: BLE001 - a tag only transformers' environment knows: look for the name itself
        return any(re.search(rf"\b{name}\b", src) for src in sources)


def _short(exc: BaseException, limit: int = 500) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."
