"""Metadata of one batched forward step, built once per step as tensors.

The scheduled sequences are ordered decodes first (one new token each), then prefills (one chunk
each). Layers read two :class:`SeqGroup` views: ``decode`` and ``prefill``; each carries token
offsets into the packed ``(T, ...)`` activations and per-sequence tensors for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.cache.pool import LayerCache


@dataclass
class SeqGroup:
    """A contiguous run of sequences in the packed batch."""

    token_start: int
    token_end: int
    cu_seqlens_q: torch.Tensor  # (S+1,) int64, local to the group
    seq_lens: torch.Tensor  # (S,) int64 context length after this step
    # positions in the pool's views, translated from the handles sequences hold (cache/handle_map.py)
    block_tables: torch.Tensor | None  # (S, max_blocks) int64 page positions, or None without attention
    state_indices: torch.Tensor | None  # (S,) int64 slot positions, or None without state
    window_block_tables: torch.Tensor | None = None  # (S, max_blocks) the window page group's, or None
    # leading sequences whose tokens are all generated ones (speculative verifications, reruns after a rejected
    # draft): a layer whose prefill and decode rules differ (Mamba2's dt clamp) gives them the decode rule, as
    # decoding them one by one would
    num_generated: int = 0
    # (S,) int64 rounding keys of 8-bit recurrent state (cache/state_codec.py: the request's seed, 0 when unset);
    # None: every key is 0
    rounding_keys: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def tokens(self) -> slice:
        return slice(self.token_start, self.token_end)

    def split(self, n: int) -> tuple["SeqGroup", "SeqGroup"]:
        """The group's first ``n`` sequences and the rest, as two groups over the same tokens."""
        cut = int(self.cu_seqlens_q[n])

        def rows(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
            return None if t is None else t[part]

        head, tail = slice(0, n), slice(n, None)
        first = SeqGroup(self.token_start, self.token_start + cut, self.cu_seqlens_q[:n + 1], self.seq_lens[head],
                         rows(self.block_tables, head), rows(self.state_indices, head),
                         rows(self.window_block_tables, head), min(self.num_generated, n),
                         rows(self.rounding_keys, head))
        rest = SeqGroup(self.token_start + cut, self.token_end, self.cu_seqlens_q[n:] - cut, self.seq_lens[tail],
                        rows(self.block_tables, tail), rows(self.state_indices, tail),
                        rows(self.window_block_tables, tail), max(0, self.num_generated - n),
                        rows(self.rounding_keys, tail))
        return first, rest


@dataclass
class ForwardBatch:
    """Everything a model forward needs beyond token ids and positions."""

    slot_mapping: torch.Tensor | None  # (T,) int64 KV write rows: page position * block_size + offset
    decode: SeqGroup | None
    prefill: SeqGroup | None
    caches: dict[int, LayerCache] = field(default_factory=dict)
    window_slot_mapping: torch.Tensor | None = None  # (T,) the window page group's KV write positions, or None

    @property
    def groups(self) -> list[SeqGroup]:
        return [g for g in (self.decode, self.prefill) if g is not None]
