"""``POST /v1/completions``.

With ``echo=true`` each choice's text starts with its prompt, and with ``logprobs`` its logprobs cover
the prompt's tokens first (the first one has none: nothing predicts it), then the generated ones, as
OpenAI and vLLM answer; ``max_tokens=0`` then returns the prompt alone (what lm-eval's loglikelihood
requests need). A stream sends each choice's prompt in its first chunk.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridserve.engine.detokenizer import Detokenizer
from hybridserve.entrypoints.openai.echo import OffsetTracker, PromptEcho, echo_prompts, token_offsets
from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.limit_checks import check_completions, check_response_size
from hybridserve.entrypoints.openai.off_loop_json import json_response_off_loop
from hybridserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from hybridserve.entrypoints.openai.serving_common import (
    EngineRequests,
    ServerState,
    TextDelta,
    choices_of,
    compile_structured_output,
    finish_reason,
    holdback_of,
    new_id,
    sampling_params,
    sse,
    sse_stream,
    token_str,
    top_entries,
    usage_of,
)
from hybridserve.outputs import CompletionOutput, PositionLogprobs

#: OpenAI's default ``max_tokens`` of a completion, when neither the request nor the model's generation config
#: gives one
OPENAI_DEFAULT_MAX_TOKENS = 16


def prompt_items(prompt: str | list) -> list:
    """``prompt`` as a list of prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    return items


def check_token_ids(prompts: list[tuple[list[int], str | None]], vocab_size: int) -> None:
    """A 400 for a token-id prompt with an id outside the vocabulary, before anything decodes it (echo)."""
    for p, (ids, text) in enumerate(prompts):
        if text is None and not all(0 <= t < vocab_size for t in ids):
            bad = [t for t in ids if not 0 <= t < vocab_size][:3]
            shown = ", ".join(str(t) if len(str(t)) <= 20 else f"{str(t)[:20]}..." for t in bad)
            which = f"prompt {p}: " if len(prompts) > 1 else ""
            raise APIError(400, f"{which}prompt token ids [{shown}] are outside the vocabulary [0, {vocab_size})",
                           param="prompt")


async def tokenized_prompts(state: ServerState, items: list) -> list[tuple[list[int], str | None]]:
    """Each prompt as (token ids, text); the texts are tokenized together, off the event loop."""
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await state.tokenizer.encode_prompts(texts) if texts else [])
    return [(next(encoded), item) if isinstance(item, str) else (list(item), None) for item in items]


T = TypeVar("T")


async def _in_tokenizer_thread(state: ServerState, fn: Callable[[Detokenizer], T]) -> T:
    """``fn(detokenizer)``, run in the tokenizer's own thread (the only one that may use it)."""
    worker = state.tokenizer
    return await worker._run(lambda: fn(Detokenizer(worker._tokenizer)))


async def _echoes(state: ServerState, request: CompletionRequest,
                  prompts: list[tuple[list[int], str | None]]) -> list[PromptEcho] | None:
    """Each prompt's echo (None without ``echo``)."""
    if not request.echo:
        return None
    return await _in_tokenizer_thread(state, lambda d: echo_prompts(d, prompts, request.skip_special_tokens))


