"""Python entry points of the C++ recurrent-layer kernels over 8-bit state (``csrc/recurrent.cpp``, the
``*_coded`` kernels; ``csrc/state_codec.h``).

Each function is the counterpart of the one of the same name in ``kernels/recurrent.py`` with the temporal
state a :class:`~hybridserve.cache.state_codec.CodedState` (int8 or float8 e4m3fn codes and float32 row
scales in the pool) in place of a float view: the kernel decodes a row, updates it in float32 and encodes it
back in place, code for code as ``cache/state_codec.py`` does (seeded stochastic rounding from the group's
rounding keys, its positions, tokens absorbed after the call, and the layer index; or to nearest, with no noise
hashed, where the state's kind rounds so: ``CodedState.stochastic``). A decode step works on
the codes row by row (Mamba2) or through a float32 scratch of one head (the others); a prefill chunk decodes
each head's state once and encodes its final state once. Each declines (returns False, doing nothing) when
the call is one the kernels do not cover; callers then take the PyTorch path.
"""

from __future__ import annotations

import math

import torch

from hybridserve.cache.state_codec import CodedState
from hybridserve.kernels._abi import DTYPE_CODES, bind, check, float_param_ok, index_ok, ptr, rows_ok
from hybridserve.kernels.recurrent import MAX_MAMBA1_STATE

#: the code dtypes the kernels take -> their dtype codes (csrc/state_codec.h: CodeDType)
CODE_DTYPES = {torch.int8: 3, torch.float8_e4m3fn: 4}


def _library():
    return bind("recurrent")


def coded_ok(state: object, shape: tuple[int, ...]) -> bool:
    """Whether ``state`` is a CodedState of per-slot ``shape`` the kernels take: CPU, a code dtype they know,
    each slot's codes (``shape``) and scales (``shape[:-1]``) contiguous. (A tensor-parallel rank's slice is
    taken too: the kernels number its noise from its ``offset``.)"""
    if not isinstance(state, CodedState) or _library() is None:
        return False
    codes, scale = state.codes, state.scale
    return (codes.dtype in CODE_DTYPES and codes.device.type == "cpu" and scale.device.type == "cpu"
            and tuple(codes.shape[1:]) == tuple(shape) and _slot_contiguous(codes) and _slot_contiguous(scale))


def _slot_contiguous(t: torch.Tensor) -> bool:
    expected, step = [], 1
    for d in reversed(t.shape[1:]):
        expected.append(step)
        step *= d
    return all(s == e or n == 1 for s, e, n in zip(t.stride()[1:], reversed(expected), t.shape[1:]))


def rounding_ok(keys: torch.Tensor | None, positions: torch.Tensor, state_indices: torch.Tensor) -> bool:
    """Whether the group's rounding keys (or None), positions and slots are (S,) contiguous int64 CPU tensors."""
    n = state_indices.numel()
    return (index_ok(state_indices) and index_ok(positions) and positions.numel() == n
            and (keys is None or (index_ok(keys) and keys.numel() == n)))


def group_ok(state: object, shape: tuple[int, ...], act_dtype: torch.dtype, keys: torch.Tensor | None,
             positions: torch.Tensor, state_indices: torch.Tensor) -> bool:
    """Whether a kernel takes this 8-bit state of per-slot ``shape`` for a group with activations in
    ``act_dtype``, its rounding keys, positions and slots (lets a caller check before it changes other state)."""
    return (coded_ok(state, shape) and act_dtype in DTYPE_CODES
            and rounding_ok(keys, positions, state_indices))


def _state_args(state: CodedState, keys: torch.Tensor | None, positions: torch.Tensor) -> tuple:
    """codes, their slot stride, scales, theirs, keys (or None), positions, layer, the noise's element offset,
    whether the rounding is stochastic (0: to nearest): the kernels' state arguments."""
    return (state.codes.data_ptr(), state.codes.stride(0), state.scale.data_ptr(), state.scale.stride(0), ptr(keys),
            positions.data_ptr(), int(state.layer), int(state.offset), int(state.stochastic))


