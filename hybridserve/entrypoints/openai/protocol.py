"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests accept OpenAI's fields plus a few extensions (``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``min_tokens``, ``skip_special_tokens``); fields we do not implement are accepted
only at their neutral value, and a field the models do not declare is refused (a 400 naming it, see
``errors.py``), so a client never silently gets something other than it asked for. A few OpenAI fields
whose correct meaning here is "nothing to do" are accepted as no-ops (``user``, ``metadata``,
``safety_identifier``, ``prompt_cache_key``; docs/server.md).

Numbers are strict where JSON's types would otherwise blur: a boolean is never an integer or a
number (``"prompt": [true, false]`` is not a list of token ids), and a float must be finite.
Token-id lists are validated by a plain loop that stops at the first bad entry, so a long bad list
costs no more than a long good one.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema

from hybridserve.cache.salt import MAX_CACHE_SALT_CHARS, check_cache_salt
from hybridserve.entrypoints.openai.tool_protocol import (
    ToolDeltaFields,
    ToolMessageFields,
    ToolRequestFields,
    ToolResponseFields,
)


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


#: an integer / a finite number, never a boolean
Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_no_bool)]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _token_ids(value: Any) -> list[int]:
    if not _is_ids(value):
        raise ValueError("must be a list of integer token ids")
    return value


def _prompt(value: Any) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (_is_ids(value) or all(type(p) is str for p in value)
                                    or all(_is_ids(p) for p in value)):
        return value
    raise ValueError("must be a string, a list of strings, a list of token ids (integers), or a list of lists of "
                     "token ids")


_IDS_SCHEMA = {"type": "array", "items": {"type": "integer"}}
TokenIds = Annotated[list[int], PlainValidator(_token_ids), WithJsonSchema(_IDS_SCHEMA)]
#: vLLM's ``cache_salt``: a non-empty string of at most MAX_CACHE_SALT_CHARS characters (hybridserve.cache.salt)
CacheSalt = Annotated[str, PlainValidator(check_cache_salt),
                      WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS})]
Prompt = Annotated[str | list, PlainValidator(_prompt), WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}}, _IDS_SCHEMA,
    {"type": "array", "items": _IDS_SCHEMA}]})]


class _Request(BaseModel):
    """A request body (or a part of one): a field it does not declare is refused, never dropped."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # only false: chunks carry no obfuscation padding


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the output is JSON valid under ``schema`` (enforced, ``strict`` or not)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[str, Float] | None = None  # {"token id": bias in [-100, 100]}
    user: str | None = None  # accepted, no effect: an end-user id for the provider's abuse monitoring
    # extensions
    repetition_penalty: Float | None = None
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    min_tokens: Int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output (docs/structured_output.md): OpenAI's response_format, vLLM's structured_outputs, guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # one of json, json_object, regex, choice, grammar
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: CacheSalt | None = None  # the prefix-cache tenant (docs/server.md, "Isolation")
    # SGLang's fields, which vllm-router adds to every request it forwards: accepted at their neutral value
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    def unsupported(self) -> str | None:
        """The name of a field set to a value this server does not implement, if any."""
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            return "stream_options.include_obfuscation"
        for name in ("no_stop_trim", "return_hidden_states"):
            if getattr(self, name):
                return name
        return None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = None  # unset: the model's generation_config max_new_tokens, else 16 (OpenAI's)
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(ToolMessageFields, _Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"message content of type {part.type!r} is not supported: this server serves "
                                 "text only; the allowed content part type is 'text'")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(ToolRequestFields, _SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    # OpenAI fields accepted with no effect, the correct meaning on a server that stores nothing and has one tier
    metadata: dict[str, str] | None = None  # tags of a stored completion: nothing is stored
    safety_identifier: str | None = None  # as ``user``
    prompt_cache_key: str | None = None  # a cache-routing hint: the prefix cache needs none
    store: bool | None = None  # only false: nothing is stored
    service_tier: str | None = None  # only auto / default: one tier
    modalities: list[str] | None = None  # only ["text"]
    # vllm-router's chat additions (SGLang's names): continue_final_message only false; the reasoning switches only
    # at what the server does (with --reasoning-parser, reasoning is separated, streamed and included; without one
    # there is no reasoning to treat)
    continue_final_message: bool = False
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    def unsupported(self) -> str | None:
        if self.continue_final_message:
            return "continue_final_message"
        for name in ("separate_reasoning", "stream_reasoning", "include_reasoning"):
            if getattr(self, name) is False:
                return name
        if self.store:
            return "store"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        return super().unsupported()


# ------------------------------------------------------------------ responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache
    # why (cache/prefix_reason.py, never "salted"): one reason for one prompt, a list in prompt order for several;
    # a key OpenAI-compatible clients ignore (docs/prefix_caching.md)
    prefix_cache_reason: str | list[str | None] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(ToolResponseFields):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(ToolDeltaFields):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hybridserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Any = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------ /tokenize and /detokenize
class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` (a text) or ``messages`` (a chat, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # chat only: end with the assistant's turn opening
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat (the template adds them)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class RenderedPrompt(BaseModel):
    """One prompt of ``POST /v1/completions/render`` or ``/v1/chat/completions/render``: the token ids the
    request would run (vLLM's shape)."""

    request_id: str
    model: str
    token_ids: list[int]


class LoadResponse(BaseModel):
    """``GET /get_load``: the requests this server holds (``load`` = running + waiting)."""

    load: int
    num_requests_running: int
    num_requests_waiting: int
