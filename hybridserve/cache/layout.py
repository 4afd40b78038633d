"""Byte layout of one KV page and one state slot, computed from layer specs.

A **KV page** holds ``block_size`` tokens of K and V for *every* attention layer, so one block
table per sequence serves all attention layers. A **state slot** holds one sequence's recurrent
state for *every* state layer (an 8-bit state tensor as its codes, then its bfloat16 row scales:
cache/state_codec.py). Inside a page or slot each tensor starts at a multiple of
``ALIGN`` bytes, so every typed view is aligned whatever the mix of dtypes (fp8 KV beside
float32 SSM state and bf16 conv state, say).

Worked example (a Bamba-like model in bf16 with float32 SSM state; 2 attention layers with 8 KV
heads of 128, 2 Mamba2 layers with conv_dim 6144, kernel 4, 64 heads x 64 x 128 state):

* KV page, block_size 16: per layer K = 16*8*128*2 B = 32,768 B, V the same, so a page is
  2 layers * 65,536 B = 131,072 B (64 KiB per layer, 8,192 B per token across layers).
* State slot: conv 6144*3*2 B = 36,864 B, ssm 64*64*128*4 B = 2,097,152 B per layer, so a slot is
  2 * 2,134,016 B = 4,268,032 B. Both are already multiples of 64, so padding is 0 B.

Sliding-window layers beside full-attention ones (LFM3) form a second **page group**: their K/V are
placed from byte 0 of a page too, over the full layers' bytes, and a page belongs to one group at a
time. A sequence then holds two block tables (``block_table`` for the full layers, ``window_table``
for the window layers), and the window group's pages behind the window go back to the pool while it
runs (docs/sliding_window.md). A page is as large as the larger group. A model whose attention layers
are all windowed (or all full) keeps one group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridserve.cache.spec import DType, LayerCacheSpec, dtype_size

ALIGN = 64


def align_up(n: int, alignment: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorPlacement:
    """Where one typed tensor lives inside a page or a slot."""

    layer: int
    name: str
    offset: int  # bytes from the start of the page / slot
    shape: tuple[int, ...]  # per page (KV) or per slot (state)
    dtype: DType  # a torch dtype (the engine) or its name (a plan)
    group: int = 0  # KV page group: 0 full attention, 1 sliding window (state tensors: 0)
    shard_offset: int = 0  # a state tensor's StateTensorSpec.shard_offset (tensor parallelism)
    exponent_scales: bool = False  # a conv state's StateTensorSpec.exponent_scales (how its 8-bit codes are scaled)
    rounding: str = "stochastic"  # StateTensorSpec.rounding (how 8-bit codes of a temporal state are rounded)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class PoolLayout:
    """Placement of every cached tensor inside a KV page and inside a state slot."""

    block_size: int
    page_bytes: int
    slot_bytes: int
    kv_placements: tuple[TensorPlacement, ...]
    state_placements: tuple[TensorPlacement, ...]
    window: int | None = None  # tokens the window page group keeps (its largest window); None: one group

    @property
    def kv_bytes_per_token(self) -> int:
        """Exact K+V bytes of one token over all attention layers (no padding)."""
        return sum(p.nbytes for p in self.kv_placements) // max(self.block_size, 1)

    @property
    def window_kv_bytes_per_token(self) -> int:
        """Exact K+V bytes of one token over the window page group's layers (0 without one)."""
        return sum(p.nbytes for p in self.kv_placements if p.group == 1) // max(self.block_size, 1)

    @property
    def has_window(self) -> bool:
        """Whether sliding-window layers hold pages of their own (a second page group)."""
        return self.window is not None

    @property
    def state_bytes_per_sequence(self) -> int:
        """Exact recurrent-state bytes of one sequence over all state layers (no padding)."""
        return sum(p.nbytes for p in self.state_placements)

    @property
    def has_kv(self) -> bool:
        return self.page_bytes > 0

    @property
    def has_state(self) -> bool:
        return self.slot_bytes > 0


def compute_layout(specs: list[LayerCacheSpec], block_size: int) -> PoolLayout:
    """Place every layer's tensors into one page layout and one slot layout (window layers in a page group
    of their own when full-attention layers are there too)."""
    attention = [s.attention for s in specs if s.attention is not None]
    windows = [a.sliding_window for a in attention if a.sliding_window is not None]
    window = max(windows) if windows and len(windows) < len(attention) else None
    kv: list[TensorPlacement] = []
    state: list[TensorPlacement] = []
    page_off = [0, 0]  # per page group
    slot_off = 0
    for spec in specs:
        if spec.attention is not None:
            a = spec.attention
            group = 1 if window is not None and a.sliding_window is not None else 0
            for name in a.tensor_names:  # K and V, or MLA's one latent
                p = TensorPlacement(spec.index, name, page_off[group], (block_size, a.num_kv_heads, a.head_size),
                                    a.dtype, group)
                kv.append(p)
                page_off[group] = align_up(page_off[group] + p.nbytes)
        for t in spec.state:
            p = TensorPlacement(spec.index, t.name, slot_off, t.shape, t.dtype, shard_offset=t.shard_offset,
                                exponent_scales=t.exponent_scales, rounding=t.rounding)
            state.append(p)
            slot_off = align_up(slot_off + p.nbytes)
            if t.coded:  # 8-bit codes: their scales follow them in the slot
                p = TensorPlacement(spec.index, t.scale_name, slot_off, t.scale_shape, t.scale_dtype)
                state.append(p)
                slot_off = align_up(slot_off + p.nbytes)
    return PoolLayout(block_size, max(page_off), slot_off, tuple(kv), tuple(state), window)


def kv_slot(table: list[int], position: int, block_size: int) -> int:
    """The KV cache row (page * block_size + offset) of token ``position`` of a sequence whose pages are
    ``table`` (its block table, or its window table)."""
    return table[position // block_size] * block_size + position % block_size


def kv_slots(table: list[int], positions, block_size: int) -> list[int]:
    """The KV cache rows (page * block_size + offset) of token ``positions`` of a sequence whose pages are
    ``table`` (its block table, or its window table)."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]
