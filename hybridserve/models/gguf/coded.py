"""A linear weight read from a GGUF file and kept in its quantized form: codes, scales and mins by group."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridserve.ops.linear_w4 import dequantize_w4
from hybridserve.ops.linear_w6k import dequantize_w6k
from hybridserve.ops.linear_w8 import dequantize as dequantize_w8

#: elements of a coded weight dequantized at a time (float32 temporaries of a few times 16 MiB)
DEQUANTIZE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class CodedWeight:
    """A weight (N, K) as ``codes`` (N, K) with ``scales`` (N, G) float32 and, 4-bit with mins, ``mins`` (N, G),
    for G groups of ``group`` in-features. ``bits`` 8: int8 codes, ``W = codes * scale``
    (``ops/linear_w8.py``); 4: codes 0..15, ``W = codes * scale + min`` or, without mins, ``(codes - 8) * scale``
    (``ops/linear_w4.py``); 6 (Q6_K): codes 0..63, ``scales`` the int8 sub-scales (N, K / 16) and
    ``super_scales`` the float16 d (N, K / 256), ``W = (d * sc) * (codes - 32)`` (``ops/linear_w6k.py``). 4-bit
    from Q4_K also has ``super_scales`` and ``super_mins`` (N, K / 256), float16 values of which each scale and min
    is an integer multiple (``kernels/linear_w4.py``, sub-scaled). ``source`` names the GGUF type it came from."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    bits: int
    source: str
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) in ``dtype``: computed in float32 a slice of rows at a time and rounded once, so
        that a large weight (a vocabulary's embedding) never has a whole float32 copy."""
        out = torch.empty(self.shape, dtype=dtype)
        step = max(1, DEQUANTIZE_ELEMENTS // max(1, self.shape[1]))
        for r0 in range(0, self.shape[0], step):
            out[r0:r0 + step] = self.rows(slice(r0, r0 + step))._dequantize_float32()
        return out

    def _dequantize_float32(self) -> torch.Tensor:
        if self.bits == 8:
            return dequantize_w8(self.codes, self.scales, self.group)
        if self.bits == 6:
            if self.super_scales is None:
                raise ValueError("a 6-bit (Q6_K) weight needs its super-block scales d")
            return dequantize_w6k(self.codes, self.scales, self.super_scales)
        return dequantize_w4(self.codes, self.scales, self.mins, self.group)

    def rows(self, index: torch.Tensor | slice) -> CodedWeight:
        """The output channels ``index`` selects (row-wise quantization makes this exact)."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        sup = None if self.super_scales is None else self.super_scales[index].contiguous()
        sup_mins = None if self.super_mins is None else self.super_mins[index].contiguous()
        return replace(self, codes=self.codes[index].contiguous(), scales=self.scales[index].contiguous(),
                       mins=mins, super_scales=sup, super_mins=sup_mins)

    def matches(self, other: CodedWeight) -> bool:
        """Whether ``other`` is of the same format, so their rows can be stacked into one weight."""
        return (self.bits, self.group, self.mins is None, self.source, self.shape[1]) == (
            other.bits, other.group, other.mins is None, other.source, other.shape[1])


def cat_rows(parts: list[CodedWeight]) -> CodedWeight:
    """One weight stacking ``parts``' output channels (all of one format: :meth:`CodedWeight.matches`)."""
    first = parts[0]
    if not all(first.matches(p) for p in parts[1:]):
        raise ValueError("cat_rows takes weights of one format")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    sup = None if first.super_scales is None else torch.cat([p.super_scales for p in parts])  # type: ignore[misc]
    sup_mins = None if first.super_mins is None else torch.cat([p.super_mins for p in parts])  # type: ignore[misc]
    return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   mins=mins, super_scales=sup, super_mins=sup_mins)
