"""Shared helpers for the op tests: caches built as strided views into a larger byte buffer, and
the prefill-then-decode check of a recurrent op (varlen scan + single-token update)."""

from __future__ import annotations

import math

import pytest
import torch

SENTINEL = 0xA5  # byte pattern of buffer bytes that belong to no view


class StridedCaches:
    """Several same-shaped caches interleaved page by page in one uint8 buffer, like a pool page
    that holds more than one tensor: slot i of view j lives at byte offset
    base + i * page + j * tensor_bytes, and `gap` elements of foreign bytes follow every slot."""

    def __init__(self, shape, dtype, n_views=1, gap=3, base=5):
        self.shape, self.dtype = tuple(shape), dtype
        es = torch.empty((), dtype=dtype).element_size()
        per = math.prod(self.shape[1:])  # elements of one slot
        self.slot_elems = per + gap  # stride between slots of one view, in elements
        self.page_elems = self.slot_elems * n_views  # one page holds a slot of every view
        self.base_elems = base
        total = (base + self.page_elems * self.shape[0] + 2) * es
        self.buf = torch.full((total,), SENTINEL, dtype=torch.uint8)  # (bytes,)
        self.owned = torch.zeros(total, dtype=torch.bool)  # bytes that belong to a view
        self.views = [self._view(j) for j in range(n_views)]
        for v in self.views:
            self.owned |= self._owned_mask(v)

    def _strides(self):
        inner = [1]
        for d in reversed(self.shape[2:]):
            inner.insert(0, inner[0] * d)
        return (self.page_elems, *inner)

    def _view(self, j):
        typed = self.buf.view(self.dtype)  # (total / es,)
        offset = self.base_elems + j * self.slot_elems
        return typed.as_strided(self.shape, self._strides(), offset)

    def _owned_mask(self, view):
        es = view.element_size()
        marker = torch.zeros(self.buf.numel() // es, dtype=torch.bool)
        marker.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        return marker.repeat_interleave(es)

    def fresh_view(self, j=0):
        """Re-read view j from the buffer (proves writes landed in the shared bytes)."""
        return self._view(j)

    def foreign_bytes_intact(self) -> bool:
        return bool((self.buf[~self.owned] == SENTINEL).all())

    def random_state(self):
        """Fill every view with random values of the dtype (view 0 first) and remember them: the state
        an in-place update op starts from. Returns view 0 (never contiguous), for the op under test,
        and a contiguous copy of it, for the reference op."""
        assert not self.views[0].is_contiguous()
        for v in self.views:
            v.copy_(torch.randn(self.shape).to(self.dtype))
        self.before = [v.clone() for v in self.views]
        return self.views[0], self.before[0].clone()

    def assert_updated_like(self, cache_ref, written, tol=(0.0, 0.0)):
        """After the op under test updated slots `written` of view 0 in place (from `random_state`) and
        the reference op did the same to cache_ref: view 0, re-read from the byte buffer, matches
        cache_ref within tol = (rtol, atol) and equals it exactly in every other slot; the other views
        and every byte outside the views are unchanged. Returns the re-read view 0."""
        fresh = self.fresh_view(0)
        assert fresh.dtype == self.dtype
        rtol, atol = tol
        torch.testing.assert_close(fresh.float(), cache_ref.float(), rtol=rtol, atol=atol)
        untouched = torch.ones(self.shape[0], dtype=torch.bool)  # (num_slots,)
        untouched[written] = False
        assert torch.equal(fresh[untouched], cache_ref[untouched])
        for j in range(1, len(self.views)):
            assert torch.equal(self.fresh_view(j), self.before[j])
        assert self.foreign_bytes_intact()
        return fresh


@pytest.fixture
def strided_caches():
    return StridedCaches


TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


@pytest.fixture
def tol():
    """tol(dtype) -> (rtol, atol) for values stored in / computed through `dtype`."""
    return TOLERANCES.__getitem__


def assert_close_rel(a, b, rtol):
    """Max abs error relative to the reference's scale (fp32 chunked vs sequential sums)."""
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


class PrefillThenDecode:
    """Scan the prompts, store final states in a cache of state_dtype, decode the rest token by
    token with the update op: equals one scan of the whole sequences (float32 state: ~exact;
    otherwise the stored state is rounded once per step: errors relative to the state's scale)."""

    prompt, extra = [1, 7, 33], [5, 3, 6]  # tokens of each sequence: prefilled, then decoded
    slots = torch.tensor([2, 0, 3])  # each sequence's slot in a cache of 4
    num_tokens = sum(prompt) + sum(extra)  # of the full sequences, packed

    def __call__(self, scan, update, state_shape, state_dtype):
        """scan(t, cu_seqlens) -> (out, final_states): the varlen scan, from zero states, of tokens t
        (T,) of the packed full sequences, split by cu_seqlens (S+1,); update(cache, t, slots) -> out:
        one decode step of tokens t (B,), in place into slots (B,) of cache (num_slots, *state_shape)."""
        prompt, extra, slots = self.prompt, self.extra, self.slots
        S = len(prompt)
        cu = torch.tensor([0] + [p + e for p, e in zip(prompt, extra)]).cumsum(0)  # (S+1,)
        out_full, fin_full = scan(torch.arange(self.num_tokens), cu)
        pre = torch.cat([torch.arange(int(cu[s]), int(cu[s]) + prompt[s]) for s in range(S)])
        _, fin_pre = scan(pre, torch.tensor([0] + prompt).cumsum(0))
        cache = torch.zeros(4, *state_shape, dtype=state_dtype)  # (num_slots, *state_shape)
        cache[slots] = fin_pre.to(state_dtype)
        out_dec = torch.empty_like(out_full)
        for step in range(max(extra)):
            live = [s for s in range(S) if step < extra[s]]
            t = torch.tensor([int(cu[s]) + prompt[s] + step for s in live])  # (B,) token ids
            out_dec[t] = update(cache, t, slots[live])
        dec = torch.cat([torch.arange(int(cu[s]) + prompt[s], int(cu[s + 1])) for s in range(S)])
        assert cache.dtype == state_dtype
        rtol = 1e-5 if state_dtype == torch.float32 else 4 * TOLERANCES[state_dtype][0]
        assert_close_rel(out_dec[dec], out_full[dec], rtol)
        assert_close_rel(cache[slots].float(), fin_full, rtol)


@pytest.fixture
def prefill_then_decode():
    """prefill_then_decode(scan, update, state_shape, state_dtype): see PrefillThenDecode."""
    return PrefillThenDecode()
