"""Python entry points of the C++ recurrent-layer kernels (``csrc/recurrent.cpp``) for the CPU.

Each function works on a group of packed sequences (a decode group or a prefill group, given by
``cu_seqlens``), reads and writes the pooled state in place through slot ids, in the state's own
dtype, and declines (returns None / False, doing nothing) when the call is one the kernels do not
cover (not on the CPU, a dtype or layout they do not take, or no compiled library); callers then
take the PyTorch path.
"""

from __future__ import annotations

import math

import torch

from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.kernels import fallbacks, isa
from hybridserve.kernels._abi import (
    DTYPE_CODES,
    bind,
    check,
    float_param_ok,
    index_ok,
    ptr,
    rows_ok,
)

MAX_CONV_WIDTH = 16  # kMaxTaps in csrc/recurrent.cpp
MAX_MAMBA1_STATE = 256  # kMaxStateN in csrc/recurrent.cpp
CHUNKED_SCAN_CHUNK = 64  # kSsdChunk in csrc/mamba2_chunked_amx.h: tokens per chunk
CHUNKED_SCAN_MIN_TOKENS = 64  # kSsdMinTokens there: sequences this long or longer take the chunked path


def chunked_scan_shape_ok(head_dim: int, d_state: int) -> bool:
    """Whether the chunked scan's tiles take this head_dim (a multiple of 16) and d_state (of 32)."""
    return head_dim > 0 and d_state > 0 and head_dim % 16 == 0 and d_state % 32 == 0


def mamba2_scan_path(act_dtype: torch.dtype, head_dim: int, d_state: int, num_tokens: int) -> str:
    """The path ``mamba2_scan`` takes for one sequence of ``num_tokens`` in a call: ``"chunked"`` (the SSD
    form, products on the AMX tiles: the amx level, bf16 activations, CHUNKED_SCAN_MIN_TOKENS or more tokens,
    a shape the tiles take) or ``"token"`` (the float32 token-by-token recurrence: decode, short chunks,
    float32/float16 activations, other shapes, CPUs without AMX)."""
    chunked = (isa.level_in_force() == "amx" and act_dtype == torch.bfloat16
               and num_tokens >= CHUNKED_SCAN_MIN_TOKENS and chunked_scan_shape_ok(head_dim, d_state))
    return "chunked" if chunked else "token"



def _library():
    return bind("recurrent")


def available() -> bool:
    """Whether the compiled kernels can be used in this process."""
    return _library() is not None


def tap_major(conv_weight: torch.Tensor) -> torch.Tensor:
    """A depthwise ``nn.Conv1d`` weight (D, 1, K) as the conv kernel takes it: (K, D) float32, contiguous."""
    return conv_weight.detach().squeeze(1).t().float().contiguous()


def conv_supported(conv_states: torch.Tensor | CodedConvState, weight_t: torch.Tensor, bias: torch.Tensor | None,
                   act_dtype: torch.dtype, activation: str | None) -> bool:
    """Whether ``causal_conv1d`` takes this state pool view (float, or 8-bit codes: cache/conv_codec.py), weight,
    bias, activation dtype and activation (the index tensors and input rows aside)."""
    if _library() is None or activation not in (None, "silu") or weight_t.dim() != 2:
        return False
    K, D = weight_t.shape
    if not (act_dtype in DTYPE_CODES and 1 <= K <= MAX_CONV_WIDTH and weight_t.is_contiguous()
            and float_param_ok(weight_t) and float_param_ok(bias)):
        return False
    if isinstance(conv_states, CodedConvState):
        codes, scale = conv_states.codes, conv_states.scale
        return (K >= 2 and codes.device.type == "cpu" and tuple(codes.shape[1:]) == (D, K - 1)
                and codes.stride()[1:] == (K - 1, 1) and scale.stride(1) == 1)
    return (conv_states.dtype in DTYPE_CODES and conv_states.device.type == "cpu"
            and tuple(conv_states.shape[1:]) == (D, K - 1)
            and (K == 1 or (conv_states.stride(2) == 1 and conv_states.stride(1) == K - 1)))


