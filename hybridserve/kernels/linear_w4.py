"""Python entry points of the 4-bit weight linears (``csrc/gemm_w4.h``, in the gemm library).

A weight in the format of ``ops/linear_w4.py`` (codes (N, K) 0..15, scales (N, G), mins (N, G) or None, groups
of ``group`` in-features) is packed once (:func:`pack`, plain PyTorch) into one uint8 buffer of
:func:`packed_bytes`, per panel of 16 output columns:

* the codes as 32-bit words: word (k8, c) holds the codes of k = 8 k8 .. 8 k8 + 7 of column c, k = 8 k8 + j in
  bits 4j .. 4j + 3 (columns past N and k past K hold code 8); in blocks of :data:`BLOCK_PANELS` panels (the last
  may hold fewer), group after group, panel after panel: ``[blocks][G][block's panels][group's 8-k steps][16]``,
  so a tile that sums a block's groups panel after panel reads its words as one sequential stream;
* then, per panel ``[panels]...``, the scales, then (with mins) the mins (pad columns 0), in one of two forms:

  - **float16** ``[G][16]``, rounded to nearest (ties to even) when packed: GGUF's Q4_0 scales are float16
    already, so nothing is lost there; a value beyond float16's range is refused (:func:`pack` raises);
  - **sub-scaled** (``supers`` given to :func:`pack`): ``[S][16]`` float16 super-scales d, one per super-block of
    :data:`SUPER_K` in-features (:func:`groups_per_super` groups), then ``[G][16]`` uint8 sub-scales u, the
    group's scale being ``d * u`` (exact in float32). 8 + 16 / 256 bits a group where float16 takes 16: at groups
    of 32, 4.31 bits a weight in place of 4.5 (4.63 in place of 5 with mins). GGUF's Q4_K blocks are this form
    with 6-bit u, so they pack exactly; ``--quantization int4`` picks d and u before the codes
    (``layers/linear_w4.py: quantize_w4_sub``), so packing loses nothing.

:func:`unpack` gives back the codes and the scales and mins the buffer holds, as float32.

:func:`linear` computes ``x @ dequantize_w4(...).T + bias`` for bf16, fp16 or float32 activations, or returns
None when the call is one the kernel does not cover (K not a multiple of 8, a group that is not, no library).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridserve.kernels._abi import DTYPE_CODES, check
from hybridserve.kernels.gemm import LINEAR_DTYPES, PANEL, _library, linear_operands
from hybridserve.ops.linear_w4 import CODE_CENTRE

CODES_PER_WORD = 8  # 4-bit codes per 32-bit word of a packed panel
BLOCK_PANELS = 8  # panels whose words interleave per 8-k step (kW4BlockPanels in csrc/gemm_w4.h)
#: the dtype that names 4-bit codes where a weight format is a dtype (MoE experts' ``weight_format``)
INT4_FORMAT: torch.dtype = torch.uint4  # type: ignore[attr-defined]
AMX_ROWS = 16  # rows from which bf16 calls run on the AMX tiles at the amx level (kW4AmxRows in csrc/gemm_w4.h)
WIDENED_ROWS = 4  # rows from which other calls decode the codes once per row block (csrc/gemm_widened.h)
#: rows from which bf16 calls at avx512_bf16 run on the dot products over codes widened to bf16 once per call, where
#: the CPU prefers those dot products (AMD Zen 4/5; kDotWidenedRows in csrc/gemm_widened.h)
DOT_ROWS = 16
W4A8_MAX_ROWS = 15  # rows up to which calls run on W4A8 from the avx2 level on (kW4a8MaxRows in csrc/gemm_w4a8.h)
#: the path of activations quantized to int8 per group and integer sums (``ops/linear_w4.py: linear_w4a8_ref``):
#: AVX-512 VNNI at avx512_bf16 and amx, AVX2 integer vectors at avx2 and avx512
W4A8_PATH = "W4A8 (int8 activations, exact integer sums)"
FLOAT16_MAX = float(torch.finfo(torch.float16).max)
SUPER_K = 256  # in-features of a super-block of sub-scaled scales (kW4SuperK in csrc/gemm_w4.h)
SUB_SCALE_MAX = 255  # the largest uint8 sub-scale
FORMAT_MINS, FORMAT_SUB_SCALED = 1, 2  # bits of the format the kernel takes (kW4Mins, kW4SubScaled)
_PACK_PANELS = 256  # panels packed at a time (4096 rows; a multiple of BLOCK_PANELS)


def num_groups(in_features: int, group: int) -> int:
    """Groups of ``group`` in-features per output channel (the last may be short)."""
    return -(-in_features // group)


def groups_per_super(in_features: int, group: int) -> int:
    """Groups of a super-block of sub-scaled scales: :data:`SUPER_K` in-features, or one group where the group
    does not divide it (a group of all the in-features among them)."""
    gs = min(group, in_features)
    return SUPER_K // gs if SUPER_K % gs == 0 else 1


def num_supers(in_features: int, group: int) -> int:
    """Super-blocks of sub-scaled scales per output channel (the last may be short)."""
    return -(-num_groups(in_features, group) // groups_per_super(in_features, group))


def packed_bytes(out_features: int, in_features: int, group: int, has_mins: bool, sub_scaled: bool = False) -> int:
    """Bytes of a packed (out_features, in_features) 4-bit weight (``sub_scaled``: uint8 sub-scales times a float16
    per super-block, else float16 scales)."""
    rows = -(-out_features // PANEL) * PANEL
    words = -(-in_features // CODES_PER_WORD)
    G = num_groups(in_features, group)
    part = rows * (num_supers(in_features, group) * 2 + G) if sub_scaled else rows * G * 2
    return rows * words * 4 + part * (2 if has_mins else 1)


def format_code(has_mins: bool, sub_scaled: bool) -> int:
    """The kernel's format bits of a packed weight."""
    return (FORMAT_MINS if has_mins else 0) | (FORMAT_SUB_SCALED if sub_scaled else 0)