def mamba2_scan(state: CodedState, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                dt_limit: tuple[float, float], cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                keys: torch.Tensor | None, positions: torch.Tensor, y: torch.Tensor) -> bool:
    """``recurrent.mamba2_scan`` on an 8-bit state (slots, H, P, N); keys, positions: (S,) int64 (keys None
    for all 0). Returns False, doing nothing, when not covered."""
    lib = _library()
    if lib is None or not isinstance(state, CodedState) or len(state.shape) != 4:
        return False
    _, H, P, N = state.shape
    G = B.shape[1] // N if B.dim() == 2 else 0
    if (not coded_ok(state, (H, P, N)) or x.dtype not in DTYPE_CODES or G < 1 or H % G != 0
            or not all(rows_ok(t) for t in (x, dt, B, C, y)) or any(t.dtype != x.dtype for t in (dt, B, C))
            or y.dtype != torch.float32 or x.shape[1] != H * P or dt.shape[1] != H or B.shape[1] != G * N
            or C.shape[1] != G * N or A is None or not all(float_param_ok(t) for t in (A, D, dt_bias))
            or not index_ok(cu_seqlens) or not rounding_ok(keys, positions, state_indices)):
        return False
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    check(lib.hs_mamba2_scan_coded(DTYPE_CODES[x.dtype], CODE_DTYPES[state.dtype], state_indices.numel(),
                                   cu_seqlens.data_ptr(), state_indices.data_ptr(), x.data_ptr(), x.stride(0),
                                   B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), dt.data_ptr(), dt.stride(0),
                                   A.data_ptr(), ptr(D), ptr(dt_bias), int(dt_softplus),
                                   int(lo > 0.0 or hi != math.inf), lo, hi, *_state_args(state, keys, positions),
                                   y.data_ptr(), y.stride(0), H, P, G, N), "hs_mamba2_scan_coded")
    return True


def mamba1_scan(state: CodedState, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                dt_softplus: bool, cu_seqlens: torch.Tensor, state_indices: torch.Tensor, keys: torch.Tensor | None,
                positions: torch.Tensor, y: torch.Tensor) -> bool:
    """``recurrent.mamba1_scan`` on an 8-bit state (slots, Dm, N). Returns False, doing nothing, when not
    covered."""
    lib = _library()
    if lib is None or not isinstance(state, CodedState) or len(state.shape) != 3:
        return False
    _, Dm, N = state.shape
    tensors = [t for t in (x, dt, B, C, y, z) if t is not None]
    if (not coded_ok(state, (Dm, N)) or x.dtype not in DTYPE_CODES or N > MAX_MAMBA1_STATE
            or not all(rows_ok(t) and t.dtype == x.dtype for t in tensors) or x.shape[1] != Dm
            or dt.shape[1] != Dm or B.shape[1] != N or C.shape[1] != N or y.shape[1] != Dm
            or (z is not None and z.shape[1] != Dm) or A.shape != (Dm, N)
            or not all(float_param_ok(t) for t in (A, D, dt_bias)) or not index_ok(cu_seqlens)
            or not rounding_ok(keys, positions, state_indices)):
        return False
    check(lib.hs_mamba1_scan_coded(DTYPE_CODES[x.dtype], CODE_DTYPES[state.dtype], state_indices.numel(),
                                   cu_seqlens.data_ptr(), state_indices.data_ptr(), x.data_ptr(), x.stride(0),
                                   dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0), C.data_ptr(),
                                   C.stride(0), ptr(D), ptr(z), 0 if z is None else z.stride(0), ptr(dt_bias),
                                   int(dt_softplus), *_state_args(state, keys, positions), y.data_ptr(), y.stride(0),
                                   Dm, N), "hs_mamba1_scan_coded")
    return True


