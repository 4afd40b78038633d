"""``POST /v1/completions``."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.limit_checks import check_completions
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
from hybridserve.outputs import CompletionOutput


def _prompt_items(prompt: str | list) -> list:
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


async def _prompts(state: ServerState, items: list) -> list[tuple[list[int], str | None]]:
    """Each prompt as (token ids, text); the texts are tokenized together, off the event loop."""
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await state.tokenizer.encode_prompts(texts) if texts else [])
    return [(next(encoded), item) if isinstance(item, str) else (list(item), None) for item in items]


def _logprobs(c: CompletionOutput, tokens: range, k: int, offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs of tokens ``tokens`` of ``c``; text offsets start at ``offset``."""
    result = CompletionLogprobs()
    for i in tokens:
        entry = c.logprobs[i] if c.logprobs is not None else {}
        tid = c.token_ids[i]
        text = token_str(entry, tid)
        result.tokens.append(text)
        result.token_logprobs.append(entry[tid].logprob if tid in entry else None)
        result.top_logprobs.append({token_str(entry, t): lp.logprob for t, lp in top_entries(entry, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def create_completion(state: ServerState, request: CompletionRequest, raw: Request):
    state.check_model(request.model)
    items = _prompt_items(request.prompt)
    check_completions(state.limits, request.n, len(items))
    params = sampling_params(request, request.max_tokens, request.logprobs)
    prompts = await _prompts(state, items)
    requests = EngineRequests(state.engine, new_id("cmpl"), prompts, params)
    await requests.start()
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(sse_stream(_events(state, request, requests, include_usage, raw), requests),
                                 media_type="text/event-stream")
    try:
        while not requests.done:
            await requests.wait(raw)
    finally:
        requests.abort()
    n = params.n
    choices = []
    for p, out in enumerate(requests.latest):
        for i, c in enumerate(choices_of(out, n)):
            logprobs = None
            if request.logprobs is not None and c is not None:
                logprobs = _logprobs(c, range(len(c.token_ids)), request.logprobs, 0)
            choices.append(CompletionChoice(index=p * n + i, text=c.text if c is not None else "", logprobs=logprobs,
                                            finish_reason=finish_reason(c)))
    return CompletionResponse(id=requests.base_id, model=state.model_name, choices=choices,
                              usage=UsageInfo(**usage_of(requests.latest, prompts)))


async def _events(state: ServerState, request: CompletionRequest, requests: EngineRequests,
                  include_usage: bool, raw: Request) -> AsyncIterator[str]:
    n = requests.params.n
    deltas = [[TextDelta(holdback_of(requests.params)) for _ in range(n)] for _ in requests.prompts]
    finished = [[False] * n for _ in requests.prompts]
    while not requests.done:
        for p in await requests.wait(raw):
            out = requests.latest[p]
            for i, c in enumerate(choices_of(out, n)):
                if finished[p][i]:
                    continue
                done = out.finished or (c is not None and c.finish_reason is not None)
                delta = deltas[p][i]
                offset = delta.text_len
                text, tokens = delta.advance(c)
                if not text and not tokens and not done:
                    continue
                logprobs = None
                if request.logprobs is not None and c is not None:
                    logprobs = _logprobs(c, tokens, request.logprobs, offset)
                finished[p][i] = done
                choice = CompletionChoice(index=p * n + i, text=text, logprobs=logprobs,
                                          finish_reason=finish_reason(c) if done else None)
                yield sse(CompletionResponse(id=requests.base_id, model=state.model_name, choices=[choice]))
    if include_usage:
        yield sse(CompletionResponse(id=requests.base_id, model=state.model_name, choices=[],
                                     usage=UsageInfo(**usage_of(requests.latest, requests.prompts))))
