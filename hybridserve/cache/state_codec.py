"""8-bit recurrent state: the codes, their row scales and seeded stochastic rounding (plain PyTorch).

A temporal state tensor of shape ``(*rows, n)`` stored in 8 bits is two tensors: ``codes`` ``(*rows, n)`` in
the code dtype (``int8`` or ``float8_e4m3fn``) and ``scale`` ``(*rows,)`` bfloat16, one per state row (the last
axis is the row). A value is ``codes.float() * scale.float()``. Encoding a row picks ``scale = max|x| /
code_max`` (``code_max`` 127 for int8, 448 for e4m3) rounded UP to bfloat16, so that ``max|x| / scale`` stays
within the code range; the codes are computed against that stored scale: ``x * (1 / scale)`` is rounded to the
code grid stochastically, down or up with the probability that keeps the mean exact. A row of zeros gets scale
0 and zero codes.

The rounding noise is a counter-based hash, not a random generator, so a run is reproducible and independent of
batch composition and slot placement: the uniform number for element ``e`` (flat index within one sequence's
state tensor) of layer ``layer`` of a sequence with rounding key ``key`` (the request's seed, 0 when unset) whose
state has absorbed ``position`` tokens is :func:`uniform_noise`: one 32-bit hash gives the 8-bit uniforms of 4
consecutive elements. The CPU kernels compute the same hash, so the kernel and this reference agree code for
code given the same float values.

This module is the reference every 8-bit state path (plain bodies and C++ kernels) is tested against.
"""

from __future__ import annotations

import torch

from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.cache.slots import CodedSlots

__all__ = ["CODED_VIEWS", "CODE_DTYPES", "CODE_MAX", "NEAREST_NOISE", "SCALE_DTYPE", "CodedState", "StateView",
           "code_dtype", "decode_rows", "encode_rows", "hash32", "has_coded_state", "nearest_noise", "rounding_key",
           "row_keys", "scale_up", "uniform_noise"]

#: option name -> the torch dtype of the codes
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
#: the largest code magnitude of each code dtype
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: the dtype of the row scales (cache/dtypes.py: STATE_SCALE_DTYPE names it)
SCALE_DTYPE = torch.bfloat16
#: the elements that share one 32-bit noise hash (a byte each)
NOISE_ELEMENTS_PER_HASH = 4
#: the uniform number of every element of a state rounded to nearest: the noise byte 128, (128 + 0.5) / 256 (the
#: noise's grid holds no 0.5: a code is floor(v + 0.502), so values 0.002 of a step below a tie round up too)
NEAREST_NOISE = 128.5 / 256

_MASK32 = 0xFFFFFFFF
_FP8_E4M3_MIN_NORMAL_EXP = -6  # 2**-6, the smallest normal e4m3 magnitude
_FP8_E4M3_MANTISSA_BITS = 3


def code_dtype(name: str) -> torch.dtype | None:
    """The code dtype of an 8-bit state option name (``"int8"``, ``"fp8_e4m3"``), None for a float dtype name."""
    return CODE_DTYPES.get(name)


def rounding_key(seed: int | None) -> int:
    """The rounding key of a request: its seed mod 2**32 (the hash reads the low 32 bits), 0 when unset."""
    return 0 if seed is None else seed % 2**32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply, two rounds) of int64 values taken mod 2**32; int64 out in
    [0, 2**32). The C++ kernels compute it in uint32 arithmetic."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """The per-sequence base of the noise hash: keys (S,) int64 rounding keys, positions (S,) int64 tokens
    absorbed after this update, layer the layer index -> (S,) int64 in [0, 2**32)."""
    h = hash32(keys.to(torch.int64))
    h = hash32(h ^ (positions.to(torch.int64) & _MASK32))
    return hash32(h ^ layer)


def uniform_noise(keys: torch.Tensor, positions: torch.Tensor, layer: int, shape: tuple[int, ...],
                  offset: int = 0) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32 (S, *shape), 8 bits each: element e of sequence s, at flat index
    ``g = offset + e``, takes byte ``g % 4`` (the least significant first) of ``w = hash32(row_keys[s] + g // 4)``
    and is ``(byte + 0.5) / 256``. e is the flat index within ``shape``; ``offset`` is where a tensor-parallel
    rank's slice starts in the whole tensor (any value), so each element's noise is the same on any rank."""
    base = row_keys(keys, positions, layer)  # (S,)
    numel = 1
    for d in shape:
        numel *= d
    first_word = offset // NOISE_ELEMENTS_PER_HASH
    end_word = (offset + numel + NOISE_ELEMENTS_PER_HASH - 1) // NOISE_ELEMENTS_PER_HASH
    w = hash32(base[:, None] + torch.arange(first_word, end_word, dtype=torch.int64)[None, :])  # (S, words)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64)  # byte k of a word: bits 8k .. 8k + 7
    byte = ((w[:, :, None] >> shifts) & 0xFF).reshape(base.shape[0], w.shape[1] * NOISE_ELEMENTS_PER_HASH)
    # (S, 4 words): element 4 first_word on
    start = offset - first_word * NOISE_ELEMENTS_PER_HASH
    byte = byte[:, start:start + numel]
    return ((byte.to(torch.float32) + 0.5) * (1.0 / 256)).reshape(base.shape[0], *shape)


def nearest_noise(shape: tuple[int, ...]) -> torch.Tensor:
    """The noise of a state rounded to nearest: :data:`NEAREST_NOISE` everywhere, float32 ``shape``."""
    return torch.full(shape, NEAREST_NOISE, dtype=torch.float32)


