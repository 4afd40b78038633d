"""Python entry points of the C++ linear kernels (``csrc/gemm.cpp``) for the CPU.

A bf16, fp16 or float32 weight is packed once (:func:`pack`) into 16-column panels; :func:`linear`
then computes ``x @ W.T + b`` with float32 sums rounded once to the activation dtype, the weights
staying 16-bit in memory. At the amx level bf16 runs on the AMX tiles (``csrc/gemm_amx.h``: the packed
panels are AMX B tiles as they are); on avx512_bf16 CPUs on AVX-512 BF16 dot products; everywhere
else (and for fp16) the weights are widened to float32 in registers (AVX2 + FMA, AVX-512, or the
portable vector code of a generic build); float32 weights run the same vector code unwidened. Both
return None, doing nothing, when the call is one the kernel does not cover (another dtype, not on
the CPU, or no compiled library); callers then keep the PyTorch path.
"""

from __future__ import annotations

import torch

from hybridserve.kernels._abi import DTYPE_CODES, bind, check, index_ok, rows_ok

PANEL = 16  # output columns per packed panel (kPanel in csrc/gemm.cpp)
DTYPES = (torch.bfloat16, torch.float16)  # 16-bit weight (and activation) dtypes: linears and MoE experts
LINEAR_DTYPES = DTYPES + (torch.float32,)  # what pack() and linear() take

_PACK = {torch.bfloat16: "hs_pack_bf16", torch.float16: "hs_pack_f16", torch.float32: "hs_pack_f32"}
LINEAR = {torch.bfloat16: "hs_linear_bf16", torch.float16: "hs_linear_f16",
          torch.float32: "hs_linear_f32_packed"}  # C function per dtype


def _library():
    """The bound library for the ISA level in force, or None."""
    return bind("gemm")


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed (out_features, in_features) weight: whole 16-column panels of an even K."""
    return -(-out_features // PANEL) * PANEL * (in_features + in_features % 2)


def available() -> bool:
    """Whether the compiled kernels run on this CPU in this process."""
    return _library() is not None


def uses_bf16_dot() -> bool:
    """Whether bf16 linears run on AVX-512 BF16 dot products here (else widened to float32)."""
    lib = _library()
    return lib is not None and lib.hs_gemm_supported() == 1


def amx_rows() -> int:
    """The fewest rows a bf16 linear (16-bit or 8-bit weights) runs on the AMX tiles with here; 0 when the
    library in force has no AMX path (a level below amx)."""
    lib = _library()
    return 0 if lib is None else int(lib.hs_gemm_amx_rows())


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight."""
    return (_library() is not None and weight.dim() == 2 and weight.dtype in LINEAR_DTYPES
            and weight.device.type == "cpu" and weight.shape[0] >= 1 and weight.shape[1] >= 1
            and weight.stride(1) == 1)


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight (N, K) bf16/fp16/float32 -> its packed form (packed_numel(N, K),) of the same dtype, written into
    ``out`` when given (a contiguous CPU tensor of that dtype and size); None when not covered."""
    lib = _library()
    if not packable(weight):
        return None
    N, K = weight.shape
    if out is not None and (out.dtype != weight.dtype or out.numel() != packed_numel(N, K)
                            or not out.is_contiguous() or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous {weight.dtype} CPU tensor of {packed_numel(N, K)} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    packed = torch.empty(packed_numel(N, K), dtype=weight.dtype) if out is None else out
    fn = _PACK[weight.dtype]
    check(getattr(lib, fn)(N, K, weight.data_ptr(), weight.stride(0), packed.data_ptr()), fn)
    return packed


def linear_operands(x: torch.Tensor, bias: torch.Tensor | None, out_features: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (..., K) as rows (M, K) with unit column stride and the output (M, out_features) in x's dtype, for a
    linear kernel; None when ``bias`` is not one the kernels take (x's dtype, contiguous, (out_features,))."""
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.shape != (out_features,)):
        return None
    K = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.stride(1) != 1 and K > 1:
        x2 = x2.contiguous()
    return x2, torch.empty((x2.shape[0], out_features), dtype=x.dtype)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x (..., K) in the packed weight's dtype, W packed by :func:`pack`;
    (..., out_features) in that dtype. None when not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype != packed.dtype or x.dtype not in LINEAR_DTYPES or not x.is_cpu
            or packed.numel() != packed_numel(out_features, K)):
        return None
    operands = linear_operands(x, bias, out_features)
    if operands is None:
        return None
    x2, out = operands
    M = x2.shape[0]
    fn = LINEAR[x.dtype]
    rc = getattr(lib, fn)(M, out_features, K, x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), out_features)
    if rc != 0:
        check(rc, fn)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


