"""Compiled recurrent kernels over 8-bit state (``hybridserve.kernels.recurrent_coded``), every ISA variant
this CPU runs, int8 and fp8 e4m3 codes, against ``cache/state_codec.py``.

Each call starts from codes and scales in a pool of slots. The reference decodes them (``decode_rows``), runs
the same call on that float32 state (the float-state kernel, itself tested against the plain-PyTorch ops in
``test_recurrent_kernels.py``; for Mamba2 (its token-by-token path; the AMX chunked form has its own tests),
Mamba1, linear attention and the gated delta rule the plain-PyTorch op too) and encodes the new state with
``encode_rows`` and ``uniform_noise`` of the group's rounding keys, positions and layer.

The rule for codes: equal to the reference's, except where the float32 value before rounding differs in its
last ulp from the reference's (a kernel summing in another order): there the rounding position
(``v + u`` for int8, ``|v| / ulp + u`` for e4m3) lies within a few float32 ulps of a rounding boundary, and
the code is one step from the reference's. Such elements are counted and must be rare. Scales: within float32
rounding of the reference's. Outputs: within float32 tolerance. Slots outside the call keep their bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.cache.state_codec import CodedState, decode_rows, encode_rows, nearest_noise, uniform_noise
from hybridserve.kernels import recurrent, recurrent_coded
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen_ref
from tests.kernels.helpers import assert_close_rel, assert_within_ulps, cu, needs_compiler

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]  # every ISA variant this CPU runs

CODES = [torch.int8, torch.float8_e4m3fn]
CODE_IDS = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3"}
NO_LIMIT = (0.0, math.inf)
LAYER = 5
MAX_NEAR_BOUNDARY = 1e-3  # at most this fraction of a call's codes may sit on a last-ulp rounding boundary


def code_id(dtype: torch.dtype) -> str:
    return CODE_IDS[dtype]


class CodedPool:
    """num_slots slots of 8-bit state of per-slot ``shape``: codes and scales of random values (seeded), a copy
    of both kept to check that slots outside a call keep their bytes."""

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int, spread: float = 1.0,
                 offset: int = 0, stochastic: bool = True):
        g = torch.Generator().manual_seed(seed)
        values = torch.randn(num_slots, *shape, generator=g) * spread
        codes, scale = encode_rows(values, dtype, None)
        self.shape, self.dtype, self.offset, self.stochastic = shape, dtype, offset, stochastic
        self.state = CodedState(codes.clone(), scale.clone(), LAYER, offset, stochastic)
        self.codes_before, self.scale_before = codes, scale

    def decoded(self) -> torch.Tensor:
        """The state before the call as float32 (num_slots, *shape)."""
        return decode_rows(self.codes_before, self.scale_before).contiguous()

    def check(self, slots: torch.Tensor, new_state: torch.Tensor, keys: torch.Tensor | None,
              positions: torch.Tensor, what: str) -> int:
        """The codes and scales at ``slots`` against the reference encoding of new_state (S, *shape) float32
        (the rule in the module docstring); the other slots unchanged. Returns how many codes sat on a
        boundary."""
        S = slots.numel()
        key_t = keys if keys is not None else torch.zeros(S, dtype=torch.int64)
        noise = (uniform_noise(key_t, positions, LAYER, self.shape, self.offset) if self.stochastic
                 else nearest_noise((S, *self.shape)))
        ref_codes, ref_scale = encode_rows(new_state, self.dtype, noise)
        got_codes, got_scale = self.state.codes[slots], self.state.scale[slots]
        torch.testing.assert_close(got_scale, ref_scale, rtol=4 * 2.0 ** -24, atol=0.0, msg=f"{what}: scales")
        differ = got_codes.view(torch.uint8) != ref_codes.view(torch.uint8)
        near = _near_boundary(new_state, ref_scale, noise, self.dtype)
        steps = (_steps(got_codes) - _steps(ref_codes)).abs()
        assert not (differ & ~near).any(), (f"{what}: {int((differ & ~near).sum())} codes differ from the "
                                            f"reference away from a rounding boundary")
        assert (steps[differ] <= 1).all(), f"{what}: a code more than one step from the reference's"
        count = int(differ.sum())
        assert count <= max(2, MAX_NEAR_BOUNDARY * differ.numel()), f"{what}: {count} boundary codes"
        outside = torch.ones(self.codes_before.shape[0], dtype=torch.bool)
        outside[slots] = False
        assert torch.equal(self.state.codes[outside].view(torch.uint8), self.codes_before[outside].view(torch.uint8))
        assert torch.equal(self.state.scale[outside], self.scale_before[outside]), f"{what}: other slots' scales"
        return count


def _steps(codes: torch.Tensor) -> torch.Tensor:
    """Codes as grid positions: the int8 value, or the e4m3 magnitude's bit pattern (consecutive grid points
    are consecutive patterns) with the sign."""
    if codes.dtype == torch.int8:
        return codes.to(torch.int32)
    bits = codes.view(torch.uint8).to(torch.int32)
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def _near_boundary(x: torch.Tensor, scale: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the rounding position of x (the reference's float32 new state) lies within 8 float32 ulps (of
    the row's largest position) of an integer: where a last-ulp difference in x can move the code."""
    scale = scale.to(torch.float32)  # the stored bfloat16 scale, which the codes are computed against
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = x * inv[..., None]
    if dtype == torch.int8:
        t = v + noise
        ulp = 127.0 * 2.0 ** -23
    else:
        mag = v.abs()
        _, exp = torch.frexp(mag)
        binade = torch.clamp(exp - 1, min=-6)
        t = mag * torch.pow(2.0, (3 - binade).to(torch.float32)) + noise
        # a last-ulp difference of the row's largest |v| (448), in ulps of this element's binade
        ulp = 16.0 * 2.0 ** -23 * (448.0 / torch.pow(2.0, binade.to(torch.float32))).clamp(min=1.0)
    return (t - t.round()).abs() <= 8 * ulp


