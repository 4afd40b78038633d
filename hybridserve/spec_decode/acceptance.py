"""Which drafts a verification accepts, and the token that follows them.

A sequence with ``m`` drafts has ``m + 1`` rows of target logits: row ``j`` predicts the token after
draft ``j`` (row 0: after the pending token). Greedy: drafts are accepted while each equals the
target's argmax, and the argmax at the first mismatch (or after the last draft) follows.

Sampled: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023), which keeps the target
distribution exactly. Draft ``d`` drawn with probability ``q(d)`` is accepted with probability
``min(1, p(d) / q(d))``; on rejection the next token is drawn from ``max(0, p - q)`` renormalised; after
the last accepted draft, from ``p``. A proposer without a distribution (n-gram) proposes deterministically:
``q`` is one-hot, so ``d`` is accepted with probability ``p(d)`` and the residual is ``p`` without ``d``.
``p`` is the distribution the sampler would draw from (temperature, top-k, top-p, min-p applied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.engine.sampler import _processed_logits
from hybridserve.ops.logits import fused_argmax_logsumexp
from hybridserve.sampling_params import SamplingParams


@dataclass
class Verification:
    """One sequence's drafts to verify: ``drafts`` (m,), and with a draft model their probabilities
    ``draft_probs`` (m, V) under the same processing as the target's."""

    drafts: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    draft_probs: torch.Tensor | None = None


@dataclass
class Verdict:
    """The tokens a verification emits: accepted drafts, then the target's next token."""

    tokens: list[int]
    num_accepted: int
    rows: list[int]  # the logits row each token was predicted by (into the verification's logits)
    error: str | None = None


def verify(logits: torch.Tensor, items: list[Verification], default_generator: torch.Generator,
           argmax: torch.Tensor | None = None) -> list[Verdict]:
    """The verdict of each item; ``logits`` (sum of (m + 1), V) holds each item's rows in order, float32 or
    the model dtype exactly widened to it: the logits tokens are drawn from (penalties, biases and stop masks
    applied to row ``j`` as after the first ``j`` drafts); ``argmax`` (R,): each row's, when the caller has it."""
    greedy_argmax: list[int] | None = None
    if any(it.params.greedy for it in items):
        if argmax is None:
            fused = fused_argmax_logsumexp(logits)
            argmax = fused[0] if fused is not None else logits.argmax(dim=-1)
        greedy_argmax = argmax.tolist()  # (R,)
    verdicts: list[Verdict] = []
    offset = 0
    for it in items:
        m = len(it.drafts)
        rows = list(range(offset, offset + m + 1))
        if it.params.greedy:
            targets = greedy_argmax[offset:offset + m + 1]
            a = 0
            while a < m and it.drafts[a] == targets[a]:
                a += 1
            verdicts.append(Verdict(it.drafts[:a] + [targets[a]], a, rows[:a + 1]))
        else:
            verdicts.append(_rejection_sample(logits[offset:offset + m + 1].float(), it, rows, default_generator))
        offset += m + 1
    return verdicts


def _rejection_sample(logits: torch.Tensor, it: Verification, rows: list[int],
                      default_generator: torch.Generator) -> Verdict:
    """logits: (m + 1, V) float32 of one sequence."""
    m = len(it.drafts)
    probs = _processed_logits(logits, [it.params] * (m + 1)).softmax(-1)  # (m + 1, V)
    if not (torch.isfinite(probs).all() and bool((probs.sum(-1) > 0).all())):
        return Verdict([0], 0, rows[:1], "the sampling distribution is not finite (the logits hold nan or inf)")
    gen = it.generator or default_generator
    accepted: list[int] = []
    for j, draft in enumerate(it.drafts):
        p = probs[j]
        q_d = 1.0 if it.draft_probs is None else float(it.draft_probs[j, draft])
        p_d = float(p[draft])
        if q_d > 0 and float(torch.rand((), generator=gen)) * q_d < p_d:  # u < p(d) / q(d)
            accepted.append(draft)
            continue
        if it.draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - it.draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p and q agree: any draw from p is the same
            residual = p
        token = int(torch.multinomial(residual, 1, generator=gen)[0])
        return Verdict(accepted + [token], j, rows[:j + 1])
    token = int(torch.multinomial(probs[m], 1, generator=gen)[0])
    return Verdict(accepted + [token], m, rows[:m + 1])


def draw_drafts(logits: torch.Tensor, seqs: list, default_generator: torch.Generator
                ) -> tuple[list[int], dict[int, torch.Tensor]]:
    """One draft per row of a drafter's ``logits`` (rows, V) for ``seqs``: the argmax for greedy requests, else a
    draw from the request's processed distribution; returns the drafts and, per sampled row, that distribution
    (V,) for the rejection rule (a broken one, with nan or inf, is replaced by the uniform one)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [r for r, seq in enumerate(seqs) if not seq.params.greedy]
    dists: dict[int, torch.Tensor] = {}
    if sampled:
        probs = _processed_logits(logits[sampled], [seqs[r].params for r in sampled]).softmax(-1)  # (S, V)
        for row, r in enumerate(sampled):
            p = probs[row]
            if not torch.isfinite(p).all() or float(p.sum()) <= 0:
                p = torch.full_like(p, 1.0 / p.numel())
            tokens[r] = int(torch.multinomial(p, 1, generator=seqs[r].generator or default_generator))
            dists[r] = p
    return tokens, dists