def _round_int8(v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    r = torch.floor(v + noise) if noise is not None else torch.round(v)
    return r.clamp_(-127.0, 127.0).to(torch.int8)


def _round_e4m3(v: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """v float32 with |v| <= 448 -> float8_e4m3fn, rounded stochastically on the e4m3 grid (the spacing of
    the binade |v| lies in; a fixed 2**-9 below the smallest normal)."""
    mag = v.abs()
    _, exp = torch.frexp(mag)  # mag = m * 2**exp, m in [0.5, 1)
    binade = torch.clamp(exp - 1, min=_FP8_E4M3_MIN_NORMAL_EXP)
    ulp = torch.pow(2.0, (binade - _FP8_E4M3_MANTISSA_BITS).to(torch.float32))
    steps = torch.floor(mag / ulp + noise) if noise is not None else torch.round(mag / ulp)
    rounded = torch.clamp(steps * ulp, max=448.0)
    return torch.copysign(rounded, v).to(torch.float8_e4m3fn)


def scale_up(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales >= 0 -> the smallest bfloat16 values >= each (a bfloat16 tensor): the float32 bits rounded
    up to the next multiple of 2**16."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    up = ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32)  # (scales are >= 0: no sign bit; NaN and inf stay such)
    up = torch.where(torch.isfinite(scale), up, bits.to(torch.int32))
    return up.view(torch.float32).to(SCALE_DTYPE)  # exact: the low 16 bits are 0


def encode_rows(values: torch.Tensor, dtype: torch.dtype,
                noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """values (*rows, n) float -> (codes (*rows, n) in ``dtype``, scale (*rows,) bfloat16).

    The scale is ``max|row| / code_max`` rounded up to bfloat16 (:func:`scale_up`); the codes round
    ``x * (1 / scale)`` with that stored scale. noise: uniform (0, 1) of values' shape (:func:`uniform_noise`)
    for stochastic rounding, or None for round-to-nearest."""
    x = values.to(torch.float32)
    amax = x.abs().amax(dim=-1)  # (*rows,)
    scale = scale_up(amax / CODE_MAX[dtype])
    used = scale.to(torch.float32)
    inv = torch.where(used > 0, 1.0 / used, torch.zeros_like(used))
    v = x * inv[..., None]
    codes = _round_int8(v, noise) if dtype == torch.int8 else _round_e4m3(v, noise)
    return codes, scale


def decode_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes (*rows, n), scale (*rows,) bfloat16 -> float32 (*rows, n)."""
    return codes.to(torch.float32) * scale.to(torch.float32)[..., None]


class CodedState(CodedSlots):
    """The pool's view of one layer's 8-bit temporal state tensor, handed to the ops in place of a float view.

    codes: (slots, *shape) int8 or float8_e4m3fn; scale: (slots, *shape[:-1]) bfloat16; layer: the layer
    index the rounding hash takes; offset: the flat index of this tensor's first element in the whole tensor
    (a tensor-parallel rank's slice of heads; 0 otherwise), the noise's element numbering starts there;
    stochastic: False rounds to nearest (every element's noise :data:`NEAREST_NOISE`; the state kind's choice,
    ``cache/spec.py: TEMPORAL_ROUNDING``). Both tensors are the pool's own storage: writing them writes the
    cache."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, layer: int, offset: int = 0,
                 stochastic: bool = True) -> None:
        if codes.dtype not in CODE_MAX or scale.dtype != SCALE_DTYPE or codes.shape[:-1] != scale.shape:
            raise ValueError(f"8-bit state wants codes (slots, *rows, n) in {list(CODE_MAX)} and {SCALE_DTYPE} scales "
                             f"(slots, *rows); got {codes.dtype} {tuple(codes.shape)}, {scale.dtype} "
                             f"{tuple(scale.shape)}")
        self.codes, self.scale, self.layer, self.offset, self.stochastic = codes, scale, layer, offset, stochastic

    def decode_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B,) int64, all >= 0, decoded -> a new float32 (B, *shape) (torch's CPU index ops do not
        take float8: the codes' bytes are gathered)."""
        codes = self.codes.view(torch.uint8).index_select(0, slots).view(self.codes.dtype)
        return decode_rows(codes, self.scale.index_select(0, slots))

    def write(self, idx: torch.Tensor, values: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Encode values (B, *shape) into the slots idx (B,) with the noise of rounding keys (B,) and
        positions (B,) (tokens absorbed after this update)."""
        real = idx >= 0  # (B,): a negative slot (a padded row) is written nowhere
        if not bool(real.all()):
            idx, values, keys, positions = idx[real], values[real], keys[real], positions[real]
        noise = (uniform_noise(keys, positions, self.layer, tuple(values.shape[1:]), self.offset) if self.stochastic
                 else nearest_noise(tuple(values.shape)))
        codes, scale = encode_rows(values, self.codes.dtype, noise)
        self.codes.view(torch.uint8).index_copy_(0, idx, codes.view(torch.uint8))
        self.scale.index_copy_(0, idx, scale)


#: what the pool hands an op for one state tensor: a float view (slots, *shape), or the codes and scales of 8 bits
#: (a temporal state's bfloat16 row scales, a conv state's per-channel exponents: cache/conv_codec.py)
StateView = torch.Tensor | CodedState | CodedConvState
#: the 8-bit views (``isinstance`` takes the tuple)
CODED_VIEWS = (CodedState, CodedConvState)


def has_coded_state(caches: dict) -> bool:
    """Whether any layer cache (``cache.pool.LayerCache``, by layer) holds an 8-bit state tensor."""
    return any(isinstance(view, CODED_VIEWS) for cache in caches.values() for view in (cache.state or {}).values())