def _assert_out(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 2e-6) -> None:
    """Outputs within float32 tolerance (float32) or one ulp of the activation dtype."""
    if actual.dtype == torch.float32:
        assert_close_rel(actual, expected.float(), rtol, what)
    else:
        assert_within_ulps(actual, expected.to(actual.dtype), actual.dtype, ulps=1, atol=1e-5, what=what)


def _group(lens, slots, keys=True):
    """cu_seqlens, slots, keys (or None) and positions (tokens absorbed after the call) of a group."""
    S = len(lens)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    key_t = torch.tensor([12345, 0, 7, 2 ** 40 + 3, 99][:S], dtype=torch.int64) if keys else None
    positions = torch.tensor([37, 2, 1000, 64, 5][:S], dtype=torch.int64) + torch.tensor(lens)
    return cu(lens), slot_t, key_t, positions


DECODE, MIXED = [1, 1, 1, 1], [1, 9, 1, 70]
#: how the codes are rounded (cache/spec.py: TEMPORAL_ROUNDING picks one per state kind); every kernel takes both
ROUNDINGS = pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
# where a tensor-parallel rank's slice starts in the whole state tensor (the noise's element numbering): 0, and a
# start inside a 4-element noise word
OFFSETS = [0, 1030]


# ----------------------------------------------------------------------------------------------
# Mamba2
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("N,P,G", [(128, 64, 2), (64, 32, 1), (64, 24, 1), (48, 16, 1)])  # 48: no fused row step;
# 24 rows: a last block of fewer rows than a vector has lanes
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
def test_mamba2_scan_coded_matches_codec(code, act_dtype, N, P, G, lens, offset):
    g = torch.Generator().manual_seed(N + P)
    H, T = 4, sum(lens)
    x = torch.randn(T, H * P, generator=g).to(act_dtype)
    dt = (torch.randn(T, H, generator=g) * 1.5 - 1.0).to(act_dtype)
    B, C = (torch.randn(T, G * N, generator=g).to(act_dtype) for _ in range(2))
    A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5 - 1.0
    cu_t, slots, keys, positions = _group(lens, [5, 0, 3, 8])
    pool = CodedPool(9, (H, P, N), code, seed=N, offset=offset)
    y = torch.full((T, H * P), 7.25)
    assert recurrent_coded.mamba2_scan(pool.state, x, dt, A, B, C, D, dt_bias, True, NO_LIMIT, cu_t, slots, keys,
                                       positions, y)
    plain = pool.decoded()  # the float32 state the codes hold; the float-state kernel on it
    y_f = torch.full((T, H * P), 7.25)
    assert recurrent.mamba2_scan(plain, x, dt, A, B, C, D, dt_bias, True, NO_LIMIT, cu_t, slots, y_f)
    pool.check(slots, plain[slots], keys, positions, "mamba2 codes")
    _assert_out(y, y_f, "mamba2 y vs the float-state kernel")
    y_ref, fin_ref = mamba2_chunk_scan_varlen_ref(
        x.reshape(T, H, P), dt, A, B.reshape(T, G, N), C.reshape(T, G, N), 0, D, dt_bias, True, NO_LIMIT, cu_t,
        pool.decoded()[slots])
    if recurrent.mamba2_scan_path(act_dtype, P, N, max(lens)) == "token":  # the chunked form: its own tolerance
        _assert_out(y, y_ref.reshape(T, H * P), "mamba2 y vs the PyTorch op", rtol=1e-5)
        assert_close_rel(plain[slots], fin_ref, 1e-5, "mamba2 float-state kernel's new state vs the PyTorch op")


