"""Linear layers over 4-bit group-wise weights (``ops/linear_w4.py``'s format), held only in the packed form of
the CPU kernel (``kernels/linear_w4.py``): made at load from a 16/32-bit weight (``--quantization int4``,
:meth:`W4Linear.from_weight`) or from codes another format already holds (GGUF's Q4_0 and Q4_K blocks,
:meth:`W4Linear.from_codes`). Scales and mins are kept as float16, or sub-scaled: a uint8 sub-scale per group times
a float16 super-scale per 256 in-features (``kernels/linear_w4.py``)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import linear_w4 as kernel
from hybridserve.ops.linear_w4 import CODE_CENTRE, linear_w4_ref

_QUANTIZE_ROWS = 4096  # rows quantized at a time

#: the dtype that names 4-bit codes as a weight format (MoE experts' ``weight_format``)
INT4_FORMAT = kernel.INT4_FORMAT


def quantize_w4_f16(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> centred codes (N, K) uint8 and scales (N, G) float32 holding float16 values: per
    group the scale ``max|w| / 7`` rounded to float16 first (1 for a group of zeros), then each code
    ``clamp(round(w / scale), -8, 7) + 8`` against that rounded scale, so that packing loses nothing."""
    N, K = weight.shape
    G = kernel.num_groups(K, group)
    codes = torch.empty(N, K, dtype=torch.uint8)
    scales = torch.empty(N, G)
    for r0 in range(0, N, _QUANTIZE_ROWS):  # a slice of rows at a time: the float32 copies stay small
        r1 = min(N, r0 + _QUANTIZE_ROWS)
        w = nn.functional.pad(weight[r0:r1].detach().float(), (0, G * group - K)).view(r1 - r0, G, group)
        amax = w.abs().amax(dim=-1)  # (rows, G)
        s = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(torch.float16).float()
        s = torch.where(s > 0, s, torch.ones_like(s))  # a scale below float16's range: codes 8
        q = torch.round(w / s[..., None]).clamp_(-8, 7) + CODE_CENTRE
        codes[r0:r1] = q.view(r1 - r0, G * group)[:, :K]
        scales[r0:r1] = s
    return codes, scales


def quantize_w4_sub(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> centred codes (N, K) uint8, scales (N, G) float32 and super-scales (N, S) float32
    holding float16 values (``kernels/linear_w4.py``, sub-scaled): per group the wanted scale ``max|w| / 7``; per
    super-block d, its groups' largest wanted scale over 255, rounded to float16 no lower; each group's scale
    ``d * u`` with u its wanted scale over d rounded up (at most 255), so no weight is clipped; then each code
    ``clamp(round(w / scale), -8, 7) + 8`` against the scale so made (code 8 where it is 0), so that packing
    loses nothing."""
    N, K = weight.shape
    G = kernel.num_groups(K, group)
    per = kernel.groups_per_super(K, group)
    S = kernel.num_supers(K, group)
    codes = torch.empty(N, K, dtype=torch.uint8)
    scales = torch.empty(N, G)
    supers = torch.empty(N, S)
    for r0 in range(0, N, _QUANTIZE_ROWS):  # a slice of rows at a time: the float32 copies stay small
        r1 = min(N, r0 + _QUANTIZE_ROWS)
        w = nn.functional.pad(weight[r0:r1].detach().float(), (0, G * group - K)).view(r1 - r0, G, group)
        wanted = nn.functional.pad(w.abs().amax(dim=-1) / 7.0, (0, S * per - G))  # (rows, S * per)
        exact = wanted.view(r1 - r0, S, per).amax(dim=-1) / kernel.SUB_SCALE_MAX  # (rows, S)
        d = exact.to(torch.float16)
        d = torch.where(d.float() < exact, torch.nextafter(d, torch.full_like(d, float("inf"))), d)  # no lower
        d_g = kernel.expand_supers(d.float(), K, group)  # (rows, G)
        u = torch.where(d_g > 0, wanted[:, :G] / torch.where(d_g > 0, d_g, torch.ones_like(d_g)), 0.0)
        s = d_g * torch.ceil(u).clamp_(0, kernel.SUB_SCALE_MAX)
        q = torch.round(w / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp_(-8, 7) + CODE_CENTRE
        q = torch.where(s[..., None] > 0, q, float(CODE_CENTRE))
        codes[r0:r1] = q.view(r1 - r0, G * group)[:, :K]
        scales[r0:r1], supers[r0:r1] = s, d.float()
    return codes, scales, supers


class W4Linear(nn.Module):
    """``y = x @ dequantize_w4(codes, scales, mins, group).T + b`` over the packed buffer ``packed_weight``;
    activations bf16, fp16 or float32, the output in their dtype."""

    packed_weight: torch.Tensor

    def __init__(self, in_features: int, out_features: int, packed_weight: torch.Tensor, group: int, has_mins: bool,
                 bias: torch.Tensor | nn.Parameter | None, sub_scaled: bool = False) -> None:
        super().__init__()
        expected = kernel.packed_bytes(out_features, in_features, group, has_mins, sub_scaled)
        if packed_weight.dtype != torch.uint8 or packed_weight.numel() != expected:
            raise ValueError(f"a packed ({out_features}, {in_features}) 4-bit weight in groups of {group} is "
                             f"{expected} uint8 bytes, got {packed_weight.dtype} {tuple(packed_weight.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.has_mins, self.sub_scaled = group, has_mins, sub_scaled
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, in_features: int, out_features: int, codes: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None, group: int, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None,
                   supers: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> W4Linear:
        """A layer over codes (out_features, in_features) uint8 0..15, scales and mins (out_features, G) (mins
        None: centred codes, ``(code - 8) * scale``), groups of ``group`` in-features. ``supers``: the float16
        super-scales of the scales and the mins, which are theirs times integers 0..255 (kept sub-scaled);
        without them scales and mins are rounded to float16. ``out``: the uint8 buffer to pack into
        (:func:`kernels.linear_w4.packed_bytes`). Raises ValueError naming an operand outside the format."""
        if tuple(codes.shape) != (out_features, in_features):
            raise ValueError(f"codes must have shape ({out_features}, {in_features}), got {tuple(codes.shape)}")
        packed = kernel.pack(codes, scales, mins, group, out=out, supers=supers)
        return cls(in_features, out_features, packed, group, mins is not None, bias, supers is not None)

    @classmethod
    def from_weight(cls, linear: nn.Linear, group: int, out: torch.Tensor | None = None) -> W4Linear:
        """``linear`` quantized to centred 4-bit codes with a sub-scaled scale per ``group`` in-features
        (:func:`quantize_w4_sub`), its bias kept."""
        codes, scales, supers = quantize_w4_sub(linear.weight, group)
        return cls.from_codes(linear.in_features, linear.out_features, codes, scales, None, group, linear.bias, out,
                              (supers, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features) in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = kernel.linear(x, self.packed_weight, self.out_features, self.group, self.has_mins, bias, self.sub_scaled)
        if y is not None:
            return y
        fallbacks.record("linear_w4", fallbacks.describe(x) + f", K={self.in_features}, group={self.group}")
        return linear_w4_ref(x, *self.unpacked(), self.group, bias)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The codes, scales and mins the layer holds, as float32."""
        return kernel.unpack(self.packed_weight, self.out_features, self.in_features, self.group, self.has_mins,
                             self.sub_scaled)

    def extra_repr(self) -> str:
        mins = ", mins" if self.has_mins else ""
        sub = ", sub-scaled" if self.sub_scaled else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, group={self.group}"
                f"{mins}{sub}")
