"""Rounding schemes for 8-bit recurrent state, patched into ``CodedState`` for drift measurements only.

The engine's codec (``hybridserve/cache/state_codec.py``) rounds ``value / scale`` stochastically, ``floor(v + u)``
with ``u`` from a counter hash of (rounding key, position, layer, element), against one bfloat16 scale per state
row. The schemes here change that, without touching the engine, by replacing ``CodedState.read`` and
``CodedState.write`` inside a context manager (:func:`patched`). A scheme is named ``<base>[-weyl][-g<K>]``:

- base ``stochastic``: today's ``floor(v + u)``, decoded ``c * s``; ``nearest``: ``round(v)``, decoded ``c * s``;
  ``subtractive``: subtractive dither, encoded ``floor(v + u)`` as today but decoded ``(c - u + 0.5) * s`` with the
  same ``u``, so the error is uniform in ``[-s/2, s/2)`` whatever the value (variance ``s^2/12``, no bias). For
  fp8_e4m3 codes, the code is the one whose dithered value ``|c| + (0.5 - u) * ulp(c)`` (ulp: the spacing of the
  code's binade) is nearest ``|v|``.
- ``-weyl``: the noise is low-discrepancy in time, ``u_t = frac(u_0 + t * 0.618...)`` per element, ``u_0`` the
  hash's noise at position 0 and ``t`` the position the state is encoded at, instead of a fresh hash per position.
- ``-g<K>``: K scale groups per row (``ceil(n / K)`` elements each) whose scales are 8-bit unsigned floats
  (:func:`scale_up_u8`: 5 exponent bits, 3 mantissa bits), rounded up from ``max|group| / code_max`` so no code
  clips. A row of ``n`` codes then takes ``n + K`` bytes against today's ``n + 2``: ``-g2`` is today's bytes.

A real decoder would recompute ``u`` from the slot's rounding key and the position its state was encoded at; this
prototype remembers, per (CodedState, slot), the noise the last write used (and the group scales, which a real
codec would store in the slot) and raises if a slot it reads holds codes it did not write (a copy of another
slot's bytes, say).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridserve.cache import state_codec

#: the fractional part of the golden ratio: the Weyl sequence's step per position
WEYL_STEP = (math.sqrt(5.0) - 1.0) / 2.0
#: the bases a scheme name starts with
BASES = ("stochastic", "nearest", "subtractive")
#: the 8-bit group scale: value 2**e * (1 + m / 8), e in [U8_MIN_EXP, U8_MIN_EXP + 31], m in 0..7 (0 is code 0)
U8_MANTISSA_BITS = 3
U8_MIN_EXP = -22
U8_MAX_EXP = U8_MIN_EXP + 31
U8_SCALE_MAX = 2.0 ** U8_MAX_EXP * (2.0 - 2.0 ** -U8_MANTISSA_BITS)


@dataclass(frozen=True)
class Rounding:
    """A rounding scheme: ``base`` one of :data:`BASES`, ``weyl`` noise low-discrepancy in time, ``groups`` the
    8-bit scale groups per row (0: today's one bfloat16 scale per row)."""

    base: str
    weyl: bool = False
    groups: int = 0

    @property
    def noisy(self) -> bool:
        return self.base != "nearest"


def parse_rounding(name: str) -> Rounding:
    """``<base>[-weyl][-g<K>]`` -> :class:`Rounding`; a ValueError naming the bad part and the allowed forms."""
    parts = name.split("-")
    allowed = f"'<base>[-weyl][-g<K>]' with base one of {list(BASES)} and K >= 1 (e.g. 'subtractive-weyl-g2')"
    if parts[0] not in BASES:
        raise ValueError(f"rounding {name!r}: unknown base {parts[0]!r}; allowed: {allowed}")
    weyl, groups = False, 0
    for part in parts[1:]:
        if part == "weyl" and not weyl and groups == 0:
            weyl = True
        elif part.startswith("g") and part[1:].isdigit() and int(part[1:]) >= 1 and groups == 0:
            groups = int(part[1:])
        else:
            raise ValueError(f"rounding {name!r}: bad part {part!r}; allowed: {allowed}")
    if weyl and parts[0] == "nearest":
        raise ValueError(f"rounding {name!r}: 'nearest' takes no noise, so no '-weyl'; allowed: {allowed}")
    return Rounding(parts[0], weyl, groups)


def noise(rounding: Rounding, keys: torch.Tensor, positions: torch.Tensor, layer: int, shape: tuple[int, ...],
          offset: int = 0) -> torch.Tensor | None:
    """The uniform noise (S, *shape) float32 of a write (None for ``nearest``): the engine's hash at each
    sequence's position, or with ``weyl`` the hash at position 0 shifted by ``position * WEYL_STEP`` mod 1."""
    if not rounding.noisy:
        return None
    if not rounding.weyl:
        return state_codec.uniform_noise(keys, positions, layer, shape, offset)
    u0 = state_codec.uniform_noise(keys, torch.zeros_like(positions), layer, shape, offset)  # (S, *shape)
    shift = torch.remainder(positions.to(torch.float64) * WEYL_STEP, 1.0).to(torch.float32)  # (S,)
    return torch.remainder(u0 + shift.view(-1, *([1] * len(shape))), 1.0)


def scale_up_u8(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales >= 0 -> the smallest 8-bit unsigned float (:data:`U8_MIN_EXP`, 3 mantissa bits) >= each,
    as float32; 0 stays 0, a scale below the smallest value takes the smallest. A ValueError names a scale above
    :data:`U8_SCALE_MAX` (its codes would clip)."""
    if bool((scale > U8_SCALE_MAX).any()):
        raise ValueError(f"group scale {float(scale.max()):.3g} above the 8-bit scale's largest, {U8_SCALE_MAX:.3g}")
    _, exp = torch.frexp(scale)  # scale = f * 2**exp, f in [0.5, 1)
    e = torch.clamp(exp - 1, min=U8_MIN_EXP)
    ulp = torch.pow(2.0, (e - U8_MANTISSA_BITS).to(torch.float32))
    up = torch.ceil(scale / ulp) * ulp  # at most 2**(e + 1), itself representable (e + 1 <= max here)
    up = torch.clamp(up, min=2.0 ** U8_MIN_EXP)  # (no subnormals: below the smallest normal, take it)
    return torch.where(scale > 0, up, torch.zeros_like(scale))


def group_scales(x: torch.Tensor, groups: int, code_max: float) -> torch.Tensor:
    """x (*rows, n) float32 -> the 8-bit group scales (*rows, groups) float32 of ``ceil(n / groups)``-element
    groups (the last one shorter when groups does not divide n)."""
    size = _group_size(x.shape[-1], groups)
    pad = size * groups - x.shape[-1]
    mag = torch.nn.functional.pad(x.abs(), (0, pad)) if pad else x.abs()
    amax = mag.reshape(*x.shape[:-1], groups, size).amax(dim=-1)  # (*rows, groups)
    return scale_up_u8(amax / code_max)


def expand_groups(scales: torch.Tensor, n: int) -> torch.Tensor:
    """scales (*rows, groups) -> (*rows, n): each element's group scale."""
    size = _group_size(n, scales.shape[-1])
    return scales.repeat_interleave(size, dim=-1)[..., :n]


def _group_size(n: int, groups: int) -> int:
    if groups > n:
        raise ValueError(f"{groups} scale groups on rows of {n} elements: at most one group per element")
    return -(-n // groups)


def _e4m3_ulp(bits: torch.Tensor) -> torch.Tensor:
    """Magnitude bits (0..0x7E, int64) of e4m3 codes -> the spacing of their binade, float32."""
    exp_field = bits >> state_codec._FP8_E4M3_MANTISSA_BITS
    e = torch.clamp(exp_field, min=1) - 7 - state_codec._FP8_E4M3_MANTISSA_BITS  # (field 0: subnormal, 2**-9)
    return torch.pow(2.0, e.to(torch.float32))


def _e4m3_value(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _e4m3_subtractive(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """v float32 (|v| <= 448) -> e4m3 codes whose dithered magnitude ``|c| + (0.5 - u) ulp(c)`` is nearest |v|
    (of the stochastic code and its two neighbours)."""
    mag = v.abs()
    first = state_codec._round_e4m3(mag, u).view(torch.uint8).to(torch.int64)
    cands = torch.stack([(first - 1).clamp(min=0), first, (first + 1).clamp(max=0x7E)])  # (3, ...)
    dithered = _e4m3_value(cands) + (0.5 - u) * _e4m3_ulp(cands)
    best = torch.gather(cands, 0, (dithered - mag).abs().argmin(dim=0, keepdim=True))[0]
    return torch.copysign(_e4m3_value(best), v).to(torch.float8_e4m3fn)


def encode(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding, u: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (*rows, n) float -> (codes in ``dtype``, today's bfloat16 row scales (*rows,), group scales
    (*rows, groups) float32 or None). The row scale is what today's codec stores; with groups the codes are
    computed against the group scales and the row scale only marks a row of zeros (a slot the pool zeroed)."""
    x = x.to(torch.float32)
    code_max = state_codec.CODE_MAX[dtype]
    row_scale = state_codec.scale_up(x.abs().amax(dim=-1) / code_max)  # (*rows,)
    groups = group_scales(x, rounding.groups, code_max) if rounding.groups else None
    used = expand_groups(groups, x.shape[-1]) if groups is not None else row_scale.to(torch.float32)[..., None]
    v = x * torch.where(used > 0, 1.0 / used, torch.zeros_like(used))
    if dtype == torch.int8:
        codes = state_codec._round_int8(v, u)  # subtractive encodes as stochastic: floor(v + u)
    elif rounding.base == "subtractive":
        codes = _e4m3_subtractive(v, u)  # type: ignore[arg-type]
    else:
        codes = state_codec._round_e4m3(v, u)
    return codes, row_scale, groups


def decode(codes: torch.Tensor, row_scale: torch.Tensor, rounding: Rounding, u: torch.Tensor | None,
           groups: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`encode` given the same noise ``u``: codes (*rows, n) -> float32 (*rows, n); a row
    whose row scale is 0 decodes to zeros."""
    c = codes.to(torch.float32)
    if rounding.base == "subtractive":
        if codes.dtype == torch.int8:
            c = c - u + 0.5  # type: ignore[operator]
        else:
            bits = codes.view(torch.uint8).to(torch.int64)
            mag = c.abs() + (0.5 - u) * _e4m3_ulp(bits & 0x7F)  # type: ignore[operator]
            c = torch.where((bits & 0x80) != 0, -mag, mag)
    used = expand_groups(groups, c.shape[-1]) if groups is not None else row_scale.to(torch.float32)[..., None]
    values = c * used
    return values.masked_fill_((row_scale == 0)[..., None], 0.0)


class _Written:
    """What a write left beside a slot's codes for the next read: the noise (subtractive only) and the group
    scales (groups only), per CodedState and slot."""

    def __init__(self) -> None:
        self.by_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def put(self, state: state_codec.CodedState, slot: int, u: torch.Tensor | None, groups: torch.Tensor | None
            ) -> None:
        self.by_state.setdefault(state, {})[slot] = (u, groups)

    def get(self, state: state_codec.CodedState, slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.by_state.get(state, {}).get(slot, (None, None))


@contextmanager
def patched(rounding: Rounding) -> Iterator[None]:
    """Within the block, every CodedState encodes and decodes with ``rounding`` (plain PyTorch bodies only:
    the C++ kernels read the pool's codes themselves)."""
    original_read, original_write = state_codec.CodedState.read, state_codec.CodedState.write
    written = _Written()
    side = rounding.base == "subtractive" or rounding.groups > 0

    def write(self, idx, values, keys, positions):
        real = idx >= 0  # (B,): a negative slot (a padded row) is written nowhere
        if not bool(real.all()):
            idx, values, keys, positions = idx[real], values[real], keys[real], positions[real]
        u = noise(rounding, keys, positions, self.layer, tuple(values.shape[1:]), self.offset)
        codes, row_scale, groups = encode(values, self.codes.dtype, rounding, u)
        self.codes.view(torch.uint8).index_copy_(0, idx, codes.view(torch.uint8))
        self.scale.index_copy_(0, idx, row_scale)
        if side:
            for b, slot in enumerate(idx.tolist()):
                written.put(self, slot, u[b].clone() if rounding.base == "subtractive" else None,  # type: ignore[index]
                            groups[b].clone() if groups is not None else None)

    def read(self, idx):
        if not side:
            return original_read(self, idx)
        out = torch.zeros(idx.shape[0], *self.codes.shape[1:], dtype=torch.float32)
        for b, slot in enumerate(idx.tolist()):
            if slot < 0:
                continue  # a padded row of a captured step reads zeros
            row_scale = self.scale[slot]
            u, groups = written.get(self, slot)
            zero = bool((row_scale == 0).all())
            if not zero and ((rounding.base == "subtractive" and u is None) or (rounding.groups and groups is None)):
                raise RuntimeError(f"slot {slot} of layer {self.layer} holds codes this prototype did not write "
                                   "(copied from another slot?): its noise and group scales are unknown")
            codes = self.codes[slot:slot + 1].view(torch.uint8)[0].view(self.codes.dtype)
            if zero:
                continue
            out[b] = decode(codes, row_scale, rounding, u, groups)
        return out

    state_codec.CodedState.read = read  # type: ignore[method-assign]
    state_codec.CodedState.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        state_codec.CodedState.read = original_read  # type: ignore[method-assign]
        state_codec.CodedState.write = original_write  # type: ignore[method-assign]


def bytes_per_row(n: int, rounding: Rounding) -> int:
    """Bytes of one state row of ``n`` 8-bit codes and its scales: today's ``n + 2`` (one bfloat16 scale), with
    groups ``n + groups`` (one byte each)."""
    return n + (rounding.groups if rounding.groups else 2)
