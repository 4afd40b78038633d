"""What completions and chat share: server state, sampling params, engine requests, deltas, logprobs."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import BaseModel
from starlette.requests import Request

from hybridserve.engine.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    NewRequest,
    OutputSink,
    QueueFullError,
    RequestFailedError,
)
from hybridserve.entrypoints.openai.cache_isolation import request_cache_salt
from hybridserve.entrypoints.openai.errors import APIError, ClientDisconnected, error_body, internal_error
from hybridserve.entrypoints.openai.limits import ServerLimits
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from hybridserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.structured_output.api_request import (
    StructuredOutputRequestError,
    in_api_terms,
    requested_field,
    structured_outputs_of,
)

#: a request (streaming or not) checks at least this often (seconds) whether its client is still there
DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    """What every endpoint needs: the engine, the tokenizer (in its own thread), names, limits, auth."""

    engine: AsyncEngine
    tokenizer: TokenizerWorker
    model_name: str
    max_model_len: int
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    protect_metrics_and_docs: bool = False  # /metrics and the docs routes need the API key too
    extra_model_names: tuple[str, ...] = ()  # further names requests may use (``--served-model-name A B``)
    prefix_cache_isolation: str = "shared"  # or "api-key" (``--prefix-cache-isolation``, cache_isolation.py)
    tool_parser: Any = None  # a tool_parsers.ToolCallParser (``--tool-call-parser``); None: tools are refused
    reasoning_parser: Any = None  # a reasoning.ThinkTagReasoningParser (``--reasoning-parser``); None: no split

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids are 0 .. vocab_size - 1."""
        return self.engine.engine.hf_config.vocab_size

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name this server answers to; the first (``model_name``) is the one responses and /metrics carry."""
        return (self.model_name, *self.extra_model_names)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in self.model_names)
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           param="model", code="model_not_found")

    @property
    def model_sets_max_tokens(self) -> bool:
        """Whether the model's generation_config.json gives a default ``max_tokens`` (its ``max_new_tokens``)."""
        return "max_tokens" in self.engine.engine.generation_defaults.sampling

    def max_tokens_of(self, params: SamplingParams) -> int | None:
        """The ``max_tokens`` the engine runs ``params`` with (before it cuts a model default to what fits)."""
        return self.engine.engine.generation_defaults.apply(params).max_tokens

    def cache_salt_of(self, request: Any, raw: Request) -> str | None:
        """The prefix-cache salt ``request`` runs with (its ``cache_salt``, keyed by its API key in api-key mode)."""
        return request_cache_salt(self.prefix_cache_isolation, request.cache_salt,
                                  raw.headers.get("authorization", ""))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(request: Any, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, cache_salt: str | None = None,
                    vocab_size: int | None = None, api_max_tokens: int | None = None,
                    model_sets_max_tokens: bool = False) -> SamplingParams:
    """The engine's SamplingParams of an API request; a bad value is a 400 naming the field.

    Only the sampling fields the request sets are set: the engine gives the others the model's
    generation_config.json defaults (docs/server.md, "Generation defaults"). ``max_tokens`` is the request's
    (None: not given); when not given it is left to the model's default if ``model_sets_max_tokens``, else it is
    the endpoint's ``api_max_tokens`` (None: as many as fit).
    ``max_tokens=0`` (prefill only) is valid only with completions' ``echo=true``, as in vLLM: it returns
    the prompt and its logprobs, and nothing else."""
    name = request.unsupported()
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server", param=name)
    if max_tokens == 0 and not getattr(request, "echo", False):
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) == 0 else "max_tokens"
        raise APIError(400, f"{param}=0 is not valid here: it must be >= 1 (0 is allowed only on /v1/completions "
                            "with echo=true, which returns the prompt and its logprobs alone)", param=param)
    fields: dict[str, Any] = dict(
        n=request.n, seed=request.seed, stop=request.stop,
        stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, cache_salt=cache_salt,
        min_tokens=request.min_tokens, skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=_logit_bias(request.logit_bias, vocab_size))
    try:
        fields["structured_outputs"] = structured_outputs_of(request)
    except StructuredOutputRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    if max_tokens is not None or not model_sets_max_tokens:
        fields["max_tokens"] = max_tokens if max_tokens is not None else api_max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split("=", 1)[0]) from None