def conv_state_channels(conv_states: torch.Tensor | CodedConvState, start: int,
                        end: int) -> torch.Tensor | CodedConvState:
    """Channels ``start .. end - 1`` of a conv state pool view (slots, D, K-1): a slice of a float view, or of an
    8-bit one's codes and exponents."""
    if isinstance(conv_states, CodedConvState):
        return conv_states.channels(start, end)
    return conv_states[:, start:end]


def causal_conv1d(x: torch.Tensor, conv_states: torch.Tensor | CodedConvState, weight_t: torch.Tensor,
                  bias: torch.Tensor | None, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                  activation: str | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Varlen causal depthwise conv continuing each sequence's conv state (updated in place).

    x: (T, D) packed tokens; conv_states: (num_slots, D, K-1) pool view, or the codes and scales of an 8-bit conv
    state (cache/conv_codec.py: decoded and encoded in the kernel, code for code as the reference); weight_t: (K, D)
    float32 contiguous (the conv weight transposed, tap-major); bias: (D,) float32 or None; cu_seqlens: (S+1,)
    int64; state_indices: (S,) int64; out: (T, D) rows in x.dtype to write into, or None.
    Returns (T, D) in x.dtype (``out`` when given), or None when the kernel does not cover this call.
    """
    lib = _library()
    if (lib is None or not rows_ok(x) or not conv_supported(conv_states, weight_t, bias, x.dtype, activation)
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return None
    K, D = weight_t.shape
    act = DTYPE_CODES[x.dtype]
    if out is None:
        out = torch.empty(x.shape[0], D, dtype=x.dtype)  # (T, D)
    elif out.shape != (x.shape[0], D) or out.dtype != x.dtype or not rows_ok(out):
        return None
    if isinstance(conv_states, CodedConvState):
        codes, scale = conv_states.codes, conv_states.scale
        check(lib.hs_causal_conv1d_coded(act, state_indices.numel(), cu_seqlens.data_ptr(), state_indices.data_ptr(),
                                         x.data_ptr(), x.stride(0), codes.data_ptr(), codes.stride(0),
                                         scale.data_ptr(), scale.stride(0), weight_t.data_ptr(), ptr(bias),
                                         int(activation == "silu"), out.data_ptr(), out.stride(0), D, K),
              "hs_causal_conv1d_coded")
        return out
    st = DTYPE_CODES[conv_states.dtype]
    check(lib.hs_causal_conv1d(act, st, state_indices.numel(), cu_seqlens.data_ptr(), state_indices.data_ptr(),
                               x.data_ptr(), x.stride(0), conv_states.data_ptr(), conv_states.stride(0),
                               weight_t.data_ptr(), ptr(bias), int(activation == "silu"), out.data_ptr(),
                               out.stride(0), D, K), "hs_causal_conv1d")
    return out


def scan_state_supported(ssm_states: torch.Tensor, act_dtype: torch.dtype) -> bool:
    """Whether ``mamba2_scan`` takes this pool view (num_slots, H, P, N) with activations in act_dtype;
    lets a caller check before it changes any other state."""
    if _library() is None or ssm_states.dim() != 4 or ssm_states.device.type != "cpu":
        return False
    _, _, P, N = ssm_states.shape
    return (act_dtype in DTYPE_CODES and ssm_states.dtype in DTYPE_CODES
            and ssm_states.stride()[1:] == (P * N, N, 1))


def mamba2_scan(ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                dt_softplus: bool, dt_limit: tuple[float, float], cu_seqlens: torch.Tensor,
                state_indices: torch.Tensor, y: torch.Tensor) -> bool:
    """Mamba2 recurrence over packed sequences, continuing each slot's state (updated in place).

    ssm_states: (num_slots, H, P, N) pool view; x: (T, H*P); dt: (T, H); B, C: (T, G*N), all in one
    activation dtype with contiguous rows; A, D, dt_bias: (H,) float32 contiguous (D, dt_bias may be
    None); y: (T, H*P) float32 output rows. Returns False, doing nothing, when not covered.
    """
    lib = _library()
    if not scan_state_supported(ssm_states, x.dtype) or not all(rows_ok(t) for t in (x, dt, B, C, y)):
        return False
    _, H, P, N = ssm_states.shape
    G = B.shape[1] // N
    act, st = DTYPE_CODES[x.dtype], DTYPE_CODES[ssm_states.dtype]
    if (G < 1 or H % G != 0 or any(t.dtype != x.dtype for t in (dt, B, C)) or y.dtype != torch.float32
            or x.shape[1] != H * P or dt.shape[1] != H or C.shape[1] != G * N or G * N != B.shape[1]
            or A is None or not all(float_param_ok(t) for t in (A, D, dt_bias))
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    # a sequence of CHUNKED_SCAN_MIN_TOKENS needs T - S >= that - 1 (never so in a decode group, which a capture
    # records: the check below runs torch operators)
    if (x.dtype == torch.bfloat16 and x.shape[0] - state_indices.numel() >= CHUNKED_SCAN_MIN_TOKENS - 1
            and not chunked_scan_shape_ok(P, N) and isa.level_in_force() == "amx"):
        _record_chunked_decline(P, N, cu_seqlens)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    check(lib.hs_mamba2_scan(act, st, state_indices.numel(), cu_seqlens.data_ptr(), state_indices.data_ptr(),
                             x.data_ptr(), x.stride(0), B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0),
                             dt.data_ptr(), dt.stride(0), A.data_ptr(), ptr(D), ptr(dt_bias), int(dt_softplus),
                             int(lo > 0.0 or hi != math.inf), lo, hi, ssm_states.data_ptr(), ssm_states.stride(0),
                             y.data_ptr(), y.stride(0), H, P, G, N), "hs_mamba2_scan")
    return True


def _record_chunked_decline(P: int, N: int, cu_seqlens: torch.Tensor) -> None:
    """Count a call whose long bf16 sequences keep the token path because the tiles do not take the shape."""
    if cu_seqlens.numel() > 1 and int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) >= CHUNKED_SCAN_MIN_TOKENS:
        fallbacks.record("mamba2_chunked_scan", f"head_dim {P} (needs a multiple of 16) or d_state {N} (needs a "
                                                "multiple of 32): token-by-token scan")


def mamba1_scan(ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                dt_softplus: bool, cu_seqlens: torch.Tensor, state_indices: torch.Tensor, y: torch.Tensor) -> bool:
    """Mamba1 selective scan over packed sequences, continuing each slot's state (updated in place):
    ``y = (h . C + D * x) * silu(z)`` per token and channel. ssm_states: (num_slots, Dm, N) pool view;
    x, dt (raw, before bias and softplus), z: (T, Dm); B, C: (T, N), all in one activation dtype with
    contiguous rows; A: (Dm, N), D, dt_bias: (Dm,) float32 contiguous (D, dt_bias, z may be None); y:
    (T, Dm) rows in the activation dtype. Returns False, doing nothing, when not covered."""
    lib = _library()
    if (lib is None or ssm_states.dim() != 3 or ssm_states.device.type != "cpu" or x.dtype not in DTYPE_CODES
            or ssm_states.dtype not in DTYPE_CODES or ssm_states.stride()[1:] != (ssm_states.shape[2], 1)):
        return False
    _, Dm, N = ssm_states.shape
    tensors = [t for t in (x, dt, B, C, y, z) if t is not None]
    if (N > MAX_MAMBA1_STATE or not all(rows_ok(t) and t.dtype == x.dtype for t in tensors)
            or x.shape[1] != Dm or dt.shape[1] != Dm
            or B.shape[1] != N or C.shape[1] != N or y.shape[1] != Dm or (z is not None and z.shape[1] != Dm)
            or A.shape != (Dm, N) or not all(float_param_ok(t) for t in (A, D, dt_bias))
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    check(lib.hs_mamba1_scan(DTYPE_CODES[x.dtype], DTYPE_CODES[ssm_states.dtype], state_indices.numel(),
                             cu_seqlens.data_ptr(), state_indices.data_ptr(), x.data_ptr(), x.stride(0), dt.data_ptr(),
                             dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), ptr(D),
                             ptr(z), 0 if z is None else z.stride(0), ptr(dt_bias), int(dt_softplus),
                             ssm_states.data_ptr(), ssm_states.stride(0), y.data_ptr(), y.stride(0), Dm, N),
          "hs_mamba1_scan")
    return True


def linear_attention(states: torch.Tensor, qkv: torch.Tensor, num_heads: int, head_dim: int, decay: torch.Tensor,
                     cu_seqlens: torch.Tensor, state_indices: torch.Tensor, y: torch.Tensor) -> bool:
    """Decayed linear attention over packed sequences (MiniMax), continuing each slot's state (updated
    in place): ``S = exp(-decay) S + k v^T``, ``y = q S`` per token and head. states: (num_slots, H, D, D)
    pool view; qkv: (T, H * 3D) rows, per head ``[q | k | v]``; decay: (H,) float32; y: (T, H * D) rows in
    qkv's dtype. Returns False, doing nothing, when not covered."""
    lib = _library()
    H, D = num_heads, head_dim
    if (lib is None or states.dim() != 4 or tuple(states.shape[1:]) != (H, D, D) or states.dtype not in DTYPE_CODES
            or states.stride()[1:] != (D * D, D, 1) or states.device.type != "cpu" or qkv.dtype not in DTYPE_CODES
            or not rows_ok(qkv) or qkv.shape[1] != 3 * H * D or not rows_ok(y) or y.dtype != qkv.dtype
            or y.shape != (qkv.shape[0], H * D) or not float_param_ok(decay) or decay.shape != (H,)
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    item = qkv.element_size()
    check(lib.hs_linear_attention(DTYPE_CODES[qkv.dtype], DTYPE_CODES[states.dtype], state_indices.numel(),
                                  cu_seqlens.data_ptr(), state_indices.data_ptr(), qkv.data_ptr(),
                                  qkv.data_ptr() + D * item, qkv.data_ptr() + 2 * D * item, qkv.stride(0), 3 * D,
                                  decay.data_ptr(), states.data_ptr(), states.stride(0), y.data_ptr(), y.stride(0),
                                  H, D, D), "hs_linear_attention")
    return True


def gdn_split(qkvz: torch.Tensor, num_k_heads: int, head_k_dim: int, group_v: int
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta net's projection (T, Hk (2 Dk + 2 R Dv)), per key head ``[q | k | v | z]``,
    split into the conv input ``[all q | all k | all v]`` and z (T, Hk R Dv), both contiguous;
    ``group_v`` = R Dv. None when not covered."""
    lib = _library()
    Hk, Dk = num_k_heads, head_k_dim
    if (lib is None or qkvz.dim() != 2 or not rows_ok(qkvz) or qkvz.dtype not in DTYPE_CODES
            or qkvz.shape[1] != Hk * (2 * Dk + 2 * group_v)):
        return None
    T = qkvz.shape[0]
    mixed = torch.empty(T, 2 * Hk * Dk + Hk * group_v, dtype=qkvz.dtype)
    z = torch.empty(T, Hk * group_v, dtype=qkvz.dtype)
    check(lib.hs_gdn_split(DTYPE_CODES[qkvz.dtype], T, Hk, Dk, group_v, qkvz.data_ptr(), qkvz.stride(0),
                           mixed.data_ptr(), z.data_ptr()), "hs_gdn_split")
    return mixed, z


def gated_delta_rule(states: torch.Tensor, conv_out: torch.Tensor, ba: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, use_qk_l2norm: bool, cu_seqlens: torch.Tensor,
                     state_indices: torch.Tensor, out: torch.Tensor, num_k_heads: int, beta_scale: float = 1.0
                     ) -> bool:
    """Qwen3-Next's gated delta rule over packed sequences, continuing each slot's state (updated in
    place). states: (num_slots, Hv, Dk, Dv) pool view; conv_out: (T, 2 Hk Dk + Hv Dv) rows; ba: (T, 2 Hv)
    rows (per key head ``[b | a]``); A_log, dt_bias: (Hv,) float32; out: (T, Hv Dv) rows in the
    activation dtype; ``beta = beta_scale * sigmoid(b)`` (2 for OLMo-Hybrid's negative eigenvalues).
    Returns False, doing nothing, when not covered."""
    lib = _library()
    if (lib is None or states.dim() != 4 or states.device.type != "cpu" or states.dtype not in DTYPE_CODES
            or conv_out.dtype not in DTYPE_CODES):
        return False
    _, Hv, Dk, Dv = states.shape
    Hk = num_k_heads
    if (Hk < 1 or Hv % Hk or Dv > 1024 or states.stride()[1:] != (Dk * Dv, Dv, 1) or not rows_ok(conv_out)
            or conv_out.shape[1] != 2 * Hk * Dk + Hv * Dv or not rows_ok(ba) or ba.shape[1] != 2 * Hv
            or ba.dtype != conv_out.dtype or not rows_ok(out) or out.dtype != conv_out.dtype
            or out.shape != (conv_out.shape[0], Hv * Dv) or not float_param_ok(A_log) or not float_param_ok(dt_bias)
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    check(lib.hs_gated_delta_rule(DTYPE_CODES[conv_out.dtype], DTYPE_CODES[states.dtype], state_indices.numel(),
                                  cu_seqlens.data_ptr(), state_indices.data_ptr(), conv_out.data_ptr(),
                                  conv_out.stride(0), ba.data_ptr(), ba.stride(0), A_log.data_ptr(), dt_bias.data_ptr(),
                                  int(use_qk_l2norm), float(beta_scale), states.data_ptr(), states.stride(0),
                                  out.data_ptr(), out.stride(0), Hk, Hv, Dk, Dv), "hs_gated_delta_rule")
    return True


def mlstm(states: tuple[torch.Tensor, torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          o: torch.Tensor, i: torch.Tensor, f: torch.Tensor, gate_cap: float | None, norm_weight: torch.Tensor,
          norm_bias: torch.Tensor | None, norm_eps: float, eps: float, cu_seqlens: torch.Tensor,
          state_indices: torch.Tensor, out: torch.Tensor) -> bool:
    """xLSTM's mLSTM cell over packed sequences with its multi-head layer norm and output gate,
    continuing each slot's state (updated in place): ``out = sigmoid(o) * norm(h)``. states: the pool
    views C (num_slots, H, Dk, Dv), n (num_slots, H, Dk), m (num_slots, H), one dtype and slot stride;
    q, k: (T, H Dk), v, o: (T, H Dv), i, f: (T, H) raw gate pre-activations (soft-capped here by
    ``gate_cap``, None for none), all rows in one activation dtype; norm_weight, norm_bias: (H Dv,) in
    that dtype (bias may be None); out: (T, H Dv) rows in that dtype. Returns False, doing nothing,
    when not covered."""
    lib = _library()
    C, n, m = states
    if lib is None or C.dim() != 4 or n.dim() != 3 or m.dim() != 2 or C.device.type != "cpu":
        return False
    _, H, Dk, Dv = C.shape
    act = q.dtype
    acts = (q, k, v, o, i, f, out)
    if (act not in DTYPE_CODES or C.dtype not in DTYPE_CODES or n.dtype != C.dtype or m.dtype != C.dtype
            or C.stride()[1:] != (Dk * Dv, Dv, 1) or n.stride()[1:] != (Dk, 1) or m.stride(1) != 1
            or not C.stride(0) == n.stride(0) == m.stride(0) or tuple(n.shape[1:]) != (H, Dk)
            or tuple(m.shape[1:]) != (H,) or not all(rows_ok(t) and t.dtype == act for t in acts)
            or q.shape[1] != H * Dk or k.shape[1] != H * Dk or v.shape[1] != H * Dv or o.shape[1] != H * Dv
            or i.shape[1] != H or f.shape[1] != H or out.shape != (q.shape[0], H * Dv)
            or any(t is not None and (t.dtype != act or t.shape != (H * Dv,) or not t.is_contiguous()
                                      or t.device.type != "cpu") for t in (norm_weight, norm_bias))
            or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    check(lib.hs_mlstm(DTYPE_CODES[act], DTYPE_CODES[C.dtype], state_indices.numel(), cu_seqlens.data_ptr(),
                       state_indices.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                       v.stride(0), o.data_ptr(), o.stride(0), i.data_ptr(), i.stride(0), f.data_ptr(), f.stride(0),
                       float(gate_cap) if gate_cap is not None else 0.0, C.data_ptr(), n.data_ptr(), m.data_ptr(),
                       C.stride(0), norm_weight.data_ptr(), ptr(norm_bias), float(norm_eps), float(eps),
                       out.data_ptr(), out.stride(0), H, Dk, Dv), "hs_mlstm")
    return True


def kda(states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, use_qk_l2norm: bool, cu_seqlens: torch.Tensor,
        state_indices: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> bool:
    """Kimi delta attention over packed sequences, continuing each slot's state (updated in place):
    the gated delta rule with a per-channel decay ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` and
    ``beta = sigmoid(b)`` (``ops/kda.py``), then, with a gate, the sigmoid-gated norm
    ``norm_weight * rms_norm(o) * sigmoid(gate)`` per head. states: (num_slots, H, Dk, Dv) pool view;
    q, k, f: (T, H Dk), v: (T, H Dv), b: (T, H), gate: (T, H Dv) or None, rows in one activation dtype;
    A_log: (H,), dt_bias: (H Dk,), norm_weight: (Dv,) float32 contiguous; out: (T, H Dv) rows in the
    activation dtype. Returns False, doing nothing, when not covered."""
    lib = _library()
    if lib is None or states.dim() != 4 or states.device.type != "cpu" or states.dtype not in DTYPE_CODES:
        return False
    _, H, Dk, Dv = states.shape
    act = q.dtype
    acts = [t for t in (q, k, v, f, b, gate, out) if t is not None]
    if (act not in DTYPE_CODES or states.stride()[1:] != (Dk * Dv, Dv, 1)
            or not all(rows_ok(t) and t.dtype == act and t.shape[0] == q.shape[0] for t in acts)
            or q.shape[1] != H * Dk or k.shape[1] != H * Dk or f.shape[1] != H * Dk or v.shape[1] != H * Dv
            or b.shape[1] != H or out.shape[1] != H * Dv or (gate is not None and gate.shape[1] != H * Dv)
            or not float_param_ok(A_log) or A_log is None or A_log.shape != (H,)
            or not float_param_ok(dt_bias) or dt_bias is None or dt_bias.shape != (H * Dk,)
            or (gate is not None and (norm_weight is None or norm_weight.shape != (Dv,)))
            or not float_param_ok(norm_weight) or not index_ok(cu_seqlens) or not index_ok(state_indices)):
        return False
    check(lib.hs_kda(DTYPE_CODES[act], DTYPE_CODES[states.dtype], state_indices.numel(), cu_seqlens.data_ptr(),
                     state_indices.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                     v.stride(0), f.data_ptr(), f.stride(0), b.data_ptr(), b.stride(0), A_log.data_ptr(),
                     dt_bias.data_ptr(), int(use_qk_l2norm), states.data_ptr(), states.stride(0), ptr(gate),
                     0 if gate is None else gate.stride(0), ptr(norm_weight), float(norm_eps), out.data_ptr(),
                     out.stride(0), H, Dk, Dv), "hs_kda")
    return True
