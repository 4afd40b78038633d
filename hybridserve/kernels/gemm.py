"""Python entry points of the C++ 16-bit linear kernels (``csrc/gemm.cpp``) for the CPU.

A bf16 or fp16 weight is packed once (:func:`pack`) into 16-column panels; :func:`linear` then
computes ``x @ W.T + b`` with float32 sums rounded once to the activation dtype, the weights staying
16-bit in memory. On avx512_bf16 CPUs bf16 runs on AVX-512 BF16 dot products; everywhere else (and
for fp16) the weights are widened to float32 in registers (AVX2 + FMA, AVX-512, or the portable
vector code of a generic build). Both return None, doing nothing, when the call is one the kernel
does not cover (another dtype, not on the CPU, or no compiled library); callers then keep the
PyTorch path.
"""

from __future__ import annotations

import torch

from hybridserve.kernels._abi import bind, check

PANEL = 16  # output columns per packed panel (kPanel in csrc/gemm.cpp)
DTYPES = (torch.bfloat16, torch.float16)  # weight (and activation) dtypes the kernels take

_PACK = {torch.bfloat16: "hs_pack_bf16", torch.float16: "hs_pack_f16"}
LINEAR = {torch.bfloat16: "hs_linear_bf16", torch.float16: "hs_linear_f16"}  # C function per dtype


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


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight."""
    return (_library() is not None and weight.dim() == 2 and weight.dtype in DTYPES
            and weight.device.type == "cpu" and weight.shape[0] >= 1 and weight.shape[1] >= 1
            and weight.stride(1) == 1)


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight (N, K) bf16/fp16 -> its packed form (packed_numel(N, K),) of the same dtype, written into
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


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x (..., K) in the packed weight's dtype, W packed by :func:`pack`;
    (..., out_features) in that dtype. None when not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype != packed.dtype or x.dtype not in DTYPES or not x.is_cpu
            or packed.numel() != packed_numel(out_features, K)):
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.shape != (out_features,)):
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.stride(1) != 1 and K > 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, out_features), dtype=x.dtype)
    fn = LINEAR[x.dtype]
    rc = getattr(lib, fn)(M, out_features, K, x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), out_features)
    if rc != 0:
        check(rc, fn)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
