"""Token bitmasks: one bit per vocabulary entry, 32 tokens to an int32 word (bit ``j`` of word ``k`` is token
``32 k + j``, set when the token is allowed), the layout grammar engines fill. Applied by llguidance's own
CPU kernel (``llguidance.torch.apply_token_bitmask_inplace``).
"""

from __future__ import annotations

import torch
from llguidance.torch import apply_token_bitmask_inplace


def words_for(vocab_size: int) -> int:
    """int32 words of a bitmask row covering ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the disallowed tokens of ``logits`` (N, V) float to -inf in place: row ``rows[r]`` (or ``r``) by
    ``bitmask[r]`` ((R, W) int32, little-endian words). Tokens past ``32 W`` are disallowed."""
    bitmask = bitmask.contiguous()
    if rows is None:
        apply_token_bitmask_inplace(logits, bitmask)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index)  # (R, V)
    apply_token_bitmask_inplace(picked, bitmask.to(logits.device))
    logits.index_copy_(0, index, picked)