def test_mamba2_scan_coded_keys_and_positions_seed_the_rounding():
    """The same call with another key, or at another position, rounds differently; with no keys it rounds as
    with keys of 0."""
    H, P, N, G = 2, 16, 64, 1
    g = torch.Generator().manual_seed(3)
    x, dt = torch.randn(2, H * P, generator=g), torch.randn(2, H, generator=g)
    B, C = torch.randn(2, G * N, generator=g), torch.randn(2, G * N, generator=g)
    A = -torch.rand(H, generator=g) - 0.1
    idx = torch.tensor([0, 1])

    def run(keys, positions):
        pool = CodedPool(2, (H, P, N), torch.int8, seed=4)
        assert recurrent_coded.mamba2_scan(pool.state, x, dt, A, B, C, None, None, True, NO_LIMIT, cu([1, 1]), idx,
                                           keys, positions, torch.zeros(2, H * P))
        return pool.state.codes.clone()

    pos = torch.tensor([10, 10])
    base = run(torch.tensor([1, 1]), pos)
    assert not torch.equal(base, run(torch.tensor([2, 2]), pos))
    assert not torch.equal(base, run(torch.tensor([1, 1]), torch.tensor([11, 11])))
    assert torch.equal(run(None, pos), run(torch.tensor([0, 0]), pos))


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
def test_mamba2_scan_coded_rounds_to_nearest_when_asked(code, lens):
    """A state rounded to nearest (the fused decode row step and the prefill encoder alike) matches the codec
    with the fixed noise, and its codes do not depend on the rounding keys or positions."""
    H, P, N, G = 4, 32, 64, 1
    g = torch.Generator().manual_seed(21)
    T = sum(lens)
    x, dt = torch.randn(T, H * P, generator=g), torch.randn(T, H, generator=g)
    B, C = torch.randn(T, G * N, generator=g), torch.randn(T, G * N, generator=g)
    A = -torch.rand(H, generator=g) - 0.1
    cu_t, slots, keys, positions = _group(lens, [5, 0, 3, 8])
    codes = []
    for k, pos in ((keys, positions), (None, positions + 3)):
        pool = CodedPool(9, (H, P, N), code, seed=22, stochastic=False)
        assert recurrent_coded.mamba2_scan(pool.state, x, dt, A, B, C, None, None, True, NO_LIMIT, cu_t, slots, k,
                                           pos, torch.zeros(T, H * P))
        plain = pool.decoded()
        assert recurrent.mamba2_scan(plain, x, dt, A, B, C, None, None, True, NO_LIMIT, cu_t, slots,
                                     torch.zeros(T, H * P))
        pool.check(slots, plain[slots], k, pos, "mamba2 codes, nearest")
        codes.append(pool.state.codes.view(torch.uint8).clone())
    assert torch.equal(codes[0], codes[1])


