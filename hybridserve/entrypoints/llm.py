"""The offline API: ``LLM(model=...)`` and ``llm.generate(prompts, sampling_params)``."""

from __future__ import annotations

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
    With no model named, the small model shipped with the package is used.
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

        All prompts are validated before any runs: a bad one raises ValueError and nothing is queued.
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
        encoded = [self._prompt_ids(p) for p in prompts]
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        self.engine.add_requests([(rid, ids, params, text) for rid, (ids, text), params
                                  in zip(request_ids, encoded, params_list)])
        return self._run(request_ids, use_tqdm and self.engine.config.enable_progress_bar)

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
