"""The offline API: ``LLM(model=...)`` and ``llm.generate(prompts, sampling_params)``."""

from __future__ import annotations

import copy
import itertools
from typing import Any
from typing import Sequence as Seq

from hybridserve.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    """Load a checkpoint and generate, vLLM-style.

    Every :class:`~hybridserve.config.EngineConfig` option is a keyword argument
    (``dtype``, ``kv_cache_dtype``, ``mamba_cache_dtype``, ``mamba_ssm_cache_dtype``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``cache_memory``, ``device``, ``seed``, ...).
    With no model named, the small model shipped with the package is used. Structured output's grammar limits
    are options too: ``max_grammar_bytes``, ``max_grammar_compile_seconds``, ``grammar_cache_bytes``
    (docs/structured_output.md, "Limits").

    CPU threads: ``cpu_threads`` and ``cpu_reserved_cores`` take effect here (``torch.set_num_threads``, for
    the whole process). ``cpu_wait_policy`` cannot: the OpenMP runtime read its wait policy when torch was
    imported, so the engine only logs a warning when another one is in force. To choose it, call
    ``hybridserve.kernels.threads.apply_wait_policy("bounded")`` (or set ``OMP_WAIT_POLICY`` /
    ``GOMP_SPINCOUNT``) before the first ``import torch`` (``kernels/threads.py``).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        if model is None:
            from hybridserve.default_model import default_model_path

            model = default_model_path()
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.detokenizer.tokenizer

    def cache_layout(self) -> dict[str, Any]:
        """Resolved dtypes, every layer's cached tensors (name, shape, dtype) and pool totals."""
        return self.engine.cache_layout()

    def reset_prefix_cache(self) -> bool:
        """Evict every cached prefix no request holds; True if nothing cached is left."""
        return self.engine.reset_prefix_cache()

    def _prompt_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.engine.detokenizer.encode(prompt), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.engine.detokenizer.encode(prompt["prompt"]), prompt["prompt"]
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}")

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; one RequestOutput per prompt, in input order.

        A prompt is a string, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; a dict may carry vLLM's
        ``"cache_salt"``, the prompt's prefix-cache tenant (the same as ``SamplingParams.cache_salt``): prompts with
        different salts never share cached prefixes.

        All prompts are validated before any runs: a bad one raises ValueError and nothing is queued.
        They are one origin for the fair share of running slots (``engine/fair_share.py``): alone, they fill
        every slot; beside another caller's requests, they share them.
        A request that fails inside the engine fails alone: its output has ``error`` set and finish
        reason "error" (logged as a warning); the others complete.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        params_list = [_with_prompt_salt(params, prompt) for params, prompt in zip(params_list, prompts)]
        encoded = [self._prompt_ids(p) for p in prompts]
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        self.engine.add_requests([(rid, ids, params, text) for rid, (ids, text), params
                                  in zip(request_ids, encoded, params_list)])
        return self._run(request_ids, use_tqdm and self.engine.config.enable_progress_bar)

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or to a list of
        them, each rendered by the tokenizer's chat template (or ``chat_template``, a Jinja string); one
        RequestOutput per conversation, in input order.

        ``add_generation_prompt`` opens the assistant's turn; ``continue_final_message`` instead continues
        the last message (a partly written assistant reply). Extra template variables go in
        ``chat_template_kwargs``.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt=True and continue_final_message=True cannot be combined: "
                             "the first opens a new assistant turn, the second continues the last message")
        conversations = _conversations(messages)
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            try:
                ids = self.engine.detokenizer.apply_chat_template(
                    conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            except Exception as exc:
                where = f"conversation {i}: " if len(conversations) > 1 else ""
                raise ValueError(f"{where}the chat template could not render these messages: "
                                 f"{type(exc).__name__}: {exc}") from exc
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], progress: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress and len(request_ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in request_ids]


def _with_prompt_salt(params: SamplingParams, prompt: PromptType) -> SamplingParams:
    """``params`` with the ``cache_salt`` a prompt dict carries (ValueError if ``params`` names another one)."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None or salt == params.cache_salt:
        return params
    if params.cache_salt is not None:
        raise ValueError("the prompt's cache_salt differs from its sampling params' cache_salt: give one of them")
    salted = copy.copy(params)
    salted.cache_salt = salt
    salted.validate()
    return salted


def _conversations(messages: Any) -> list[list[dict]]:
    """``messages`` as a list of conversations: one conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if (isinstance(messages, (list, tuple)) and messages
            and all(isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in messages)):
        return [list(c) for c in messages]
    raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) "
                     f"or a list of conversations, got {messages!r:.80}")
