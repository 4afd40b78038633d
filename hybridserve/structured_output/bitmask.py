"""Token bitmasks: one bit per vocabulary entry, 32 tokens to an int32 word (bit ``j`` of word ``k`` is token
``32 k + j``, set when the token is allowed), the layout grammar engines fill.

A mask is applied by adding 0 or -inf to each logit, read from a 256-entry table (one row of eight floats per
mask byte): a gather and an add, with no data-dependent branch (torch's ``masked_fill`` slows down several times on
masks with unpredictable bits). ``x + 0.0 == x`` and ``x + -inf == -inf`` for every finite ``x``.
"""

from __future__ import annotations

import torch

_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def words_for(vocab_size: int) -> int:
    """int32 words of a bitmask row covering ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): for each byte value, 0 where its bit ``i`` (least significant first) is set, else -inf."""
    table = _BIAS_TABLES.get((device, dtype))
    if table is None:
        values = torch.arange(256)
        bits = ((values[:, None] >> torch.arange(8)) & 1).bool()  # (256, 8)
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(~bits, float("-inf")).to(device)
        _BIAS_TABLES[(device, dtype)] = table
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the disallowed tokens of ``logits`` (N, V) float to -inf in place: row ``rows[r]`` (or ``r``) by
    ``bitmask[r]`` ((R, W) int32, little-endian words). Tokens past ``32 W`` are disallowed."""
    num_rows, words = bitmask.shape
    vocab = logits.shape[-1]
    device = logits.device
    as_bytes = bitmask.contiguous().view(torch.uint8).view(-1).to(device)  # (4RW,): byte m holds tokens 8m..8m+7
    bias = _bias_table(device, logits.dtype).index_select(0, as_bytes.long()).view(num_rows, words * 32)  # (R, 32W)
    covered = min(vocab, words * 32)
    bias = bias[:, :covered]  # (R, covered)
    if rows is None:
        logits[:, :covered] += bias
        logits[:, covered:] = float("-inf")
    else:
        index = torch.tensor(rows, dtype=torch.long, device=device)
        logits[:, :covered].index_add_(0, index, bias)
        if covered < vocab:
            logits[index, covered:] = float("-inf")
