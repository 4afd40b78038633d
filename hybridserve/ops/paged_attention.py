"""Paged KV cache write and causal attention over a paged KV cache (GQA, sliding window, fp8).

Cache layout: (num_blocks, block_size, Hkv, Dh); token slot = block_id * block_size + offset.
Stored value = value / scale cast to the cache dtype; read back as cache.float() * scale.
Math is float32; the attention output is cast to q.dtype.
"""

from __future__ import annotations

import math

import torch

from hybridserve.ops._varlen import packed_positions

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantize(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """t: (...) -> (t / scale) in dtype; fp8 is clamped to its finite range first."""
    t = t.float() / scale
    if dtype in _FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        t = t.clamp(min=-fmax, max=fmax)
    return t.to(dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Write new K/V into their cache slots, in place.

    k, v: (T, Hkv, Dh); k_cache, v_cache: (num_blocks, block_size, Hkv, Dh) (any dtype, may be
    strided views); slot_mapping: (T,) int64 = block_id * block_size + offset, negative for a token that has no
    slot (a padding row of a captured step: not written); k_scale, v_scale: python floats.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)  # (T,)
    kept = slots >= 0  # (T,)
    if not bool(kept.all()):
        slots, k, v = slots[kept], k[kept], v[kept]
    blk, off = slots // block_size, slots % block_size  # (T,), (T,)
    k_cache[blk, off] = _quantize(k, k_scale, k_cache.dtype)  # (T, Hkv, Dh)
    v_cache[blk, off] = _quantize(v, v_scale, v_cache.dtype)  # (T, Hkv, Dh)


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                        k_scale, v_scale, sliding_window=None):
    """Reference: per-sequence, per-query loop, keys gathered token by token.

    q: (T, Hq, Dh) packed queries of S sequences (the last q_len positions of each context);
    k_cache, v_cache: (num_blocks, block_size, Hkv, Dh); block_tables: (S, max_blocks) int64;
    seq_lens: (S,) int64 context lengths incl. new tokens; cu_seqlens_q: (S+1,) int64;
    scale: softmax scale; k_scale, v_scale: dequant scales; sliding_window: None or int W.
    Returns out: (T, Hq, Dh) in q.dtype.
    """
    T, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    rep = Hq // Hkv
    out = torch.empty(T, Hq, Dh, dtype=torch.float32, device=q.device)  # (T, Hq, Dh)
    for s in range(block_tables.shape[0]):
        L = int(seq_lens[s])
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        keys, vals = [], []
        for p in range(L):
            blk = int(block_tables[s, p // bs])
            keys.append(k_cache[blk, p % bs].float() * k_scale)  # (Hkv, Dh)
            vals.append(v_cache[blk, p % bs].float() * v_scale)  # (Hkv, Dh)
        K = torch.stack(keys).repeat_interleave(rep, dim=1)  # (L, Hq, Dh)
        V = torch.stack(vals).repeat_interleave(rep, dim=1)  # (L, Hq, Dh)
        for i, t in enumerate(range(q0, q1)):
            qpos = L - (q1 - q0) + i
            lo = 0 if sliding_window is None else max(0, qpos - sliding_window + 1)
            Kq, Vq = K[lo:qpos + 1], V[lo:qpos + 1]  # (n, Hq, Dh)
            scores = torch.einsum("hd,nhd->hn", q[t].float(), Kq) * scale  # (Hq, n)
            probs = torch.softmax(scores, dim=-1)  # (Hq, n)
            out[t] = torch.einsum("hn,nhd->hd", probs, Vq)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# fast path
# ----------------------------------------------------------------------------------------------


def _gather_kv(cache, block_tables, n_blocks, scale):
    """cache: (num_blocks, bs, Hkv, Dh); block_tables: (S, max_blocks) ->
    float32 (S, n_blocks*bs, Hkv, Dh) = the first n_blocks blocks of every sequence, dequantized."""
    S = block_tables.shape[0]
    blocks = block_tables[:, :n_blocks].to(device=cache.device, dtype=torch.long)  # (S, nb)
    kv = cache[blocks].float()  # (S, nb, bs, Hkv, Dh)
    kv = kv.view(S, n_blocks * cache.shape[1], cache.shape[2], cache.shape[3])  # (S, Lpad, Hkv, Dh)
    return kv * scale if scale != 1.0 else kv


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                    k_scale, v_scale, sliding_window=None):
    """Fast path: gather all sequences' blocks into a padded batch, one masked batched
    matmul + softmax, unpad. Decode (one query per sequence) takes a cheaper branch.

    Arguments and results: as ``paged_attention_ref``.
    """
    T, Hq, Dh = q.shape
    S = block_tables.shape[0]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    R = Hq // Hkv
    dev = q.device
    seq_lens = seq_lens.to(device=dev, dtype=torch.long)  # (S,)
    Lmax = int(seq_lens.max())
    nb = -(-Lmax // bs)
    K = _gather_kv(k_cache, block_tables, nb, k_scale)  # (S, Lpad, Hkv, Dh)
    V = _gather_kv(v_cache, block_tables, nb, v_scale)  # (S, Lpad, Hkv, Dh)
    Lpad = K.shape[1]
    kpos = torch.arange(Lpad, device=dev)  # (Lpad,)
    # Positions past a sequence's length hold whatever bytes the shared pool has there (another
    # sequence's state, say), which may read as NaN/inf in the KV dtype (any 0x7F byte is NaN in
    # fp8_e4m3): their probabilities are 0, but 0 * NaN is NaN, so clear them. So too the positions before
    # every query's window: their pages may have been released (a window page group's table then names
    # any page there).
    unread = kpos[None, :] >= seq_lens[:, None]  # (S, Lpad)
    if sliding_window is not None:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(device=dev, dtype=torch.long)  # (S,)
        unread |= kpos[None, :] < (seq_lens - q_lens - sliding_window + 1)[:, None]
    V = V.masked_fill(unread[:, :, None, None], 0.0)  # (S, Lpad, Hkv, Dh)

    if T == S:  # every sequence has exactly one query (each has >= 1): decode
        qf = q.float().view(S, Hkv, R, Dh)  # (S, Hkv, R, Dh)
        scores = torch.einsum("skrd,slkd->skrl", qf, K) * scale  # (S, Hkv, R, Lpad)
        qpos = seq_lens - 1  # (S,)
        mask = kpos[None, :] <= qpos[:, None]  # (S, Lpad)
        if sliding_window is not None:
            mask &= kpos[None, :] > (qpos - sliding_window)[:, None]
        scores = scores.masked_fill(~mask[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)  # (S, Hkv, R, Lpad)
        out = torch.einsum("skrl,slkd->skrd", probs, V)  # (S, Hkv, R, Dh)
        return out.reshape(S, Hq, Dh).to(q.dtype)

    _, q_lens, seq_id, qi = packed_positions(cu_seqlens_q, T, dev)  # qi: index among the seq's queries
    Qmax = int(q_lens.max())
    q_pad = torch.zeros(S, Qmax, Hq, Dh, dtype=torch.float32, device=dev)  # (S, Qmax, Hq, Dh)
    q_pad[seq_id, qi] = q.float()

    qpos = (seq_lens - q_lens)[:, None] + torch.arange(Qmax, device=dev)  # (S, Qmax)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # (S, Qmax, Lpad)
    if sliding_window is not None:
        mask &= kpos[None, None, :] > (qpos - sliding_window)[:, :, None]
    mask[:, :, 0] |= ~mask.any(dim=-1)  # padded query rows: keep one key so softmax has no NaN

    qh = q_pad.view(S, Qmax, Hkv, R, Dh).permute(0, 2, 3, 1, 4)  # (S, Hkv, R, Qmax, Dh)
    kh = K.permute(0, 2, 1, 3)[:, :, None]  # (S, Hkv, 1, Lpad, Dh)
    vh = V.permute(0, 2, 1, 3)[:, :, None]  # (S, Hkv, 1, Lpad, Dh)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (S, Hkv, R, Qmax, Lpad)
    scores = scores.masked_fill(~mask[:, None, None], -math.inf)
    probs = torch.softmax(scores, dim=-1)  # (S, Hkv, R, Qmax, Lpad)
    out = torch.matmul(probs, vh)  # (S, Hkv, R, Qmax, Dh)
    out = out.permute(0, 3, 1, 2, 4).reshape(S, Qmax, Hq, Dh)  # (S, Qmax, Hq, Dh)
    return out[seq_id, qi].to(q.dtype)  # (T, Hq, Dh)
