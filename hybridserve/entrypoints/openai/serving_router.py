"""What a request router in front of several replicas asks of each one (vllm-router, sglang-router).

* ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` (vLLM's routes): the token ids a
  completion or chat request would run, the chat template applied, without running it. A cache-aware router
  keys its prefix tree on them, so it sees the tokens this server caches (without these routes it falls back
  to ``/tokenize``).
* ``GET /get_load``: the requests held, running and waiting (the router's ``/get_loads``).
* ``POST /flush_cache`` (and vLLM's name for it, ``POST /reset_prefix_cache``): evict every cached prefix no
  request holds (the router's ``/flush_cache`` calls every replica's).

Health is ``GET /health`` (:mod:`api_server`). Docs: ``docs/data_parallel.md``.
"""

from __future__ import annotations

from hybridserve.entrypoints.openai.limit_checks import check_completions
from hybridserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadResponse,
    RenderedPrompt,
)
from hybridserve.entrypoints.openai.serving_chat import chat_prompt_ids
from hybridserve.entrypoints.openai.serving_common import ServerState, new_id
from hybridserve.entrypoints.openai.serving_completion import prompt_items, tokenized_prompts


async def render_completion(state: ServerState, request: CompletionRequest) -> list[RenderedPrompt]:
    """One rendered prompt per prompt of the request, in order."""
    state.check_model(request.model)
    items = prompt_items(request.prompt)
    check_completions(state.limits, request.n, len(items))
    base = new_id("cmpl")
    return [RenderedPrompt(request_id=f"{base}-{i}", model=state.model_name, token_ids=ids)
            for i, (ids, _) in enumerate(await tokenized_prompts(state, items))]


async def render_chat(state: ServerState, request: ChatCompletionRequest) -> RenderedPrompt:
    """The chat template applied to the messages, tokenized (what ``/v1/chat/completions`` runs)."""
    state.check_model(request.model)
    return RenderedPrompt(request_id=new_id("chatcmpl"), model=state.model_name,
                          token_ids=await chat_prompt_ids(state, request))


def load(state: ServerState) -> LoadResponse:
    running, waiting = state.engine.snapshot.num_requests_running, state.engine.num_waiting()
    return LoadResponse(load=running + waiting, num_requests_running=running, num_requests_waiting=waiting)


async def flush_cache(state: ServerState) -> dict:
    """Evict the prefix cache (what requests hold stays); ``cleared``: whether nothing cached is left."""
    return {"cleared": await state.engine.reset_prefix_cache()}