def _prompt_logprobs(echo: PromptEcho, ids: list[int], entries: list[PositionLogprobs | None] | None,
                     k: int) -> CompletionLogprobs:
    """Legacy completions logprobs of a prompt's tokens: position 0 has no logprob and no top logprobs."""
    result = CompletionLogprobs(tokens=list(echo.tokens), text_offset=list(echo.offsets))
    for i, tid in enumerate(ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(entry[tid].logprob if tid in entry else None)
        result.top_logprobs.append({token_str(entry, t): lp.logprob for t, lp in top_entries(entry, k)})
    return result


def _logprobs(c: CompletionOutput, tokens: range, k: int, offsets: list[int],
              before: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Legacy completions logprobs of tokens ``tokens`` of ``c`` (starting in the choice's text at ``offsets``),
    after ``before`` (the echoed prompt's, if any)."""
    result = before.model_copy(deep=True) if before is not None else CompletionLogprobs()
    result.text_offset.extend(offsets)
    for i in tokens:
        entry = c.logprobs[i] if c.logprobs is not None else {}
        tid = c.token_ids[i]
        text = token_str(entry, tid)
        result.tokens.append(text)
        result.token_logprobs.append(entry[tid].logprob if tid in entry else None)
        result.top_logprobs.append({token_str(entry, t): lp.logprob for t, lp in top_entries(entry, k)})
    return result


async def create_completion(state: ServerState, request: CompletionRequest, raw: Request):
    state.check_model(request.model)
    items = prompt_items(request.prompt)
    check_completions(state.limits, request.n, len(items))
    params = sampling_params(request, request.max_tokens, request.logprobs,
                             prompt_logprobs=request.logprobs if request.echo else None,
                             cache_salt=state.cache_salt_of(request, raw), vocab_size=state.vocab_size,
                             api_max_tokens=OPENAI_DEFAULT_MAX_TOKENS,
                             model_sets_max_tokens=state.model_sets_max_tokens)
    prompts = await tokenized_prompts(state, items)
    check_token_ids(prompts, state.vocab_size)
    check_response_size(state.limits, params.n, [len(ids) for ids, _ in prompts], request.echo,
                        state.max_tokens_of(params),
                        state.max_model_len, request.logprobs)
    echoes = await _echoes(state, request, prompts)
    await compile_structured_output(state, request, params)
    requests = EngineRequests(state.engine, new_id("cmpl"), prompts, params)
    await requests.start()
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(sse_stream(_events(state, request, requests, echoes, include_usage, raw),
                                            requests), media_type="text/event-stream")
    try:
        while not requests.done:
            await requests.wait(raw)
    finally:
        requests.abort()
    n = params.n
    outs = [choices_of(out, n) for out in requests.latest]
    offsets = None
    if request.logprobs is not None:
        offsets = await _in_tokenizer_thread(state, lambda d: [[token_offsets(
            d, c.token_ids, request.skip_special_tokens, len(echoes[p].text) if echoes else 0) if c else []
            for c in cs] for p, cs in enumerate(outs)])

    def build() -> CompletionResponse:
        choices = []
        for p, out in enumerate(requests.latest):
            echo_text, before = _echo_parts(request, echoes, prompts, out, p)
            for i, c in enumerate(outs[p]):
                logprobs = None
                if offsets is not None:
                    logprobs = (_logprobs(c, range(len(c.token_ids)), request.logprobs, offsets[p][i], before)
                                if c is not None else before)
                choices.append(CompletionChoice(index=p * n + i, text=echo_text + (c.text if c is not None else ""),
                                                logprobs=logprobs, finish_reason=finish_reason(c)))
        return CompletionResponse(id=requests.base_id, model=state.model_name, choices=choices,
                                  usage=UsageInfo(**usage_of(requests.latest, prompts)))

    return await json_response_off_loop(build)


def _echo_parts(request: CompletionRequest, echoes: list[PromptEcho] | None,
                prompts: list[tuple[list[int], str | None]], out, p: int) -> tuple[str, CompletionLogprobs | None]:
    """Prompt ``p``'s echoed text ("" without echo) and its logprobs (None unless echo with logprobs)."""
    if echoes is None:
        return "", None
    if request.logprobs is None:
        return echoes[p].text, None
    entries = out.prompt_logprobs if out is not None else None
    return echoes[p].text, _prompt_logprobs(echoes[p], prompts[p][0], entries, request.logprobs)


async def _events(state: ServerState, request: CompletionRequest, requests: EngineRequests,
                  echoes: list[PromptEcho] | None, include_usage: bool, raw: Request) -> AsyncIterator[str]:
    n = requests.params.n
    deltas = [[TextDelta(holdback_of(requests.params)) for _ in range(n)] for _ in requests.prompts]
    finished = [[False] * n for _ in requests.prompts]
    echoed = [[echoes is None] * n for _ in requests.prompts]  # whether the choice's prompt has been sent
    trackers: dict[tuple[int, int], OffsetTracker] = {}  # (prompt, choice) -> its tokens' text offsets
    echo_parts: dict[int, tuple[str, CompletionLogprobs | None]] = {}  # prompt -> its echo (see _echo_parts)

    def offsets_of(p: int, i: int, c: CompletionOutput, tokens: range) -> Callable[[Detokenizer], list[int]]:
        def run(detokenizer: Detokenizer) -> list[int]:
            if (p, i) not in trackers:
                start = len(echoes[p].text) if echoes is not None else 0
                trackers[p, i] = OffsetTracker(detokenizer, request.skip_special_tokens, start)
            return trackers[p, i].advance(c.token_ids, tokens.stop)
        return run

    while not requests.done:
        for p in await requests.wait(raw):
            out = requests.latest[p]
            assert out is not None  # (wait returns the prompts with a new output)
            for i, c in enumerate(choices_of(out, n)):
                if finished[p][i]:
                    continue
                done = out.finished or (c is not None and c.finish_reason is not None)
                text, tokens = deltas[p][i].advance(c)
                if not text and not tokens and not done:
                    continue
                before = None
                if not echoed[p][i]:  # the first chunk of this choice: its prompt comes first (built once per prompt)
                    if p not in echo_parts:
                        echo_parts[p] = _echo_parts(request, echoes, requests.prompts, out, p)
                    echo_text, before = echo_parts[p]
                    text, echoed[p][i] = echo_text + text, True
                logprobs = before
                if request.logprobs is not None and c is not None:
                    offsets = await _in_tokenizer_thread(state, offsets_of(p, i, c, tokens)) if tokens else []
                    logprobs = _logprobs(c, tokens, request.logprobs, offsets, before)
                finished[p][i] = done
                choice = CompletionChoice(index=p * n + i, text=text, logprobs=logprobs,
                                          finish_reason=finish_reason(c) if done else None)
                yield sse(CompletionResponse(id=requests.base_id, model=state.model_name, choices=[choice]))
                await asyncio.sleep(0)  # let the loop serve others between chunks (a chunk may be a whole echo)
    if include_usage:
        yield sse(CompletionResponse(id=requests.base_id, model=state.model_name, choices=[],
                                     usage=UsageInfo(**usage_of(requests.latest, requests.prompts))))