def test_mamba2_scan_coded_declines_uncovered_calls():
    H, P, N = 2, 16, 32
    pool = CodedPool(3, (H, P, N), torch.int8, seed=1)
    x, dt, BC = torch.zeros(1, H * P), torch.zeros(1, H), torch.zeros(1, N)
    A, y, idx = -torch.ones(H), torch.zeros(1, H * P), torch.tensor([0])
    args = dict(state=pool.state, x=x, dt=dt, A=A, B=BC, C=BC, D=None, dt_bias=None, dt_softplus=True,
                dt_limit=NO_LIMIT, cu_seqlens=cu([1]), state_indices=idx, keys=None, positions=torch.tensor([1]), y=y)
    strided = torch.zeros(3, H, P, N + 8, dtype=torch.int8)[..., :N]  # rows not contiguous in a slot
    wrong = {"state": CodedState(strided, pool.state.scale, LAYER),
             "positions": torch.tensor([1], dtype=torch.int32), "keys": torch.tensor([1, 2]),
             "y": torch.zeros(1, H * P, dtype=torch.bfloat16)}
    for name, bad in wrong.items():
        assert not recurrent_coded.mamba2_scan(**{**args, name: bad}), name
    assert not recurrent_coded.mamba2_scan(**{**args, "state": torch.zeros(3, H, P, N)})  # a float view
    assert torch.equal(pool.state.codes, pool.codes_before) and not y.any()


