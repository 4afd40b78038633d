"""Python entry points of the C++ bf16 linear kernel (``csrc/gemm.cpp``) for AVX-512 BF16 CPUs.

A weight is packed once (:func:`pack`) into 16-column panels; :func:`linear` then computes
``x @ W.T + b`` with float32 sums rounded once to bf16. Both return None, doing nothing, when the
call is one the kernel does not cover (not bf16 on the CPU, an odd in-feature count, a CPU without
AVX-512 BF16, or no compiled library); callers then keep the PyTorch path.
"""

from __future__ import annotations

import functools

import torch

from hybridserve.kernels._abi import I64, INT, PTR, bind, check

PANEL = 16  # output columns per packed panel (kPanel in csrc/gemm.cpp)

_SIGNATURES = {
    "hs_gemm_supported": [],
    "hs_pack_bf16": [I64, I64, PTR, I64, PTR],
    "hs_linear_bf16": [I64, I64, I64, PTR, I64, PTR, PTR, PTR, I64],
}


@functools.cache
def _library():
    """The bound library when it runs on this CPU, else None (checked once)."""
    lib = bind("gemm", _SIGNATURES)
    return lib if lib is not None and lib.hs_gemm_supported() == 1 else None


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed (out_features, in_features) weight: whole 16-column panels."""
    return -(-out_features // PANEL) * PANEL * in_features


def available() -> bool:
    """Whether the compiled kernel runs on this CPU in this process."""
    return _library() is not None


def cpu_lacks_bf16_dot() -> bool:
    """True when the library was built but this CPU has no AVX-512 BF16 (so the kernel is never used);
    False when it runs here, or when it could not be built at all."""
    lib = bind("gemm", _SIGNATURES)
    return lib is not None and lib.hs_gemm_supported() != 1


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight."""
    return (_library() is not None and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] >= 1 and weight.shape[1] >= 2
            and weight.shape[1] % 2 == 0 and weight.stride(1) == 1)


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight (N, K) bf16 -> its packed form (ceil(N / 16) * 16 * K,) bf16, written into ``out`` when
    given (a contiguous bf16 tensor of that many elements); None when not covered."""
    lib = _library()
    if not packable(weight):
        return None
    N, K = weight.shape
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != packed_numel(N, K)
                            or not out.is_contiguous() or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous bf16 CPU tensor of {packed_numel(N, K)} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    packed = torch.empty(packed_numel(N, K), dtype=torch.bfloat16) if out is None else out
    check(lib.hs_pack_bf16(N, K, weight.data_ptr(), weight.stride(0), packed.data_ptr()), "hs_pack_bf16")
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x (..., K) bf16 with W packed by :func:`pack`; (..., out_features) bf16.
    None when not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype != torch.bfloat16 or not x.is_cpu or K % 2 != 0
            or packed.numel() != packed_numel(out_features, K)):
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                             or bias.shape != (out_features,)):
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, out_features), dtype=torch.bfloat16)
    rc = lib.hs_linear_bf16(M, out_features, K, x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(), out_features)
    if rc != 0:
        check(rc, "hs_linear_bf16")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
