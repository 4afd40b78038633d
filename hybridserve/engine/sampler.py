"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.engine.logit_adjust import LogitAdjuster
from hybridserve.ops.logits import fused_argmax_logsumexp
from hybridserve.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    sampled_logprobs: list[float]  # log-probability of each sampled token (raw model distribution)
    sampled_ranks: list[int]  # 1-based rank of each sampled token (0 unless its request asks for logprobs)
    top_ids: list[list[int]]  # per row, the top-k token ids (k = that request's logprobs), best first
    top_logprobs: list[list[float]]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled (its token is 0)


def _processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row by row params, batched. logits: (N, V) float32."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    logits = logits / temps[:, None]
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
        sorted_desc = logits.sort(dim=-1, descending=True).values  # (N, V)
        kth = sorted_desc.gather(1, (ks - 1)[:, None])  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)  # (N, V)
        drop_sorted = cum <= (1 - top_ps[:, None])
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_ps[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator, adjust: LogitAdjuster | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` (N, V) under each row's params: float32, or a lower precision
    whose exact float32 widening they are (the model dtype, before ``.float()``).

    With the kernels on (``ops.dispatch.use_kernels``), the argmax and logsumexp come from one compiled pass
    over the logits (greedy rows without logprobs straight from lower-precision logits, with no float32 copy).
    ``adjust``: penalties, biases and masks on the logits tokens are drawn from (not on reported logprobs)."""
    if adjust is not None and not adjust:
        adjust = None
    fused = fused_argmax_logsumexp(logits, with_max=True) if adjust is None else None
    only_greedy_ids = all(p.greedy and p.logprobs is None for p in params)
    if fused is not None and only_greedy_ids:  # the sampled logit is each row's maximum: no torch op needed
        idx, lse, mx = fused
        sampled = (mx.numpy() - lse.numpy()).tolist()  # float32 subtraction, as sampled_logit - lse below
        return SampleResult(idx.tolist(), sampled, [0] * len(params), [[] for _ in params], [[] for _ in params])
    if logits.dtype != torch.float32 and (fused is None or not only_greedy_ids):
        logits = logits.float()  # exact; sampling, ranks and top-k below work in float32
    draw_from = adjust(logits) if adjust is not None else logits  # (N, V) float32
    chosen = fused[0] if fused is not None else draw_from.argmax(dim=-1)  # (N,)
    errors: dict[int, str] = {}
    if adjust is not None:
        for row in torch.isneginf(draw_from).all(-1).nonzero()[:, 0].tolist():
            errors[row] = "no token is allowed: every token of the vocabulary is masked"
    if not all(p.greedy for p in params):
        probs = _processed_logits(draw_from, params).softmax(-1).cpu()  # (N, V)
        valid = (torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)).tolist()  # (N,) a distribution to draw from
        picks = chosen.cpu().clone()
        for row, p in enumerate(params):
            if p.greedy or row in errors:
                continue
            if not valid[row]:
                errors[row] = "the sampling distribution is not finite (the logits hold nan or inf)"
                picks[row] = 0
                continue
            gen = generators[row] or default_generator
            picks[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
        chosen = picks.to(logits.device)
    fused_lse = fused[1] if fused is not None else None
    return report(logits, chosen, params, fused_lse, errors)


def report(logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams],
           lse: torch.Tensor | None = None, errors: dict[int, str] | None = None) -> SampleResult:
    """The :class:`SampleResult` of tokens ``chosen`` (N,) drawn for the rows of ``logits`` (N, V) float32.

    Log-probabilities of the raw distribution, reported to users: the chosen token's always (one
    logsumexp per row, unless ``lse`` (N,) is given); ranks and top-k only when a request asks for logprobs."""
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
    sampled_logit = logits.gather(1, chosen[:, None])[:, 0]  # (N,)
    sampled_lp = sampled_logit - lse  # (N,)
    max_k = max((p.logprobs or 0) for p in params)
    wants = any(p.logprobs is not None for p in params)
    ranks = ((logits > sampled_logit[:, None]).sum(-1) + 1).tolist() if wants else [0] * len(params)
    top_ids: list[list[int]] = [[] for _ in params]
    top_lps: list[list[float]] = [[] for _ in params]
    if max_k > 0:
        values, ids = logits.topk(max_k, dim=-1)  # (N, k)
        value_rows, id_rows = (values - lse[:, None]).tolist(), ids.tolist()
        for row, p in enumerate(params):
            k = p.logprobs or 0
            top_ids[row], top_lps[row] = id_rows[row][:k], value_rows[row][:k]
    return SampleResult(chosen.tolist(), sampled_lp.tolist(), ranks, top_ids, top_lps, errors or {})


def sample_rows_alone(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                      default_generator: torch.Generator, adjust: LogitAdjuster | None = None) -> SampleResult:
    """:func:`sample` row by row, after the batched call raised: a row that raises alone is reported in
    ``errors`` (token 0) and the others are sampled as usual."""
    merged = SampleResult([], [], [], [], [], {})
    for row in range(logits.shape[0]):
        try:
            one = sample(logits[row:row + 1], params[row:row + 1], generators[row:row + 1], default_generator,
                         adjust.row(row) if adjust is not None else None)
        except Exception as exc:  # noqa: BLE001 - contained to this row's request
            one = SampleResult([0], [0.0], [0], [[]], [[]], {0: f"sampling failed: {type(exc).__name__}: {exc}"})
        merged.token_ids += one.token_ids
        merged.sampled_logprobs += one.sampled_logprobs
        merged.sampled_ranks += one.sampled_ranks
        merged.top_ids += one.top_ids
        merged.top_logprobs += one.top_logprobs
        if one.errors:
            merged.errors[row] = one.errors[0]
    return merged