# ----------------------------------------------------------------------------------------------
# Mamba1
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
def test_mamba1_scan_coded_matches_codec(code, act_dtype, lens, offset):
    from hybridserve.ops.selective_scan import selective_scan_varlen_ref

    g = torch.Generator().manual_seed(5)
    Dm, N, T = 24, 16, sum(lens)
    x, z = (torch.randn(T, Dm, generator=g).to(act_dtype) for _ in range(2))
    dt = (torch.randn(T, Dm, generator=g) * 0.5).to(act_dtype)
    B, C = (torch.randn(T, N, generator=g).to(act_dtype) for _ in range(2))
    A = -torch.rand(Dm, N, generator=g) - 0.1
    D, dt_bias = torch.randn(Dm, generator=g), torch.randn(Dm, generator=g) * 0.3
    cu_t, slots, keys, positions = _group(lens, [6, 1, 3, 0])
    pool = CodedPool(8, (Dm, N), code, seed=6, offset=offset)
    y = torch.full((T, Dm), float("nan")).to(act_dtype)
    assert recurrent_coded.mamba1_scan(pool.state, x, dt, A, B, C, D, z, dt_bias, True, cu_t, slots, keys,
                                       positions, y)
    plain = pool.decoded()
    y_f = torch.full((T, Dm), float("nan")).to(act_dtype)
    assert recurrent.mamba1_scan(plain, x, dt, A, B, C, D, z, dt_bias, True, cu_t, slots, y_f)
    pool.check(slots, plain[slots], keys, positions, "mamba1 codes")
    _assert_out(y, y_f, "mamba1 y vs the float-state kernel")
    y_ref, _ = selective_scan_varlen_ref(x, dt, A, B, C, D, z, dt_bias, True, cu_t, pool.decoded()[slots])
    _assert_out(y, y_ref, "mamba1 y vs the PyTorch op", rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# linear attention, gated delta rule, KDA
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
def test_linear_attention_coded_matches_codec(code, lens, offset):
    from hybridserve.ops.linear_attention import linear_attention_varlen_ref

    g = torch.Generator().manual_seed(8)
    H, D, T = 3, 20, sum(lens)  # rows of 20: a partial block of rows and a partial vector
    qkv = torch.randn(T, H * 3 * D, generator=g) * 0.5
    decay = torch.rand(H, generator=g) * 0.5
    cu_t, slots, keys, positions = _group(lens, [3, 0, 5, 1], keys=False)
    pool = CodedPool(6, (H, D, D), code, seed=9, offset=offset)
    y = torch.full((T, H * D), float("nan"))
    assert recurrent_coded.linear_attention(pool.state, qkv, H, D, decay, cu_t, slots, keys, positions, y)
    plain = pool.decoded()
    y_f = torch.full((T, H * D), float("nan"))
    assert recurrent.linear_attention(plain, qkv, H, D, decay, cu_t, slots, y_f)
    pool.check(slots, plain[slots], keys, positions, "linear attention codes")
    _assert_out(y, y_f, "linear attention y vs the float-state kernel")
    q, k, v = qkv.view(T, H, 3 * D).split(D, dim=-1)
    y_ref, _ = linear_attention_varlen_ref(q, k, v, decay, cu_t, pool.decoded()[slots])
    _assert_out(y, y_ref.reshape(T, H * D), "linear attention y vs the PyTorch op", rtol=1e-5)


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
@ROUNDINGS
def test_gated_delta_rule_coded_matches_codec(code, lens, offset, stochastic):
    from hybridserve.ops.gated_delta import gated_delta_rule_varlen_ref

    g = torch.Generator().manual_seed(10)
    Hk, Hv, Dk, Dv, T = 2, 4, 24, 32, sum(lens)  # 24 rows: a last block of fewer rows than a vector has lanes
    conv = torch.randn(T, 2 * Hk * Dk + Hv * Dv, generator=g)
    ba = torch.randn(T, 2 * Hv, generator=g)
    A_log, dt_bias = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g) * 0.5
    cu_t, slots, keys, positions = _group(lens, [4, 0, 2, 5])
    pool = CodedPool(6, (Hv, Dk, Dv), code, seed=11, offset=offset, stochastic=stochastic)
    out = torch.full((T, Hv * Dv), float("nan"))
    assert recurrent_coded.gated_delta_rule(pool.state, conv, ba, A_log, dt_bias, True, cu_t, slots, keys,
                                            positions, out, Hk)
    plain = pool.decoded()
    out_f = torch.full((T, Hv * Dv), float("nan"))
    assert recurrent.gated_delta_rule(plain, conv, ba, A_log, dt_bias, True, cu_t, slots, out_f, Hk)
    pool.check(slots, plain[slots], keys, positions, "gated delta codes")
    _assert_out(out, out_f, "gated delta out vs the float-state kernel")
    R = Hv // Hk
    b, a = torch.split(ba.view(T, Hk, 2 * R), [R, R], dim=-1)
    beta = b.reshape(T, Hv).sigmoid()
    decay = -A_log.exp() * torch.nn.functional.softplus(a.reshape(T, Hv) + dt_bias)
    qm, km, vm = torch.split(conv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    y_ref, _ = gated_delta_rule_varlen_ref(qm.reshape(T, Hk, Dk), km.reshape(T, Hk, Dk), vm.reshape(T, Hv, Dv),
                                           decay, beta, cu_t, pool.decoded()[slots], use_qk_l2norm=True)
    _assert_out(out, y_ref.reshape(T, Hv * Dv), "gated delta out vs the PyTorch op", rtol=1e-5)


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
@ROUNDINGS
def test_kda_coded_matches_codec(code, lens, offset, stochastic):
    g = torch.Generator().manual_seed(12)
    H, Dk, Dv, T = 3, 16, 16, sum(lens)
    q, k, v, f = (torch.randn(T, H * Dk, generator=g) for _ in range(4))
    b, gate = torch.randn(T, H, generator=g), torch.randn(T, H * Dv, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * Dk, generator=g)
    norm_w = torch.randn(Dv, generator=g)
    cu_t, slots, keys, positions = _group(lens, [4, 0, 2, 5])
    pool = CodedPool(6, (H, Dk, Dv), code, seed=13, offset=offset, stochastic=stochastic)
    out = torch.full((T, H * Dv), float("nan"))
    assert recurrent_coded.kda(pool.state, q, k, v, f, b, A_log, dt_bias, True, cu_t, slots, keys, positions, out,
                               gate, norm_w, 1e-6)
    plain = pool.decoded()
    out_f = torch.full((T, H * Dv), float("nan"))
    assert recurrent.kda(plain, q, k, v, f, b, A_log, dt_bias, True, cu_t, slots, out_f, gate, norm_w, 1e-6)
    pool.check(slots, plain[slots], keys, positions, "kda codes")
    _assert_out(out, out_f, "kda out vs the float-state kernel")


# ----------------------------------------------------------------------------------------------
# mLSTM: C and n coded, m a float view
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16], ids=["m_f32", "m_bf16"])
@pytest.mark.parametrize("code", CODES, ids=code_id)
@pytest.mark.parametrize("offset", OFFSETS)
@ROUNDINGS
def test_mlstm_coded_matches_codec(code, m_dtype, lens, offset, stochastic):
    g = torch.Generator().manual_seed(14)
    H, Dk, Dv, T = 2, 16, 32, sum(lens)
    q, k = (torch.randn(T, H * Dk, generator=g) for _ in range(2))
    v, o = (torch.randn(T, H * Dv, generator=g) for _ in range(2))
    i, f = (torch.randn(T, H, generator=g) * 2 for _ in range(2))
    norm_w, norm_b = torch.randn(H * Dv, generator=g), torch.randn(H * Dv, generator=g)
    cu_t, slots, keys, positions = _group(lens, [4, 0, 2, 5])
    # a rank's slices of C and n start at their own elements (H heads from head offset / 2 on, say)
    C_pool = CodedPool(6, (H, Dk, Dv), code, seed=15, offset=offset * Dk * Dv, stochastic=stochastic)
    n_pool = CodedPool(6, (H, Dk), code, seed=16, spread=3.0, offset=offset * Dk, stochastic=stochastic)
    m = (torch.randn(6, H, generator=g) * 2).to(m_dtype)
    m_before = m.clone()
    out = torch.full((T, H * Dv), float("nan"))
    assert recurrent_coded.mlstm((C_pool.state, n_pool.state, m), q, k, v, o, i, f, 15.0, norm_w, norm_b, 1e-5,
                                 1e-6, cu_t, slots, keys, positions, out)
    # the float-state kernel on the decoded C, n and this m, all in float32 (m's rounding to m_dtype moves
    # into C and n: the same fit, done here on the float32 results)
    nc, nn = H * Dk * Dv, H * Dk
    buf = torch.cat([C_pool.decoded().reshape(6, nc), n_pool.decoded().reshape(6, nn), m_before.float()], dim=1)
    C_f, n_f, m_f = (buf[:, :nc].view(6, H, Dk, Dv), buf[:, nc:nc + nn].view(6, H, Dk),
                     buf[:, nc + nn:])  # one slot stride, as the float-state kernel takes them
    out_f = torch.full((T, H * Dv), float("nan"))
    assert recurrent.mlstm((C_f, n_f, m_f), q, k, v, o, i, f, 15.0, norm_w, norm_b, 1e-5, 1e-6, cu_t, slots, out_f)
    m_fit = m_f[slots].to(m_dtype).float()
    fit = torch.exp(m_f[slots] - m_fit)  # (S, H)
    C_new, n_new = C_f[slots] * fit[..., None, None], n_f[slots] * fit[..., None]
    C_pool.check(slots, C_new, keys, positions, "mlstm C codes")
    n_pool.check(slots, n_new, keys, positions, "mlstm n codes")
    assert torch.equal(m[slots].float(), m_fit), "m stored as its dtype's rounding"
    other = torch.ones(6, dtype=torch.bool)
    other[slots] = False
    assert torch.equal(m[other], m_before[other])
    _assert_out(out, out_f, "mlstm out vs the float-state kernel")