def expand_supers(supers: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """(N, S) super-scales -> (N, G): each group's super-block's value."""
    per = groups_per_super(in_features, group)
    return supers.repeat_interleave(per, dim=1)[:, :num_groups(in_features, group)]


def sub_scales(values: torch.Tensor, supers: torch.Tensor, in_features: int, group: int, name: str) -> torch.Tensor:
    """values (N, G) float, supers (N, S) float16 values -> the uint8 sub-scales u with ``values == supers * u``
    exactly. Raises ValueError naming the first value that is not such a product."""
    d = expand_supers(supers.float(), in_features, group)
    u = torch.where(d != 0, values.float() / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    u = torch.round(u)
    bad = ~torch.isfinite(u) | (u < 0) | (u > SUB_SCALE_MAX) | (u * d != values.float())
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}{list(i)} = {values[i].item()!r} is not its super-block's float16 scale "
                         f"{d[i].item()!r} times an integer 0..{SUB_SCALE_MAX}")
    return u.to(torch.uint8)


def _check_operands(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                    as_halfs: bool) -> None:
    """Raises ValueError naming the first operand that is not the format of ``ops/linear_w4.py`` (``as_halfs``:
    scales and mins to be kept as float16)."""
    if group < 1:
        raise ValueError(f"group must be at least 1 in-feature, got {group}")
    if codes.dim() != 2 or codes.dtype != torch.uint8 or min(codes.shape) < 1:
        raise ValueError(f"codes must be a non-empty (N, K) uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    N, K = codes.shape
    G = num_groups(K, group)
    if int(codes.max()) > 15:
        raise ValueError(f"codes must hold 0..15, got a code of {int(codes.max())}")
    for name, t in (("scales", scales), ("mins", mins)):
        if t is None:
            continue
        if not t.is_floating_point() or tuple(t.shape) != (N, G):
            raise ValueError(f"{name} must be a float ({N}, {G}) tensor for {K} in-features in groups of {group}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        bad = ~torch.isfinite(t)
        if as_halfs:
            bad |= t.float().abs() > FLOAT16_MAX
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            where = (f"beyond float16's range (+-{FLOAT16_MAX:g}), in which 4-bit weights keep their {name}"
                     if as_halfs else "not finite")
            raise ValueError(f"{name}{list(i)} = {t[i].item()!r} is {where}")


def pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
         out: torch.Tensor | None = None,
         supers: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """codes (N, K) uint8 0..15, scales (N, G) and mins (N, G) or None -> the packed uint8 buffer
    (:func:`packed_bytes`), written into ``out`` when given. ``supers``: the float16 super-scales (N, S) of the
    scales and of the mins (None without mins), each scale and min being its super-scale times an integer
    0..255: packs sub-scaled, else scales and mins as float16. Raises ValueError on operands outside the format."""
    _check_operands(codes, scales, mins, group, supers is None)
    N, K = codes.shape
    G = num_groups(K, group)
    sub_scaled = supers is not None
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # per part: (halfs (N, G or S), bytes (N, G))
    for i, (name, t) in enumerate((("scales", scales), ("mins", mins))):
        if t is None:
            continue
        if supers is None:
            parts.append((t, None))
            continue
        d = supers[i]
        S = num_supers(K, group)
        if d is None or tuple(d.shape) != (N, S) or not d.is_floating_point():
            raise ValueError(f"the super-scales of the {name} must be a float ({N}, {S}) tensor, got "
                             f"{None if d is None else (d.dtype, tuple(d.shape))}")
        if not torch.equal(d.to(torch.float16).float(), d.float()):
            raise ValueError(f"the super-scales of the {name} must hold float16 values")
        parts.append((d, sub_scales(t, d, K, group, name)))
    size = packed_bytes(N, K, group, mins is not None, sub_scaled)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 CPU tensor of {size} bytes, "
                         f"got {out.dtype} {tuple(out.shape)}")
    packed = torch.empty(size, dtype=torch.uint8) if out is None else out
    panels = -(-N // PANEL)
    rows, words = panels * PANEL, -(-K // CODES_PER_WORD)
    code_bytes = rows * words * 4
    flat = packed[:code_bytes].view(torch.int32)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int64) * 4
    for p0 in range(0, panels, _PACK_PANELS):  # a slice of panels at a time: the int64 words stay small
        p1 = min(panels, p0 + _PACK_PANELS)
        r0, r1 = p0 * PANEL, p1 * PANEL
        padded = torch.full((r1 - r0, words * CODES_PER_WORD), CODE_CENTRE, dtype=torch.int64)
        padded[:max(0, min(N, r1) - r0), :K] = codes[r0:min(N, r1)]
        w = (padded.view(r1 - r0, words, CODES_PER_WORD) << shifts).sum(-1)  # (rows, words), < 2^32
        w = torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
        for b0, wb, at in _blocks(p0, p1, panels, words):
            block = w.view(p1 - p0, PANEL, words)[b0 - p0:b0 - p0 + wb].transpose(1, 2)  # (wb, words, 16)
            flat[at:at + block.numel()].copy_(_group_major(block, _group_words(K, group)))
    offset = code_bytes
    for halfs, subs in parts:
        n = halfs.shape[1]
        half = torch.zeros(rows, n, dtype=torch.float16)
        half[:N] = halfs.to(torch.float16)
        packed[offset:offset + rows * n * 2].view(torch.float16).view(panels, n, PANEL).copy_(
            half.view(panels, PANEL, n).transpose(1, 2))
        offset += rows * n * 2
        if subs is not None:
            byte = torch.zeros(rows, G, dtype=torch.uint8)
            byte[:N] = subs
            packed[offset:offset + rows * G].view(panels, G, PANEL).copy_(byte.view(panels, PANEL, G).transpose(1, 2))
            offset += rows * G
    return packed


def _group_words(in_features: int, group: int) -> int:
    """8-k steps (words) of a group in the packed order: the kernel's groups where it covers the weight, else one
    group of all the in-features."""
    words = -(-in_features // CODES_PER_WORD)
    return group // CODES_PER_WORD if covers(in_features, group) and group < in_features else words


def _blocks(p0: int, p1: int, panels: int, words: int) -> Iterator[tuple[int, int, int]]:
    """Per block of :data:`BLOCK_PANELS` panels starting in [p0, p1) (p0 a multiple of it): its first panel, its
    panels and the int32 offset of its words."""
    for b0 in range(p0, p1, BLOCK_PANELS):
        yield b0, min(BLOCK_PANELS, panels - b0), b0 * words * PANEL


def _group_major(block: torch.Tensor, gw: int) -> torch.Tensor:
    """A block's words (panels, words, 16) in the packed order, flat: group after group, each group's words
    panel after panel (the last group may be short)."""
    wb, words, _ = block.shape
    full = words // gw * gw
    head = block[:, :full].reshape(wb, words // gw, gw, PANEL).transpose(0, 1).reshape(-1)
    return torch.cat([head, block[:, full:].reshape(-1)])


def _from_group_major(flat: torch.Tensor, wb: int, words: int, gw: int) -> torch.Tensor:
    """The inverse of :func:`_group_major`: (wb, words, 16)."""
    full = words // gw * gw
    head = flat[:wb * full * PANEL].view(full // gw, wb, gw, PANEL).transpose(0, 1).reshape(wb, full, PANEL)
    return torch.cat([head, flat[wb * full * PANEL:].view(wb, words - full, PANEL)], dim=1)


def unpack(packed: torch.Tensor, out_features: int, in_features: int, group: int, has_mins: bool,
           sub_scaled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The codes (N, K) uint8, scales (N, G) float32 and mins (N, G) float32 or None a buffer from :func:`pack`
    holds (float16 values, or, sub-scaled, each super-scale times its sub-scale)."""
    N, K = out_features, in_features
    panels = -(-N // PANEL)
    rows, words, G = panels * PANEL, -(-K // CODES_PER_WORD), num_groups(K, group)
    code_bytes = rows * words * 4
    flat = packed[:code_bytes].view(torch.int32)
    w = torch.empty(panels, PANEL, words, dtype=torch.int32)
    for b0, wb, at in _blocks(0, panels, panels, words):
        w[b0:b0 + wb] = _from_group_major(flat[at:at + wb * words * PANEL], wb, words,
                                          _group_words(K, group)).transpose(1, 2)
    w = w.view(rows, words)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int64) * 4
    codes = ((w.to(torch.int64)[..., None] >> shifts) & 15).reshape(rows, words * CODES_PER_WORD)[:N, :K]
    parts = []
    offset = code_bytes
    for _ in range(2 if has_mins else 1):
        n = num_supers(K, group) if sub_scaled else G
        half = packed[offset:offset + rows * n * 2].view(torch.float16).view(panels, n, PANEL)
        values = half.transpose(1, 2).reshape(rows, n)[:N].float()
        offset += rows * n * 2
        if sub_scaled:
            subs = packed[offset:offset + rows * G].view(panels, G, PANEL).transpose(1, 2).reshape(rows, G)[:N]
            values = expand_supers(values, K, group) * subs.float()
            offset += rows * G
        parts.append(values)
    return codes.to(torch.uint8).contiguous(), parts[0], parts[1] if has_mins else None


def covers(in_features: int, group: int) -> bool:
    """Whether the kernel takes a weight of ``in_features`` in groups of ``group``: K a multiple of 8, and the
    group too (or one group for the whole row)."""
    return in_features % CODES_PER_WORD == 0 and (group % CODES_PER_WORD == 0 or group >= in_features)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, group: int, has_mins: bool,
           bias: torch.Tensor | None, sub_scaled: bool = False) -> torch.Tensor | None:
    """``x @ dequantize_w4(codes, scales, mins, group).T + bias`` for x (..., K) bf16, fp16 or float32, the weight
    packed by :func:`pack` (``sub_scaled``: with super-scales); (..., out_features) in x's dtype. None when not
    covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype not in LINEAR_DTYPES or not x.is_cpu
            or not covers(K, group) or packed.dtype != torch.uint8
            or packed.numel() != packed_bytes(out_features, K, group, has_mins, sub_scaled)):
        return None
    operands = linear_operands(x, bias, out_features)
    if operands is None:
        return None
    x2, out = operands
    check(lib.hs_linear_w4(DTYPE_CODES[x.dtype], x2.shape[0], out_features, K, group,
                           format_code(has_mins, sub_scaled), x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), out_features), "hs_linear_w4")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


#: where :func:`linear` runs a call, by rows and activation dtype (``hs_w4_path``' code)
W4_PATHS = ("float32 vectors", "AMX-BF16 tiles", W4A8_PATH, "float32 panels decoded once per row block",
            "bf16 dot products over codes widened to bf16 once per call")


def path(rows: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Which path :func:`linear` takes for a call of ``rows`` rows of ``dtype`` activations here (one of
    :data:`W4_PATHS`); None without the kernels."""
    lib = _library()
    if lib is None:
        return None
    return W4_PATHS[lib.hs_w4_path(DTYPE_CODES[dtype], rows)]