MOE_ACTIVATIONS = {"silu": 0, "relu2": 1}  # Activation in csrc/gemm.cpp: silu gated, relu2 not gated
#: WeightFormat in csrc/gemm_w8.h (0: x's dtype): the 8-bit codes, and uint4 for centred 4-bit ones
#: (kernels/linear_w4.py)
W8_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}
WEIGHT_FORMATS = {**W8_FORMATS, torch.uint4: 3}  # type: ignore[attr-defined]


def moe_experts(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, up_table: torch.Tensor,
                down_table: torch.Tensor, intermediate: int, gated: bool, act: str,
                shared: torch.Tensor | None = None, weight_format: torch.dtype | None = None,
                group: int = 0) -> torch.Tensor | None:
    """The experts of an MoE block over their packed weights (16/32-bit packs of x's dtype, or, with
    ``weight_format`` int8 or float8_e4m3fn, 8-bit ones of ``kernels/linear_w8.py`` with scales per
    ``group``; uint4, centred 4-bit ones of ``kernels/linear_w4.py`` with a sub-scaled scale per ``group``): each
    token's k experts (``index`` (T, k) int64, ``weight`` (T, k) float32 or x's dtype), ``up(x) -> act -> down``
    per expert, summed in float32 by weight and rounded to x's dtype, plus ``shared`` (T, H) when given (rounded again).
    ``up_table``/``down_table``: (E,) int64 addresses of each expert's packed ``gate_up``/``up`` and
    ``down`` weights. Gated experts take silu, non-gated relu2. None when not covered."""
    lib = _library()
    code = MOE_ACTIVATIONS.get(act)
    T, k = index.shape if index.dim() == 2 else (0, 0)
    if (lib is None or code is None or gated != (act == "silu") or x.dtype not in LINEAR_DTYPES or x.dim() != 2
            or not rows_ok(x) or not index_ok(index) or index.shape[0] != x.shape[0] or weight.shape != index.shape
            or not weight.is_contiguous() or weight.dtype not in (torch.float32, x.dtype)
            or not (index_ok(up_table) and index_ok(down_table)) or up_table.shape != down_table.shape):
        return None
    if shared is not None and (shared.shape != x.shape or shared.dtype != x.dtype or not rows_ok(shared)):
        return None
    wfmt = 0 if weight_format is None else WEIGHT_FORMATS.get(weight_format)
    if wfmt is None:
        return None
    H = x.shape[1]
    out = torch.empty(T, H, dtype=x.dtype)
    check(lib.hs_moe_experts(DTYPE_CODES[x.dtype], DTYPE_CODES[weight.dtype], T, H, intermediate, up_table.numel(), k,
                             x.data_ptr(), x.stride(0), index.data_ptr(), weight.data_ptr(), up_table.data_ptr(),
                             down_table.data_ptr(), int(gated), code, wfmt, group,
                             None if shared is None else shared.data_ptr(),
                             0 if shared is None else shared.stride(0), out.data_ptr(), H),
          "hs_moe_experts (an expert index outside the block)")
    return out


ROUTER_MODES = {"topk_then_softmax": 0, "softmax_then_topk": 1}


