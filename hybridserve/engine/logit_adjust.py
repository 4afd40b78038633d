"""Adjustments to the logits a token is drawn from: ``logit_bias``, ``min_tokens`` stop masking, allowed-token
masks (structured output) and the repetition / frequency / presence penalties.

They change which token is picked, never the logprobs reported to users (those stay the raw model
distribution, as vLLM's default ``raw_logprobs``). Order, as vLLM's: bias and masks, then penalties, then
(in the sampler) temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from hybridserve.sampling_params import SamplingParams
from hybridserve.structured_output.matcher import apply_grammar_masks

#: fills row ``row`` of ``logits`` (N, V) in place with -inf where a token is not allowed; a mask that also has
#: ``fill_bitmask`` (structured output's SequenceMatcher) is applied with the batch's other such rows at once
TokenMask = Callable[[torch.Tensor, int], None]


@dataclass
class RowContext:
    """What one logits row's adjustments read: its params, its tokens so far, its stop tokens."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Collection[int] = ()
    token_mask: TokenMask | None = None  # structured output: the grammar's allowed next tokens


def row_needs_adjustment(ctx: RowContext) -> bool:
    """True when anything in this row changes the distribution a token is drawn from."""
    p = ctx.params
    return (ctx.token_mask is not None or bool(p.logit_bias) or p.has_penalties
            or len(ctx.output_token_ids) < p.min_tokens)


@dataclass
class LogitAdjuster:
    """The adjustments of one sampling batch: row ``i`` of the logits belongs to ``rows[i]``."""

    rows: list[RowContext]
    _active: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._active = [i for i, ctx in enumerate(self.rows) if row_needs_adjustment(ctx)]

    def __bool__(self) -> bool:
        return bool(self._active)

    def row(self, index: int) -> LogitAdjuster:
        """The adjuster of one row alone (for sampling a row by itself)."""
        return LogitAdjuster([self.rows[index]])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted copy of ``logits`` (N, V) float32; rows without adjustments are unchanged."""
        if not self._active:
            return logits
        out = logits.clone()
        vocab = out.shape[-1]
        for i in self._active:
            ctx = self.rows[i]
            p = ctx.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                bias = torch.tensor([b for t, b in p.logit_bias.items() if t < vocab], dtype=out.dtype)
                out[i].index_add_(0, ids.to(out.device), bias.to(out.device))
            if len(ctx.output_token_ids) < p.min_tokens:
                stops = [t for t in (p.stop_token_ids or []) if t < vocab]
                if not p.ignore_eos:
                    stops += [t for t in ctx.eos_token_ids if t < vocab]
                if stops:
                    out[i, stops] = float("-inf")
            if ctx.token_mask is not None and not hasattr(ctx.token_mask, "fill_bitmask"):
                ctx.token_mask(out, i)
        grammar_rows = [i for i in self._active if hasattr(self.rows[i].token_mask, "fill_bitmask")]
        if grammar_rows:  # structured output: all rows' bitmasks filled into one (R, W) tensor, applied at once
            apply_grammar_masks(out, grammar_rows, [self.rows[i].token_mask for i in grammar_rows])
        penalized = [i for i in self._active if self.rows[i].params.has_penalties]
        if penalized:
            _apply_penalties(out, [self.rows[i] for i in penalized], penalized)
        return out


def _apply_penalties(logits: torch.Tensor, rows: list[RowContext], indices: list[int]) -> None:
    """Repetition penalty over prompt and output tokens (HF's rule: a positive logit is divided by it, a
    negative one multiplied), then frequency and presence penalties over output tokens (OpenAI's rule:
    ``logit -= frequency * count + presence * (count > 0)``), in place on rows ``indices`` of ``logits`` (N, V)."""
    vocab = logits.shape[-1]
    device = logits.device
    sub = logits[indices]  # (R, V)
    counts = torch.zeros_like(sub)  # (R, V) occurrences of each token in the output
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=device)  # (R, V) in the prompt or the output
    for r, ctx in enumerate(rows):
        out_ids = torch.tensor(list(ctx.output_token_ids), dtype=torch.long, device=device)
        out_ids = out_ids[out_ids < vocab]
        counts[r].index_add_(0, out_ids, torch.ones(out_ids.shape, dtype=sub.dtype, device=device))
        if ctx.params.repetition_penalty != 1.0:
            prompt_ids = torch.tensor(list(ctx.prompt_token_ids), dtype=torch.long, device=device)
            seen[r, prompt_ids[prompt_ids < vocab]] = True
    seen |= counts > 0
    rep = torch.tensor([c.params.repetition_penalty for c in rows], dtype=sub.dtype, device=device)[:, None]
    scaled = torch.where(sub > 0, sub / rep, sub * rep)  # (R, V)
    sub = torch.where(seen, scaled, sub)
    freq = torch.tensor([c.params.frequency_penalty for c in rows], dtype=sub.dtype, device=device)[:, None]
    pres = torch.tensor([c.params.presence_penalty for c in rows], dtype=sub.dtype, device=device)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[indices] = sub
