"""``POST /v1/chat/completions``: the tokenizer's chat template, then a completion."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.limit_checks import check_completions, check_response_size
from hybridserve.entrypoints.openai.off_loop_json import json_response_off_loop
from hybridserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
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
from hybridserve.outputs import CompletionOutput


async def chat_prompt_ids(state: ServerState, request: ChatCompletionRequest) -> list[int]:
    """The chat template applied to the messages, tokenized (off the event loop)."""
    if not request.messages:
        raise APIError(400, "messages is empty: at least one message is required", param="messages")
    if not state.tokenizer.has_chat_template:
        raise APIError(400, f"this model's tokenizer has no chat template: the model `{state.model_name}` cannot "
                            "be used with /v1/chat/completions; use /v1/completions", param="messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return await state.tokenizer.encode_chat(messages)


def _logprobs(c: CompletionOutput, tokens: range, k: int) -> ChatLogprobs:
    content = []
    for i in tokens:
        entry = c.logprobs[i] if c.logprobs is not None else {}
        tid = c.token_ids[i]
        text = token_str(entry, tid)
        top = [TopLogprob(token=token_str(entry, t), logprob=lp.logprob,
                          bytes=list(token_str(entry, t).encode("utf-8"))) for t, lp in top_entries(entry, k)]
        content.append(TokenLogprob(token=text, logprob=entry[tid].logprob if tid in entry else float("-inf"),
                                    bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest, raw: Request):
    state.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs={request.top_logprobs} is not valid: must be an integer between 0 and 20",
                       param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    check_completions(state.limits, request.n, 1)
    params = sampling_params(request, max_tokens, logprobs, cache_salt=state.cache_salt_of(request, raw),
                             vocab_size=state.vocab_size, model_sets_max_tokens=state.model_sets_max_tokens)
    prompt_ids = await chat_prompt_ids(state, request)
    check_response_size(state.limits, params.n, [len(prompt_ids)], False, state.max_tokens_of(params),
                        state.max_model_len, logprobs,
                        "top_logprobs")
    await compile_structured_output(state, request, params)
    requests = EngineRequests(state.engine, new_id("chatcmpl"), [(prompt_ids, None)], params)
    await requests.start()
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(sse_stream(_events(state, request, requests, logprobs, include_usage, raw),
                                            requests),
                                 media_type="text/event-stream")
    try:
        while not requests.done:
            await requests.wait(raw)
    finally:
        requests.abort()

    def build() -> ChatCompletionResponse:
        choices = []
        for i, c in enumerate(choices_of(requests.latest[0], params.n)):
            lp = _logprobs(c, range(len(c.token_ids)), logprobs) if logprobs is not None and c is not None else None
            choices.append(ChatChoice(index=i, message=ChatResponseMessage(content=c.text if c is not None else ""),
                                      logprobs=lp, finish_reason=finish_reason(c)))
        return ChatCompletionResponse(id=requests.base_id, model=state.model_name, choices=choices,
                                      usage=UsageInfo(**usage_of(requests.latest, requests.prompts)))

    return await json_response_off_loop(build)


async def _events(state: ServerState, request: ChatCompletionRequest, requests: EngineRequests,
                  logprobs: int | None, include_usage: bool, raw: Request) -> AsyncIterator[str]:
    n = requests.params.n
    rid, model = requests.base_id, state.model_name
    deltas = [TextDelta(holdback_of(requests.params)) for _ in range(n)]
    finished = [False] * n
    yield sse(ChatCompletionChunk(id=rid, model=model, choices=[
        ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)]))
    while not requests.done:
        await requests.wait(raw)
        out = requests.latest[0]
        assert out is not None  # (wait returns once the request has an output)
        for i, c in enumerate(choices_of(out, n)):
            if finished[i]:
                continue
            done = out.finished or (c is not None and c.finish_reason is not None)
            text, tokens = deltas[i].advance(c)
            if not text and not tokens and not done:
                continue
            lp = _logprobs(c, tokens, logprobs) if logprobs is not None and c is not None else None
            finished[i] = done
            choice = ChatChunkChoice(index=i, delta=DeltaMessage(content=text) if text else DeltaMessage(),
                                     logprobs=lp, finish_reason=finish_reason(c) if done else None)
            yield sse(ChatCompletionChunk(id=rid, model=model, choices=[choice]))
            await asyncio.sleep(0)  # let the loop serve others between chunks
    if include_usage:
        yield sse(ChatCompletionChunk(id=rid, model=model, choices=[],
                                      usage=UsageInfo(**usage_of(requests.latest, requests.prompts))))
