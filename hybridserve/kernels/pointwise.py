"""Python entry points of the C++ row-wise kernels (``csrc/pointwise.cpp``) for the CPU: RMS norms
(optionally fused with the residual add before them; over a float32 residual stream; the families'
roundings), the gated group norms of Mamba2 and Qwen3-Next, Mamba2's gate without a norm, the
activations (silu(a) * b, gelu(a) * b, silu, relu2, sigmoid gates), element-wise glue (add, mul, scale,
concat), row gathers (embeddings, RoPE tables), RoPE, and the sampler's argmax + logsumexp.

Each reproduces the rounding of the PyTorch code it replaces and returns None, doing nothing, when
the call is one it does not cover (not on the CPU, a dtype or layout it does not take, or no
compiled library); callers then take the PyTorch path.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridserve.kernels._abi import DTYPE_CODES, bind, check, index_ok, rows_ok

MAX_ROTARY = 1024  # kMaxRotary in csrc/pointwise.cpp
_MAX_ROW = 8192


def _library():
    return bind("pointwise")


def available() -> bool:
    """Whether the compiled kernels can be used in this process."""
    return _library() is not None


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """t (..., D) as a (rows, D) view with contiguous rows, or None when no such view exists."""
    if t.dim() == 2:
        return t if rows_ok(t) else None
    try:
        r = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return r if rows_ok(r) else None


def _weight_ok(w: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
    return w.dtype == dtype and w.device.type == "cpu" and w.is_contiguous() and w.shape == (width,)


def covers_norm_weight(weight: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
    """Whether ``rms_norm`` takes rows of ``width`` features in ``dtype`` with this weight."""
    return _library() is not None and dtype in DTYPE_CODES and width <= _MAX_ROW and _weight_ok(weight, dtype, width)


def covers_gated_norm(weight: torch.Tensor, dtype: torch.dtype, width: int, group_size: int) -> bool:
    """Whether ``gated_rms_norm`` takes rows of ``width`` features in ``dtype`` (gate and output) with
    this weight and group size."""
    return (_library() is not None and dtype in DTYPE_CODES and _weight_ok(weight, dtype, width)
            and 1 <= group_size <= _MAX_ROW and width % group_size == 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             residual: torch.Tensor | None = None, scale: float = 1.0, weight_in_float32: bool = False):
    """``RMSNorm`` of x (..., D). With ``residual`` (x's shape), first x = x + residual * scale (each
    op rounded to x's dtype) and returns (new x, normed); else returns normed. ``weight_in_float32``:
    the weight multiplies the float32 normalized value, rounded once after (Nemotron-H's norm). None
    when not covered."""
    lib = _library()
    if x.dim() < 1 or not covers_norm_weight(weight, x.dtype, x.shape[-1]):
        return None
    D = x.shape[-1]
    act = DTYPE_CODES[x.dtype]
    x2 = _rows(x)
    if x2 is None:
        return None
    h2 = None
    if residual is not None:
        h2 = _rows(residual)
        if h2 is None or residual.shape != x.shape or residual.dtype != x.dtype:
            return None
    out = torch.empty(x.shape, dtype=x.dtype)
    o2 = out.view(-1, D)
    x_new = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    n2 = x_new.view(-1, D) if x_new is not None else None
    check(lib.hs_rms_norm(act, x2.shape[0], D, x2.data_ptr(), x2.stride(0),
                          None if h2 is None else h2.data_ptr(), 0 if h2 is None else h2.stride(0), float(scale),
                          None if n2 is None else n2.data_ptr(), 0 if n2 is None else n2.stride(0),
                          weight.data_ptr(), float(eps), 2 if weight_in_float32 else int(zero_centered), o2.data_ptr(),
                          o2.stride(0)),
          "hs_rms_norm")
    return out if residual is None else (x_new, out)


def rms_norm_stream(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    round_input: bool = True):
    """RMS norm over a float32 residual stream, normed output in ``weight``'s dtype (Mamba2 with
    ``residual_in_fp32``). With ``residual`` (T, D) in weight's dtype: ``x = x.float() + residual``
    (x float32, or weight's dtype for the first layer) and returns (new x float32, normed), else
    returns normed. ``round_input``: the norm of ``x.to(dtype)`` (a layer's norm) rather than of the
    float32 x with the weight widened (a final norm). None when not covered."""
    lib = _library()
    dtype = weight.dtype
    if (lib is None or x.dim() != 2 or x.dtype not in (torch.float32, dtype) or dtype not in DTYPE_CODES
            or not covers_norm_weight(weight, dtype, x.shape[-1]) or not rows_ok(x)
            or (residual is None and x.dtype != torch.float32)):
        return None
    T, D = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != dtype or not rows_ok(residual)):
        return None
    out = torch.empty(T, D, dtype=dtype)
    x_new = torch.empty(T, D, dtype=torch.float32) if residual is not None else None
    check(lib.hs_rms_norm_stream(DTYPE_CODES[dtype], DTYPE_CODES[x.dtype], T, D, x.data_ptr(), x.stride(0),
                                 None if residual is None else residual.data_ptr(),
                                 0 if residual is None else residual.stride(0),
                                 None if x_new is None else x_new.data_ptr(), 0 if x_new is None else D,
                                 weight.data_ptr(), float(eps), int(round_input), out.data_ptr(), D),
          "hs_rms_norm_stream")
    return out if residual is None else (x_new, out)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   norm_in_float32: bool, norm_before_gate: bool = False) -> torch.Tensor | None:
    """Mamba2's gated group norm: y (T, D) float32, gate (T, D) -> (T, D) in gate's dtype, as
    ``GatedRMSNorm(y.to(dtype), gate)`` or, with ``norm_in_float32``, ``GatedRMSNorm(y, gate).to(dtype)``;
    with ``norm_before_gate`` (float32 throughout), ``(GatedRMSNorm(y, None) * silu(gate.float())).to(dtype)``.
    None when not covered."""
    lib = _library()
    if lib is None or y.dtype != torch.float32 or not rows_ok(y) or not rows_ok(gate) or y.shape != gate.shape:
        return None
    T, D = y.shape
    if not covers_gated_norm(weight, gate.dtype, D, group_size):
        return None
    act = DTYPE_CODES[gate.dtype]
    mode = 2 if norm_before_gate else int(norm_in_float32)  # csrc/pointwise.cpp: gated_rms_norm_impl
    out = torch.empty(T, D, dtype=gate.dtype)
    check(lib.hs_gated_rms_norm(act, T, D, y.data_ptr(), y.stride(0), gate.data_ptr(), gate.stride(0),
                                weight.data_ptr(), group_size, float(eps), mode, out.data_ptr(),
                                out.stride(0)), "hs_gated_rms_norm")
    return out


def silu_gate(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """The Mamba2 gate without a norm: y (T, D) float32, gate (T, D) -> ``(y * silu(gate)).to(gate.dtype)``,
    silu rounded to gate's dtype and the product taken in float32. None when not covered."""
    lib = _library()
    if (lib is None or y.dtype != torch.float32 or y.dim() != 2 or y.shape != gate.shape
            or gate.dtype not in DTYPE_CODES or not rows_ok(y) or not rows_ok(gate)):
        return None
    T, D = y.shape
    out = torch.empty(T, D, dtype=gate.dtype)
    check(lib.hs_silu_gate_f32(DTYPE_CODES[gate.dtype], T, D, y.data_ptr(), y.stride(0), gate.data_ptr(),
                               gate.stride(0), out.data_ptr(), out.stride(0)), "hs_silu_gate_f32")
    return out


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``gelu(a) * b`` (the exact, erf gelu) for a, b (T, D) in one dtype, each op rounded to it. None
    when not covered."""
    return _elementwise(a, b, lambda lib, code, a2, b2, o2: check(lib.hs_gelu_mul(
        code, a2.shape[0], a2.shape[1], a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0), o2.data_ptr(),
        o2.stride(0)), "hs_gelu_mul"))


def concat_cols(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``torch.cat([a, b], dim=-1)`` for a (T, Da), b (T, Db) of one dtype. None when not covered."""
    lib = _library()
    if (lib is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype
            or a.dtype not in DTYPE_CODES or not rows_ok(a) or not rows_ok(b)):
        return None
    T, Da, Db = a.shape[0], a.shape[1], b.shape[1]
    out = torch.empty(T, Da + Db, dtype=a.dtype)
    check(lib.hs_concat_cols(DTYPE_CODES[a.dtype], T, Da, a.data_ptr(), a.stride(0), Db, b.data_ptr(), b.stride(0),
                             out.data_ptr(), Da + Db), "hs_concat_cols")
    return out


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``silu(a) * b`` for a, b (T, D) in one dtype (each op rounded to it). None when not covered."""
    lib = _library()
    if lib is None or a.shape != b.shape or a.dtype != b.dtype:
        return None
    a2, b2 = _rows(a), _rows(b)
    act = DTYPE_CODES.get(a.dtype)
    if act is None or a2 is None or b2 is None:
        return None
    out = torch.empty(a.shape, dtype=a.dtype)
    o2 = out.view(-1, a.shape[-1])
    check(lib.hs_silu_mul(act, a2.shape[0], a2.shape[1], a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0),
                          o2.data_ptr(), o2.stride(0)), "hs_silu_mul")
    return out


def rotary(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """In place on x (T, num_heads * head_dim) rows: ``layers.rotary.apply_rotary`` of each head with cos,
    sin (T, R) in x's dtype, bit for bit. Returns False, doing nothing, when not covered."""
    lib = _library()
    R = cos.shape[-1] if cos.dim() == 2 else 0
    if (lib is None or not rows_ok(x) or x.shape[1] != num_heads * head_dim or cos.shape != sin.shape
            or cos.shape[0] != x.shape[0] or not covers_rotary(R, head_dim, x.dtype)
            or any(t.dtype != x.dtype or not t.is_contiguous() for t in (cos, sin))):
        return False
    check(lib.hs_rotary(DTYPE_CODES[x.dtype], x.shape[0], num_heads, head_dim, R, x.data_ptr(), x.stride(0),
                        cos.data_ptr(), sin.data_ptr(), R), "hs_rotary")
    return True


def covers_rotary(rotary_dim: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``rotary`` takes ``rotary_dim`` of ``head_dim`` features in ``dtype``."""
    return (_library() is not None and dtype in DTYPE_CODES and rotary_dim >= 2 and rotary_dim % 2 == 0
            and rotary_dim <= min(head_dim, MAX_ROTARY))


def _binary_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in DTYPE_CODES or a.dim() < 1:
        return None
    a2, b2 = _rows(a), _rows(b)
    return None if a2 is None or b2 is None else (a2, b2)


def _elementwise(a: torch.Tensor, b: torch.Tensor | None, call) -> torch.Tensor | None:
    """Run a row-wise kernel over a (and b, of a's shape and dtype) into a new tensor like a:
    ``call(lib, code, a_rows, b_rows, out_rows)`` makes the kernel's call. None when not covered."""
    lib, a2 = _library(), _rows(a)
    if lib is None or a2 is None or a.dtype not in DTYPE_CODES:
        return None
    b2 = None
    if b is not None:
        rows = _binary_rows(a, b)
        if rows is None:
            return None
        b2 = rows[1]
    out = torch.empty(a.shape, dtype=a.dtype)
    o2 = out.view(-1, a.shape[-1])
    call(lib, DTYPE_CODES[a.dtype], a2, b2, o2)
    return out


def add(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
    """``a + b * scale`` for a, b of one shape and dtype, each op rounded to it. None when not covered."""
    return _elementwise(a, b, lambda lib, code, a2, b2, o2: check(lib.hs_add(
        code, a2.shape[0], a2.shape[1], a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0), float(scale),
        o2.data_ptr(), o2.stride(0)), "hs_add"))


def scale(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor | None:
    """``x * factor``, a Python float or a (D,) tensor in x's dtype (one factor per column), rounded to
    x's dtype as PyTorch rounds it. None when not covered."""
    lib, x2 = _library(), _rows(x)
    cols = factor if isinstance(factor, torch.Tensor) else None
    cols_ok = cols is None or (cols.dtype == x.dtype and cols.shape == (x.shape[-1],) and cols.is_contiguous())
    if lib is None or x2 is None or x.dtype not in DTYPE_CODES or not cols_ok:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    o2 = out.view(-1, x.shape[-1])
    check(lib.hs_scale(DTYPE_CODES[x.dtype], x2.shape[0], x2.shape[1], x2.data_ptr(), x2.stride(0),
                       0.0 if cols is not None else float(factor), None if cols is None else cols.data_ptr(),
                       o2.data_ptr(), o2.stride(0)), "hs_scale")
    return out


def silu(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x)`` rounded to x's dtype. None when not covered."""
    return _elementwise(x, None, lambda lib, code, x2, _, o2: check(lib.hs_silu_or_sigmoid_mul(
        code, 0, x2.shape[0], x2.shape[1], x2.data_ptr(), x2.stride(0), None, 0, o2.data_ptr(), o2.stride(0)),
        "hs_silu_or_sigmoid_mul"))


def sigmoid_mul(gate: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``sigmoid(gate) * b`` for gate, b of one shape and dtype, each op rounded to it. None when not covered."""
    return _elementwise(gate, b, lambda lib, code, g2, b2, o2: check(lib.hs_silu_or_sigmoid_mul(
        code, 1, g2.shape[0], g2.shape[1], g2.data_ptr(), g2.stride(0), b2.data_ptr(), b2.stride(0), o2.data_ptr(),
        o2.stride(0)), "hs_silu_or_sigmoid_mul"))


def norm_then_gate(x: torch.Tensor, weight: torch.Tensor, eps: float, z: torch.Tensor) -> torch.Tensor | None:
    """Qwen3-Next's gated norm of rows x (T, D) with gate z (T, D): ``weight * norm(x)`` (rounded), then
    times ``silu(z)`` in float32, rounded. None when not covered."""
    lib, rows = _library(), _binary_rows(x, z)
    if lib is None or rows is None or not covers_norm_weight(weight, x.dtype, x.shape[-1]):
        return None
    (x2, z2), out = rows, torch.empty(x.shape, dtype=x.dtype)
    o2 = out.view(-1, x.shape[-1])
    check(lib.hs_norm_then_gate(DTYPE_CODES[x.dtype], x2.shape[0], x2.shape[1], x2.data_ptr(), x2.stride(0),
                                weight.data_ptr(), float(eps), z2.data_ptr(), z2.stride(0), o2.data_ptr(),
                                o2.stride(0)), "hs_norm_then_gate")
    return out


def row_sigmoid_gate(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``sigmoid(gate) * x`` for gate (T, 1) and x (T, D) of one dtype (each op rounded to it): a shared
    expert's scalar gate. None when not covered."""
    lib, x2 = _library(), _rows(x)
    if (lib is None or x2 is None or x.dim() != 2 or gate.dim() != 2 or gate.shape != (x.shape[0], 1)
            or gate.dtype != x.dtype or x.dtype not in DTYPE_CODES):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    check(lib.hs_row_sigmoid_gate(DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], gate.data_ptr(), gate.stride(0),
                                  x2.data_ptr(), x2.stride(0), out.data_ptr(), out.stride(0)), "hs_row_sigmoid_gate")
    return out


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a * b`` element by element for a, b of one shape and dtype, rounded to it. None when not covered."""
    return _elementwise(a, b, lambda lib, code, a2, b2, o2: check(lib.hs_mul(
        code, a2.shape[0], a2.shape[1], a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0), o2.data_ptr(),
        o2.stride(0)), "hs_mul"))


def relu2(x: torch.Tensor) -> torch.Tensor | None:
    """``relu(x) ** 2`` (ACT2FN["relu2"]), rounded as PyTorch rounds it. None when not covered."""
    return _elementwise(x, None, lambda lib, code, x2, _, o2: check(lib.hs_relu2(
        code, x2.shape[0], x2.shape[1], x2.data_ptr(), x2.stride(0), o2.data_ptr(), o2.stride(0)), "hs_relu2"))


def gather_rows(table: torch.Tensor, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
    """``table[ids] * scale`` (rounded to the table's dtype as PyTorch rounds it) for a row-major CPU
    table (num_rows, D) and ids (T,) int64: token embeddings and per-position tables. Raises for an id
    outside the table; None when not covered."""
    lib = _library()
    if (lib is None or table.dim() != 2 or table.stride(1) != 1 or table.dtype not in DTYPE_CODES
            or table.device.type != "cpu" or ids.dim() != 1 or not index_ok(ids)):
        return None
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype)  # (T, D)
    check(lib.hs_gather_rows(DTYPE_CODES[table.dtype], ids.shape[0], ids.data_ptr(), table.data_ptr(),
                             table.stride(0), table.shape[0], table.shape[1], float(scale), out.data_ptr(),
                             out.stride(0)), "hs_gather_rows (an id outside the table)")
    return out


def argmax_logsumexp(logits: torch.Tensor, with_max: bool = False) -> tuple[torch.Tensor, ...] | None:
    """Per row of logits (N, V) in float32, bfloat16 or float16: the first index of the maximum (N,)
    int64 and ``logsumexp`` (N,) float32, as of ``logits.float()``, and with ``with_max`` the maximum
    (N,) float32 too. None when not covered (including any row with NaN or inf)."""
    lib = _library()
    if lib is None or logits.dtype not in DTYPE_CODES or not rows_ok(logits) or logits.shape[1] == 0:
        return None
    N, V = logits.shape
    idx = torch.empty(N, dtype=torch.int64)
    lse = torch.empty(N, dtype=torch.float32)
    mx = torch.empty(N, dtype=torch.float32)
    check(lib.hs_argmax_logsumexp(DTYPE_CODES[logits.dtype], N, V, logits.data_ptr(), logits.stride(0),
                                  idx.data_ptr(), lse.data_ptr(), mx.data_ptr()), "hs_argmax_logsumexp")
    if not np.isfinite(mx.numpy()).all():
        return None
    return (idx, lse, mx) if with_max else (idx, lse)