def router_topk(logits: torch.Tensor, k: int, mode: str, normalize: bool = False,
                weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-k routing of logits (T, E): ``topk_then_softmax`` (the k largest logits, softmax over them)
    or ``softmax_then_topk`` (optionally renormalized). Returns (index (T, k) int64 by descending
    score, weight (T, k) in ``weight_dtype``), computed in float32; None when not covered."""
    lib = _library()
    if (lib is None or logits.dim() != 2 or not rows_ok(logits) or logits.dtype not in DTYPE_CODES
            or weight_dtype not in DTYPE_CODES or not 1 <= k <= min(64, logits.shape[1]) or mode not in ROUTER_MODES):
        return None
    T, E = logits.shape
    index = torch.empty(T, k, dtype=torch.int64)
    weight = torch.empty(T, k, dtype=weight_dtype)
    check(lib.hs_router_topk(DTYPE_CODES[logits.dtype], DTYPE_CODES[weight_dtype], T, E, k, logits.data_ptr(),
                             logits.stride(0), ROUTER_MODES[mode], int(normalize), index.data_ptr(), weight.data_ptr()),
          "hs_router_topk")
    return index, weight


def linear_f32(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """``(x.float() @ weight.T).to(out_dtype)``, sums in float32: routers' logits. x (M, K) float32 or
    16-bit; weight (N, K) contiguous float32. None when not covered."""
    lib = _library()
    if (lib is None or x.dim() != 2 or not rows_ok(x) or x.dtype not in DTYPE_CODES or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[1]
            or out_dtype not in DTYPE_CODES):
        return None
    M, N = x.shape[0], weight.shape[0]
    out = torch.empty(M, N, dtype=out_dtype)
    check(lib.hs_linear_f32(DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype], M, N, x.shape[1], x.data_ptr(), x.stride(0),
                            weight.data_ptr(), out.data_ptr(), N), "hs_linear_f32")
    return out


def per_head_linear_f32(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """``out[:, h] = (x[:, h].float() @ weight[h].T).to(out.dtype)`` for every head h, sums in float32
    (``hs_linear_f32`` once per head): a batched per-head matmul, MLA's absorbed up projections. x (T, H, K)
    and out (T, H, N), each with contiguous heads, float32 or 16-bit; weight (H, N, K) contiguous float32.
    Returns False, doing nothing, when not covered."""
    lib = _library()
    if (lib is None or x.dim() != 3 or out.dim() != 3 or weight.dim() != 3 or x.device.type != "cpu"
            or out.device.type != "cpu" or x.dtype not in DTYPE_CODES or out.dtype not in DTYPE_CODES
            or x.stride(2) != 1 or out.stride(2) != 1 or weight.dtype != torch.float32 or not weight.is_contiguous()
            or weight.device.type != "cpu" or x.shape[:2] != out.shape[:2] or weight.shape[0] != x.shape[1]
            or weight.shape[1] != out.shape[2] or weight.shape[2] != x.shape[2]):
        return False
    T, H, K = x.shape
    N = out.shape[2]
    for h in range(H):
        check(lib.hs_linear_f32(DTYPE_CODES[x.dtype], DTYPE_CODES[out.dtype], T, N, K, x[:, h].data_ptr(), x.stride(0),
                                weight[h].data_ptr(), out[:, h].data_ptr(), out.stride(0)), "hs_linear_f32")
    return True


def router_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                           normalize: bool, scale: float,
                           eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3-style routing of float32 logits (T, E) with a float32 correction ``bias`` (E,):
    (index (T, k) int64, weight (T, k) float32) as Nemotron-H's router computes them (``normalize``
    divides the chosen scores by their sum + ``eps``; LFM2-MoE's is ``n_group = topk_group = 1``,
    ``eps=1e-6``). None when not covered."""
    lib = _library()
    if (lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or not rows_ok(logits)
            or bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (logits.shape[1],)):
        return None
    T, E = logits.shape
    index = torch.empty(T, k, dtype=torch.int64)
    weight = torch.empty(T, k, dtype=torch.float32)
    check(lib.hs_router_grouped_sigmoid(T, E, k, logits.data_ptr(), logits.stride(0), bias.data_ptr(), n_group,
                                        topk_group, int(normalize), float(scale), float(eps), index.data_ptr(),
                                        weight.data_ptr()),
          "hs_router_grouped_sigmoid")
    return index, weight