# ----------------------------------------------------------------------------------------------
# the op entry: the Mamba2 mixer's kernel body takes a CodedState
# ----------------------------------------------------------------------------------------------


class _Mamba2Layer(torch.nn.Module):
    """The sizes and parameters ``ops/mamba2_mixer.py`` reads of a Mamba2 layer."""

    def __init__(self, H=4, P=16, G=1, N=64, K=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_heads, self.head_dim, self.n_groups, self.d_state = H, P, G, N
        self.intermediate, self.chunk_size, self.activation = H * P, 64, "silu"
        conv_dim = H * P + 2 * G * N
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, K, groups=conv_dim, padding=K - 1)
        with torch.no_grad():
            self.conv1d.weight.copy_(torch.randn(conv_dim, 1, K, generator=g) * 0.5)
            self.conv1d.bias.copy_(torch.randn(conv_dim, generator=g) * 0.1)
        self.A_log = torch.nn.Parameter(torch.rand(H, generator=g))
        self.D = torch.nn.Parameter(torch.randn(H, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(H, generator=g) * 0.5)


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_mamba2_op_entry_runs_its_kernel_body_on_a_coded_state(lens):
    """``mamba2_conv_scan`` with the kernels on and an 8-bit state: the kernel body takes the call (no decline
    recorded) with the group's rounding keys and positions, and writes what the float-state body writes on the
    decoded state, encoded with those keys and positions."""
    from hybridserve.forward_batch import SeqGroup
    from hybridserve.kernels import fallbacks
    from hybridserve.ops.dispatch import use_kernels
    from hybridserve.ops.mamba2_mixer import mamba2_conv_scan

    layer = _Mamba2Layer()
    H, P, N, T = 4, 16, 64, sum(lens)
    g = torch.Generator().manual_seed(1)
    conv_dim = H * P + 2 * N
    xbc, dt = torch.randn(T, conv_dim, generator=g), torch.randn(T, H, generator=g)
    cu_t, slots, keys, positions = _group(lens, [5, 0, 3, 2])
    group = SeqGroup(0, T, cu_t, positions, None, slots, rounding_keys=keys)
    pool = CodedPool(6, (H, P, N), torch.int8, seed=2)
    conv_a = torch.randn(6, conv_dim, 3, generator=g)
    conv_b, plain = conv_a.clone(), pool.decoded()
    y, y_f = torch.zeros(T, H, P), torch.zeros(T, H, P)
    declines = fallbacks.total()
    with torch.no_grad(), use_kernels(True):
        mamba2_conv_scan(layer, group, xbc, dt, y, conv_a, pool.state, decode=lens == DECODE, dt_limit=NO_LIMIT)
        mamba2_conv_scan(layer, group, xbc, dt, y_f, conv_b, plain, decode=lens == DECODE, dt_limit=NO_LIMIT)
    assert fallbacks.total() == declines, f"a kernel body declined: {fallbacks.counts()}"
    assert torch.equal(conv_a, conv_b)
    pool.check(slots, plain[slots], keys, positions, "mamba2 op entry codes")
    _assert_out(y.view(T, H * P), y_f.view(T, H * P), "mamba2 op entry y")