async def compile_structured_output(state: ServerState, request: Any, params: SamplingParams,
                                    param: str | None = None) -> None:
    """Compile the request's grammar, if it has one, in the engine's grammar worker while the event loop goes on
    (the engine then reuses it); one that does not compile, or is over a grammar limit, is a 400 naming the field
    the client set (``param``, when the caller knows it better: ``tools`` for a tool-call grammar), the limit and
    its flag."""
    spec = params.structured_outputs
    if spec is None:
        return
    try:
        await state.engine.engine.structured.compiler.compile_async(spec)
    except ValueError as exc:
        param = param or requested_field(request)
        raise APIError(400, in_api_terms(str(exc), param), param=param) from None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None = None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer keys; a key that is not a token id
    of the vocabulary (``vocab_size``, when given) is a 400 naming it. Digits are counted before any is
    converted, so a key of thousands of digits costs nothing."""
    if not bias:
        return None
    out: dict[int, float] = {}
    vocab = f"this model's vocabulary has {vocab_size:,} tokens, ids 0 to {vocab_size - 1:,}" if vocab_size else ""
    for key, value in bias.items():
        shown = f"{key[:20]!r}... ({len(key):,} characters)" if len(key) > 20 else repr(key)
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {shown} is not a token id (a non-negative integer)"
                                + (f"; {vocab}" if vocab else ""), param="logit_bias")
        digits = key.lstrip("0") or "0"  # int() refuses more than 4,300 digits: never give it more than it needs
        if len(digits) > 19 or (vocab_size is not None and int(digits) >= vocab_size):
            raise APIError(400, f"logit_bias key {shown} is not a token id of the vocabulary"
                                + (f": {vocab}" if vocab else ""), param="logit_bias")
        out[int(digits)] = value
    return out


class EngineRequests:
    """The engine requests of one HTTP request (one per prompt), their latest outputs, and cleanup.

    Always call :meth:`abort` when done (in a ``finally``): it aborts whatever has not finished,
    which frees its cache at once.
    """

    def __init__(self, engine: AsyncEngine, base_id: str, prompts: list[tuple[list[int], str | None]],
                 params: SamplingParams) -> None:
        self.engine = engine
        self.base_id = base_id
        self.prompts = prompts
        self.params = params
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._pending: set[str] = set()
        self._sink = OutputSink()
        self._last_poll = time.monotonic()

    async def start(self) -> None:
        """Queue every prompt in one engine command: all of them, or none on a bad one (400) or a full queue (503)."""
        new = [NewRequest(rid, ids, self.params, text) for rid, (ids, text) in zip(self.request_ids, self.prompts)]
        self._pending.update(self.request_ids)
        try:
            await self.engine.add_requests(new, self._sink)
        except ValueError as exc:
            self._pending.clear()  # nothing was queued
            message = str(exc)
            param = ("logit_bias" if "logit_bias" in message
                     else "structured_outputs" if "structured_outputs" in message
                     else "prompt" if "prompt" in message else None)
            raise APIError(400, message, param=param) from None
        except (QueueFullError, EngineStoppedError) as exc:
            self._pending.clear()
            raise APIError(503, str(exc)) from None
        except BaseException:
            self.abort()  # cancelled: the add may still land
            raise

    @property
    def done(self) -> bool:
        return not self._pending

    async def wait(self, raw_request: Request | None = None) -> list[int]:
        """Wait for new outputs; the indices of the prompts that advanced.

        With ``raw_request``, also watch for the client going away (raises :class:`ClientDisconnected`).
        """
        while True:
            got = await self._get(DISCONNECT_POLL_S if raw_request is not None else None)
            if raw_request is not None and (not got or time.monotonic() - self._last_poll > DISCONNECT_POLL_S):
                self._last_poll = time.monotonic()
                if await raw_request.is_disconnected():
                    self.abort()
                    raise ClientDisconnected()
            if got:
                advanced = []
                for rid, out in got.items():
                    i = self._index[rid]
                    self.latest[i] = out
                    advanced.append(i)
                    if out.finished:
                        self._pending.discard(rid)
                return sorted(advanced)

    async def _get(self, timeout: float | None) -> dict[str, RequestOutput]:
        """The sink's new outputs; a failure in the engine is a 500 naming the request (its cause goes to the log)."""
        try:
            return await self._sink.get(timeout=timeout)
        except RequestFailedError as exc:
            self.abort()
            raise internal_error(exc.request_id, exc.message) from None
        except Exception as exc:  # noqa: BLE001 - a failed engine step: logged with the id, not shown
            self.abort()
            raise internal_error(self.base_id, exc) from None

    def abort(self) -> None:
        for rid in self._pending:
            self.engine.abort(rid)
        self._pending.clear()


