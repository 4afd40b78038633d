"""8-bit conv state: int8 codes in the conv state's own layout and a power-of-two exponent per channel.

A conv state ``(D, K-1)`` holds the last K-1 inputs of each of D channels, oldest first. In ``int8``
(``--mamba-cache-dtype int8``) it is two tensors in the slot: ``codes`` ``(D, K-1)`` int8 and, named
``conv_scale`` in the layout, ``exponent`` ``(D,)`` int8. Channel ``c``'s values are
``codes[c] * 2**exponent[c]``: the scale ``2**e`` is the smallest power
of two with ``127 * 2**e >= max|x|`` over the channel's K-1 values (``max|x| / 127`` in float32, its mantissa
rounded up into the exponent), and a code is ``x * 2**-e`` rounded to the nearest integer (ties to even); a channel
of zeros has exponent 0. Every step is exact but the rounding to integers.

Why this shape: one byte of exponent per channel keeps a conv state at 4 bytes per channel for kernel 4 (3 codes
and the exponent) against bfloat16's 6, and every channel keeps its own range: a conv state's channels span
decades, and a scale shared across channels rounds the small ones coarsely (measured: mean |Δlogprob| 2-3x
larger with one scale per 64 channels, docs/state_precision.md). The window shifts by one column per token; a
decoded value is exactly ``code * 2**e``, so it encodes to the same code while its channel's exponent stays,
and is rounded again (one binade coarser per step of the exponent) only when a larger input enters the window.

The CPU kernel (``csrc/recurrent.cpp``: ``hs_causal_conv1d_coded``) decodes and encodes with the same
arithmetic, code for code; this module is the reference it is tested against.
"""

from __future__ import annotations

import torch

from hybridserve.cache.slots import CodedSlots

__all__ = ["CONV_CODE_DTYPE", "CONV_CODE_MAX", "CONV_EXPONENT_DTYPE", "CodedConvState", "decode_conv",
           "encode_conv", "power_of_two_exponent"]

#: the code dtype of an 8-bit conv state
CONV_CODE_DTYPE = torch.int8
#: the dtype of its per-channel exponents
CONV_EXPONENT_DTYPE = torch.int8
#: the largest code magnitude
CONV_CODE_MAX = 127.0

_EXPONENT_FIELD = 0x7F800000
_MANTISSA_FIELD = 0x007FFFFF
_EXPONENT_ONE = 0x00800000
_EXPONENT_BIAS = 127


def power_of_two_exponent(q: torch.Tensor) -> torch.Tensor:
    """float32 values >= 0 -> int32 ``e`` of the smallest power of two ``2**e >= q`` (the mantissa bits rounded up
    into the exponent; ``2**-126`` for a subnormal q), 0 where q is 0."""
    bits = q.to(torch.float32).contiguous().view(torch.int32)
    up = torch.where((bits & _MANTISSA_FIELD) != 0, (bits & _EXPONENT_FIELD) + _EXPONENT_ONE, bits)
    exponent = (up >> 23) - _EXPONENT_BIAS
    return torch.where(bits == 0, torch.zeros_like(exponent), exponent)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """int exponents in [-126, 127] -> float32 ``2**e``, exactly."""
    return ((exponent.to(torch.int32) + _EXPONENT_BIAS) << 23).view(torch.float32)


def encode_conv(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (B, D, K-1) float -> (codes (B, D, K-1) int8, exponent (B, D) int8)."""
    x = values.to(torch.float32)
    exponent = power_of_two_exponent(x.abs().amax(dim=-1) / CONV_CODE_MAX)  # (B, D)
    codes = torch.round(x * _power_of_two(-exponent)[..., None]).clamp_(-CONV_CODE_MAX, CONV_CODE_MAX)
    return codes.to(CONV_CODE_DTYPE), exponent.to(CONV_EXPONENT_DTYPE)


def decode_conv(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """codes (B, D, K-1) int8, exponent (B, D) int8 -> float32 (B, D, K-1)."""
    return codes.to(torch.float32) * _power_of_two(exponent)[..., None]


class CodedConvState(CodedSlots):
    """The pool's view of one layer's 8-bit conv state, handed to the ops in place of a float view.

    codes: (slots, D, K-1) int8; scale: (slots, D) int8, each channel's exponent; both the pool's own storage.
    The interface is :class:`~hybridserve.cache.state_codec.CodedState`'s (``read``, ``write``; both are
    ``cache/slots.py: CodedSlots``), so the plain bodies' decode-and-encode wrapper (``ops/coded_plain.py``)
    takes either; rounding is to nearest, so ``write`` takes no rounding keys or positions into account."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, layer: int, offset: int = 0) -> None:
        if (codes.dtype != CONV_CODE_DTYPE or scale.dtype != CONV_EXPONENT_DTYPE or codes.dim() != 3
                or tuple(scale.shape) != tuple(codes.shape[:2])):
            raise ValueError(f"an 8-bit conv state wants int8 codes (slots, D, K-1) and {CONV_EXPONENT_DTYPE} "
                             f"exponents (slots, D); got {codes.dtype} {tuple(codes.shape)}, {scale.dtype} "
                             f"{tuple(scale.shape)}")
        self.codes, self.scale, self.layer, self.offset = codes, scale, layer, offset

    def channels(self, start: int, end: int) -> CodedConvState:
        """The view of channels ``start .. end - 1`` (a mixer's q, k or v part)."""
        return CodedConvState(self.codes[:, start:end], self.scale[:, start:end], self.layer, self.offset)

    def decode_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B,) int64, all >= 0, decoded -> a new float32 (B, D, K-1)."""
        return decode_conv(self.codes.index_select(0, slots), self.scale.index_select(0, slots))

    def write(self, idx: torch.Tensor, values: torch.Tensor, keys: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> None:
        """Encode values (B, D, K-1) into the slots idx (B,) (none for a negative slot); keys and positions are
        not used (rounding to nearest)."""
        real = idx >= 0
        if not bool(real.all()):
            idx, values = idx[real], values[real]
        codes, exponent = encode_conv(values)
        self.codes.index_copy_(0, idx, codes)
        self.scale.index_copy_(0, idx, exponent)
