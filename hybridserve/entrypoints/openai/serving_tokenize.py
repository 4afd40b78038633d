"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), in the server's tokenizer thread.

``/tokenize`` takes ``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"}`` and answers
``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` with ``return_token_strs``); ``/detokenize``
takes ``{"model", "tokens"}`` and answers ``{"prompt"}``. Bad input is a 400 naming the field, an unknown
model a 404, as on the completion routes.
"""

from __future__ import annotations

from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from hybridserve.entrypoints.openai.serving_common import ServerState


async def tokenize(state: ServerState, request: TokenizeRequest) -> TokenizeResponse:
    """The token ids of a prompt, or of a chat rendered by the model's chat template."""
    state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise APIError(400, "give exactly one of prompt (a text) or messages (a chat)",
                       param="prompt" if request.prompt is not None else "messages")
    worker = state.tokenizer
    if request.prompt is not None:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = (await worker.encode_prompts([request.prompt], add_special_tokens=add_special))[0]
    else:
        if not worker.has_tokenizer:
            raise APIError(400, "this model has no tokenizer: chats cannot be tokenized", param="messages")
        if not worker.has_chat_template:
            raise APIError(400, f"this model's tokenizer has no chat template: the model `{state.model_name}` "
                                "cannot tokenize messages; send a prompt", param="messages")
        if not request.messages:
            raise APIError(400, "messages is empty: at least one message is required", param="messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        tokens = await worker.encode_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                          add_special_tokens=bool(request.add_special_tokens))
    token_strs = await worker.token_strs(tokens) if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens,
                            token_strs=token_strs)


async def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (special tokens kept); a 400 naming the first id outside the vocabulary."""
    state.check_model(request.model)
    return DetokenizeResponse(prompt=await state.tokenizer.decode(request.tokens))