def choices_of(out: RequestOutput | None, n: int) -> list[CompletionOutput | None]:
    """The ``n`` completions of a request output by index (None where a completion has not started)."""
    found: list[CompletionOutput | None] = [None] * n
    for c in out.outputs if out is not None else []:
        found[c.index] = c
    return found


def finish_reason(c: CompletionOutput | None) -> str:
    return c.finish_reason if c is not None and c.finish_reason else "abort"


class TextDelta:
    """What one completion has streamed so far, and what it may stream now.

    Text is held back while it may still change: a trailing replacement character (an incomplete
    UTF-8 sequence that the next token may complete) and the last ``len(longest stop string) - 1``
    characters (which may turn out to begin a stop string, cut from the final text). So the
    concatenated deltas always equal the final text.
    """

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.text_len = 0
        self.num_tokens = 0

    def advance(self, c: CompletionOutput | None) -> tuple[str, range]:
        """The new text and the indices of the new tokens since the last call."""
        if c is None:
            return "", range(0)
        text, end = c.text, len(c.text)
        if c.finish_reason is None:
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            end = max(0, end - self.holdback)
        new_text = text[self.text_len:end] if end > self.text_len else ""
        self.text_len = max(self.text_len, end)
        new_tokens = range(self.num_tokens, len(c.token_ids))
        self.num_tokens = len(c.token_ids)
        return new_text, new_tokens


def holdback_of(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_strings), default=1) - 1


def token_str(entry: PositionLogprobs, token_id: int) -> str:
    lp = entry.get(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def top_entries(entry: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of a position, best first."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def usage_of(outputs: list[RequestOutput | None], prompts: list[tuple[list[int], str | None]]) -> dict:
    """OpenAI ``usage``, with ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache served,
    and ``prompt_tokens_details.prefix_cache_reason``: why (a string for one prompt, a list in prompt order for
    several; None where a prompt has no answer yet). A reason is what the request was told: never ``salted``."""
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outputs if out is not None)
    reasons = [out.prefix_cache.reason.value if out is not None and out.prefix_cache is not None else None
               for out in outputs]
    details: dict = {"cached_tokens": cached}
    if any(reason is not None for reason in reasons):
        details["prefix_cache_reason"] = reasons[0] if len(reasons) == 1 else reasons
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


#: characters valid unescaped in JSON that line-splitting clients (str.splitlines) take for line breaks
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event (its JSON never contains anything a client could read as a line break)."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


async def sse_stream(events: AsyncIterator[str], requests: "EngineRequests") -> AsyncIterator[str]:
    """One streamed response: ``events``, then ``[DONE]``. An error after the stream has started is
    reported in-band, as an error event (a 500's cause goes to the log, under the id the event names);
    the engine requests are aborted however the stream ends, the client leaving included (``events``
    watch for that too, as non-streaming requests do, so a stream waiting in the queue notices)."""
    try:
        async for event in events:
            yield event
    except ClientDisconnected:
        return  # nobody to tell (the finally aborts the engine requests)
    except APIError as exc:
        yield sse_error(exc.status, exc.message)
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        error = internal_error(requests.base_id, exc)
        yield sse_error(error.status, error.message)
    finally:
        requests.abort()
    yield SSE_DONE