def linear_attention(state: CodedState, qkv: torch.Tensor, num_heads: int, head_dim: int, decay: torch.Tensor,
                     cu_seqlens: torch.Tensor, state_indices: torch.Tensor, keys: torch.Tensor | None,
                     positions: torch.Tensor, y: torch.Tensor) -> bool:
    """``recurrent.linear_attention`` on an 8-bit state (slots, H, D, D). Returns False, doing nothing, when
    not covered."""
    lib = _library()
    H, D = num_heads, head_dim
    if (lib is None or not coded_ok(state, (H, D, D)) or qkv.dtype not in DTYPE_CODES or not rows_ok(qkv)
            or qkv.shape[1] != 3 * H * D or not rows_ok(y) or y.dtype != qkv.dtype
            or y.shape != (qkv.shape[0], H * D) or not float_param_ok(decay) or decay.shape != (H,)
            or not index_ok(cu_seqlens) or not rounding_ok(keys, positions, state_indices)):
        return False
    item = qkv.element_size()
    check(lib.hs_linear_attention_coded(DTYPE_CODES[qkv.dtype], CODE_DTYPES[state.dtype], state_indices.numel(),
                                        cu_seqlens.data_ptr(), state_indices.data_ptr(), qkv.data_ptr(),
                                        qkv.data_ptr() + D * item, qkv.data_ptr() + 2 * D * item, qkv.stride(0),
                                        3 * D, decay.data_ptr(), *_state_args(state, keys, positions), y.data_ptr(),
                                        y.stride(0), H, D, D), "hs_linear_attention_coded")
    return True


def gated_delta_rule(state: CodedState, conv_out: torch.Tensor, ba: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, use_qk_l2norm: bool, cu_seqlens: torch.Tensor,
                     state_indices: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor,
                     out: torch.Tensor, num_k_heads: int, beta_scale: float = 1.0) -> bool:
    """``recurrent.gated_delta_rule`` on an 8-bit state (slots, Hv, Dk, Dv). Returns False, doing nothing,
    when not covered."""
    lib = _library()
    if lib is None or not isinstance(state, CodedState) or len(state.shape) != 4:
        return False
    _, Hv, Dk, Dv = state.shape
    Hk = num_k_heads
    if (not coded_ok(state, (Hv, Dk, Dv)) or conv_out.dtype not in DTYPE_CODES or Hk < 1 or Hv % Hk or Dv > 1024
            or not rows_ok(conv_out) or conv_out.shape[1] != 2 * Hk * Dk + Hv * Dv or not rows_ok(ba)
            or ba.shape[1] != 2 * Hv or ba.dtype != conv_out.dtype or not rows_ok(out) or out.dtype != conv_out.dtype
            or out.shape != (conv_out.shape[0], Hv * Dv) or not float_param_ok(A_log) or not float_param_ok(dt_bias)
            or not index_ok(cu_seqlens) or not rounding_ok(keys, positions, state_indices)):
        return False
    check(lib.hs_gated_delta_rule_coded(DTYPE_CODES[conv_out.dtype], CODE_DTYPES[state.dtype], state_indices.numel(),
                                        cu_seqlens.data_ptr(), state_indices.data_ptr(), conv_out.data_ptr(),
                                        conv_out.stride(0), ba.data_ptr(), ba.stride(0), A_log.data_ptr(),
                                        dt_bias.data_ptr(), int(use_qk_l2norm), float(beta_scale),
                                        *_state_args(state, keys, positions), out.data_ptr(), out.stride(0), Hk, Hv,
                                        Dk, Dv), "hs_gated_delta_rule_coded")
    return True


