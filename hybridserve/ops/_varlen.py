"""Packed variable-length batches: the tokens of S sequences concatenated along one axis (T),
sequence s holding packed tokens cu_seqlens[s] .. cu_seqlens[s+1]-1."""

from __future__ import annotations

import torch


def packed_positions(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device):
    """Where every packed token sits: packed token i is position pos[i] of sequence seq_id[i].

    cu_seqlens: (S+1,) -> cu (S+1,) int64 on device, lens (S,), seq_id (T,), pos (T,); T = num_tokens.
    """
    cu = cu_seqlens.to(device=device, dtype=torch.long)  # (S+1,)
    lens = cu[1:] - cu[:-1]  # (S,)
    seq_id = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=num_tokens)  # (T,)
    pos = torch.arange(num_tokens, device=device) - cu[seq_id]  # (T,)
    return cu, lens, seq_id, pos


def chunk_grid(lens: torch.Tensor, chunk_size: int) -> tuple[int, int]:
    """(l, nc): the chunk length (one short chunk when every sequence fits in it) and chunks per padded sequence."""
    longest = int(lens.max()) if lens.numel() else 0
    l = max(min(chunk_size, longest), 1)
    return l, -(-longest // l)


def pad_to_chunks(t: torch.Tensor, seq_id: torch.Tensor, pos: torch.Tensor, num_seqs: int, nc: int,
                  l: int) -> torch.Tensor:
    """Packed (T, H, ...) -> float32 (S, H, nc, l, ...), zeros past each sequence's end."""
    out = torch.zeros(num_seqs, nc * l, *t.shape[1:], dtype=torch.float32, device=t.device)
    out[seq_id, pos] = t
    out = out.view(num_seqs, nc, l, *t.shape[1:])
    return out.permute(0, 3, 1, 2, *range(4, out.dim()))
