"""HF transformers as the reference: greedy generation with full logprobs, and the comparison rule."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class RefResult:
    tokens: list[int]
    logprobs: list[torch.Tensor]  # per generated position, (V,) float32 log-softmax


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[RefResult]:
    """Greedy continuation of each prompt alone (no padding), with the logprobs of every step."""
    model = hf_model(path, dtype)
    results = []
    for ids in prompts:
        model.generation_config.eos_token_id = None  # pure argmax of raw logits: never stop, never mask eos
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id or 0)
        tokens = out.sequences[0, len(ids):].tolist()
        lps = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        results.append(RefResult(tokens, lps))
    return results


@torch.inference_mode()
def hf_greedy_uncached(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[RefResult]:
    """As :func:`hf_greedy` in float32, each step a whole forward of the sequence so far without a cache: for
    models ``generate`` cannot run (a hybrid config with recurrent layers only)."""
    model = hf_model(path, torch.float32)
    results = []
    for ids in prompts:
        seq, tokens, lps = list(ids), [], []
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()  # (V,)
            lps.append(torch.log_softmax(logits, -1))
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
        results.append(RefResult(tokens, lps))
    return results


@dataclass
class Comparison:
    compared_tokens: int = 0
    diverged_at: list[int | None] = field(default_factory=list)
    abs_errors: list[float] = field(default_factory=list)  # |Δlogprob| of the chosen token, agreeing steps
    max_topk_error: float = 0.0  # largest |Δlogprob| over our top-k entries, agreeing steps

    @property
    def mean_abs_error(self) -> float:
        return sum(self.abs_errors) / max(len(self.abs_errors), 1)


def compare(ours_tokens: list[list[int]], ours_logprobs: list[list[dict]], refs: list[RefResult],
            top_k: int = 5) -> Comparison:
    """Walk each sequence; where the greedy tokens differ, the divergence must be a near-tie
    (each side's token in the other's top-k) and comparison of that sequence stops there.
    A divergence that is not a near-tie raises AssertionError."""
    cmp = Comparison()
    for seq_i, (toks, lps, ref) in enumerate(zip(ours_tokens, ours_logprobs, refs)):
        diverged = None
        for pos, (a, b) in enumerate(zip(toks, ref.tokens)):
            ref_lp = ref.logprobs[pos]
            ref_top = set(ref_lp.topk(top_k).indices.tolist())
            our_entry = lps[pos]
            our_top = {tid for tid, lp in sorted(our_entry.items(), key=lambda kv: -kv[1].logprob)[:top_k]}
            if a != b:
                assert a in ref_top and b in our_top, (
                    f"seq {seq_i} pos {pos}: token {a} vs HF {b} is not a near-tie "
                    f"(ours top-{top_k} {sorted(our_top)}, HF top-{top_k} {sorted(ref_top)})")
                diverged = pos
                break
            cmp.compared_tokens += 1
            cmp.abs_errors.append(abs(our_entry[a].logprob - float(ref_lp[a])))
            for tid, lp in our_entry.items():
                cmp.max_topk_error = max(cmp.max_topk_error, abs(lp.logprob - float(ref_lp[tid])))
        cmp.diverged_at.append(diverged)
    return cmp