def kda(state: CodedState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, use_qk_l2norm: bool, cu_seqlens: torch.Tensor,
        state_indices: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor, out: torch.Tensor,
        gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> bool:
    """``recurrent.kda`` on an 8-bit state (slots, H, Dk, Dv). Returns False, doing nothing, when not covered."""
    lib = _library()
    if lib is None or not isinstance(state, CodedState) or len(state.shape) != 4:
        return False
    _, H, Dk, Dv = state.shape
    act = q.dtype
    acts = [t for t in (q, k, v, f, b, gate, out) if t is not None]
    if (not coded_ok(state, (H, Dk, Dv)) or act not in DTYPE_CODES
            or not all(rows_ok(t) and t.dtype == act and t.shape[0] == q.shape[0] for t in acts)
            or q.shape[1] != H * Dk or k.shape[1] != H * Dk or f.shape[1] != H * Dk or v.shape[1] != H * Dv
            or b.shape[1] != H or out.shape[1] != H * Dv or (gate is not None and gate.shape[1] != H * Dv)
            or A_log is None or not float_param_ok(A_log) or A_log.shape != (H,)
            or dt_bias is None or not float_param_ok(dt_bias) or dt_bias.shape != (H * Dk,)
            or (gate is not None and (norm_weight is None or norm_weight.shape != (Dv,)))
            or not float_param_ok(norm_weight) or not index_ok(cu_seqlens)
            or not rounding_ok(keys, positions, state_indices)):
        return False
    check(lib.hs_kda_coded(DTYPE_CODES[act], CODE_DTYPES[state.dtype], state_indices.numel(), cu_seqlens.data_ptr(),
                           state_indices.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                           v.data_ptr(), v.stride(0), f.data_ptr(), f.stride(0), b.data_ptr(), b.stride(0),
                           A_log.data_ptr(), dt_bias.data_ptr(), int(use_qk_l2norm),
                           *_state_args(state, keys, positions), ptr(gate), 0 if gate is None else gate.stride(0),
                           ptr(norm_weight), float(norm_eps), out.data_ptr(), out.stride(0), H, Dk, Dv),
          "hs_kda_coded")
    return True


def mlstm(states: tuple[CodedState, CodedState, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          o: torch.Tensor, i: torch.Tensor, f: torch.Tensor, gate_cap: float | None, norm_weight: torch.Tensor,
          norm_bias: torch.Tensor | None, norm_eps: float, eps: float, cu_seqlens: torch.Tensor,
          state_indices: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor, out: torch.Tensor) -> bool:
    """``recurrent.mlstm`` with C (slots, H, Dk, Dv) and n (slots, H, Dk) 8-bit (one code dtype, one layer)
    and m (slots, H) a float view. Returns False, doing nothing, when not covered."""
    lib = _library()
    C, n, m = states
    if lib is None or not isinstance(C, CodedState) or not isinstance(n, CodedState) or len(C.shape) != 4:
        return False
    _, H, Dk, Dv = C.shape
    act = q.dtype
    acts = (q, k, v, o, i, f, out)
    if (not coded_ok(C, (H, Dk, Dv)) or not coded_ok(n, (H, Dk)) or n.dtype != C.dtype or n.layer != C.layer
            or n.stochastic != C.stochastic
            or not isinstance(m, torch.Tensor) or m.dtype not in DTYPE_CODES or m.device.type != "cpu"
            or tuple(m.shape[1:]) != (H,) or m.stride(1) != 1 or act not in DTYPE_CODES
            or not all(rows_ok(t) and t.dtype == act for t in acts)
            or q.shape[1] != H * Dk or k.shape[1] != H * Dk or v.shape[1] != H * Dv or o.shape[1] != H * Dv
            or i.shape[1] != H or f.shape[1] != H or out.shape != (q.shape[0], H * Dv)
            or any(t is not None and (t.dtype != act or t.shape != (H * Dv,) or not t.is_contiguous()
                                      or t.device.type != "cpu") for t in (norm_weight, norm_bias))
            or not index_ok(cu_seqlens) or not rounding_ok(keys, positions, state_indices)):
        return False
    c_args, n_args = _state_args(C, keys, positions), _state_args(n, keys, positions)
    check(lib.hs_mlstm_coded(DTYPE_CODES[act], CODE_DTYPES[C.dtype], state_indices.numel(), cu_seqlens.data_ptr(),
                             state_indices.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                             v.data_ptr(), v.stride(0), o.data_ptr(), o.stride(0), i.data_ptr(), i.stride(0),
                             f.data_ptr(), f.stride(0), float(gate_cap) if gate_cap is not None else 0.0,
                             *c_args[:4], *n_args[:4], *c_args[4:8], n_args[7], c_args[8], DTYPE_CODES[m.dtype],
                             m.data_ptr(),
                             m.stride(0), norm_weight.data_ptr(), ptr(norm_bias), float(norm_eps), float(eps),
                             out.data_ptr(), out.stride(0), H, Dk, Dv), "hs_mlstm_coded")
    return True
