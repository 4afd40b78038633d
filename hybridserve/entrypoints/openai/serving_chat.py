"""``POST /v1/chat/completions``: the tokenizer's chat template (with the request's tools), then a completion,
read back into reasoning, content and tool calls (chat_tools.py, chat_stream.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridserve.entrypoints.openai.chat_stream import ReplyStream
from hybridserve.entrypoints.openai.chat_tools import (
    ReplyReader,
    check_tools,
    output_constraint,
    reply_tool_calls,
    template_kwargs,
    template_messages,
    template_tools,
    tool_choice_of,
)
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
    """The chat template applied to the messages (and the tools in play), tokenized (off the event loop)."""
    ids, _, _ = await render_chat_prompt(state, request)
    return ids


async def render_chat_prompt(state: ServerState, request: ChatCompletionRequest) -> tuple[list[int], str, list]:
    """The prompt's token ids and text, and the request's tools in play (checked: see chat_tools.check_tools)."""
    if not request.messages:
        raise APIError(400, "messages is empty: at least one message is required", param="messages")
    if not state.tokenizer.has_chat_template:
        raise APIError(400, f"this model's tokenizer has no chat template: the model `{state.model_name}` cannot "
                            "be used with /v1/chat/completions; use /v1/completions", param="messages")
    specs = check_tools(request, state.tool_parser, state.tokenizer.chat_template_takes_tools,
                        state.engine.engine.structured.compiler.limits.max_grammar_bytes)
    ids, text = await state.tokenizer.render_chat(template_messages(request), template_tools(request, specs),
                                                  template_kwargs(request))
    return ids, text, specs


def _reply_finish(c: CompletionOutput | None, called: bool) -> str:
    """OpenAI's finish reason: "tool_calls" when a reply that stopped by itself called tools."""
    reason = finish_reason(c)
    return "tool_calls" if called and reason == "stop" else reason


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
    prompt_ids, prompt_text, specs = await render_chat_prompt(state, request)
    check_response_size(state.limits, params.n, [len(prompt_ids)], False, state.max_tokens_of(params),
                        state.max_model_len, logprobs,
                        "top_logprobs")
    reasoning = state.reasoning_parser
    reader = ReplyReader(state.tool_parser if specs else None, reasoning,
                         reasoning.prompt_state(prompt_text) if reasoning is not None else "after")
    if params.skip_special_tokens and reader.keep_special_tags(state.tokenizer.special_texts):
        params = dataclasses.replace(params, skip_special_tokens=False)
    constraint = output_constraint(request, specs, params.structured_outputs, reader.parser, reasoning,
                                   reader.reasoning_state, state.tokenizer.added_tokens)
    if constraint is not params.structured_outputs:
        params = dataclasses.replace(params, structured_outputs=constraint)
    forced = bool(specs) and tool_choice_of(request) in ("required", "named")
    await compile_structured_output(state, request, params, param="tools" if forced else None)
    requests = EngineRequests(state.engine, new_id("chatcmpl"), [(prompt_ids, None)], params)
    await requests.start()
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(sse_stream(_events(state, requests, reader, logprobs, include_usage, raw),
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
            read = reader.read(c.text if c is not None else "", True)
            message = ChatResponseMessage(content=read.content if read.content or not read.calls else None,
                                          reasoning_content=read.reasoning, tool_calls=reply_tool_calls(read.calls))
            choices.append(ChatChoice(index=i, message=message, logprobs=lp,
                                      finish_reason=_reply_finish(c, bool(read.calls))))
        return ChatCompletionResponse(id=requests.base_id, model=state.model_name, choices=choices,
                                      usage=UsageInfo(**usage_of(requests.latest, requests.prompts)))

    return await json_response_off_loop(build)


async def _events(state: ServerState, requests: EngineRequests, reader: ReplyReader,
                  logprobs: int | None, include_usage: bool, raw: Request) -> AsyncIterator[str]:
    n = requests.params.n
    rid, model = requests.base_id, state.model_name
    deltas = [TextDelta(holdback_of(requests.params)) for _ in range(n)]
    replies = [ReplyStream(reader) for _ in range(n)]
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
            piece = replies[i].advance(text, done)
            delta = DeltaMessage(content=piece.content or None, reasoning_content=piece.reasoning or None,
                                 tool_calls=piece.tool_calls or None)
            choice = ChatChunkChoice(index=i, delta=delta, logprobs=lp,
                                     finish_reason=_reply_finish(c, replies[i].called) if done else None)
            yield sse(ChatCompletionChunk(id=rid, model=model, choices=[choice]))
            await asyncio.sleep(0)  # let the loop serve others between chunks
    if include_usage:
        yield sse(ChatCompletionChunk(id=rid, model=model, choices=[],
                                      usage=UsageInfo(**usage_of(requests.latest, requests.prompts))))
