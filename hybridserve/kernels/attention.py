"""Python entry points of the C++ paged-attention kernels (``csrc/attention.cpp``) for the CPU.

Both decline (return False, doing nothing) when the call is one they do not cover: not on the CPU,
an fp8 cache, a layout or dtype they do not take, or no compiled library.
"""

from __future__ import annotations

import torch

from hybridserve.kernels._abi import DTYPE_CODES, bind, check, index_ok, rows_ok


def _library():
    return bind("attention")


def available() -> bool:
    """Whether the compiled kernels can be used in this process."""
    return _library() is not None


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(block_size, block_stride, token_stride, head_stride) shared by both caches, or None."""
    if (k_cache.device.type != "cpu" or k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape
            or k_cache.stride() != v_cache.stride() or k_cache.dim() != 4 or k_cache.stride(3) != 1):
        return None
    return k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Store k, v (T, Hkv, Dh) at their slots (T,) of the paged caches (num_blocks, bs, Hkv, Dh) as
    ``value / scale`` in the cache dtype, in place. Returns False, doing nothing, when not covered."""
    lib = _library()
    geom = cache_geometry(k_cache, v_cache)
    if lib is None or geom is None or k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        return False
    T, Hkv, Dh = k.shape
    k2, v2 = k.reshape(T, Hkv * Dh), v.reshape(T, Hkv * Dh)
    act, ct = DTYPE_CODES.get(k.dtype), DTYPE_CODES.get(k_cache.dtype)
    if (act is None or ct is None or not rows_ok(k2) or not rows_ok(v2) or tuple(k_cache.shape[2:]) != (Hkv, Dh)
            or k2.data_ptr() != k.data_ptr() or v2.data_ptr() != v.data_ptr() or not index_ok(slot_mapping)
            or slot_mapping.numel() != T):
        return False
    check(lib.hs_kv_write(act, ct, T, slot_mapping.data_ptr(), k2.data_ptr(), k2.stride(0), v2.data_ptr(),
                          v2.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *geom, Hkv, Dh, float(k_scale),
                          float(v_scale)), "hs_kv_write")
    return True


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float, k_scale: float,
                    v_scale: float, sliding_window: int | None, out: torch.Tensor) -> bool:
    """Causal attention of q (T, Hq, Dh) over each sequence's cached context into out (T, Hq, Dh),
    both in q's dtype; arguments as ``hybridserve.ops.paged_attention.paged_attention``. Returns False,
    doing nothing, when not covered."""
    lib = _library()
    geom = cache_geometry(k_cache, v_cache)
    if lib is None or geom is None or q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype:
        return False
    T, Hq, Dh = q.shape
    q2, o2 = q.reshape(T, Hq * Dh), out.view(T, Hq * Dh) if out.is_contiguous() else None
    act, ct = DTYPE_CODES.get(q.dtype), DTYPE_CODES.get(k_cache.dtype)
    if (act is None or ct is None or o2 is None or not rows_ok(q2) or q2.data_ptr() != q.data_ptr()
            or k_cache.shape[3] != Dh or Hq % k_cache.shape[2] != 0 or not index_ok(block_tables)
            or block_tables.dim() != 2 or not index_ok(seq_lens) or not index_ok(cu_seqlens_q)):
        return False
    check(lib.hs_paged_attention(act, ct, seq_lens.numel(), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(),
                                 block_tables.data_ptr(), block_tables.stride(0), q2.data_ptr(), q2.stride(0),
                                 k_cache.data_ptr(), v_cache.data_ptr(), *geom, o2.data_ptr(), o2.stride(0), Hq,
                                 k_cache.shape[2], Dh, float(scale), float(k_scale), float(v_scale),
                                 int(sliding_window or 0)), "hs_paged_attention")
    return True
