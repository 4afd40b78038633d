"""Compiled CPU recurrent kernels (``hybridserve.kernels.recurrent``) against the plain-PyTorch
references: varlen causal conv and the Mamba2 scan, every activation x state dtype pair, state
pools whose slot stride is larger than a state, inputs that are column slices of wider tensors,
non-consecutive slots; slots and output rows outside the call are left alone; calls the kernels do
not cover are declined without side effects."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.kernels import isa, recurrent
from hybridserve.ops.causal_conv1d import causal_conv1d_varlen_ref
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen_ref
from tests.kernels.helpers import (
    DTYPES,
    Pool,
    assert_bits_equal,
    assert_close_rel,
    assert_within_ulps,
    cu,
    dtype_id,
    needs_compiler,
)

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]  # every ISA variant this CPU runs

NO_LIMIT = (0.0, math.inf)


# ----------------------------------------------------------------------------------------------
# causal conv
# ----------------------------------------------------------------------------------------------


class ConvCase:
    """A varlen conv call: x a column slice of a wider (T, D + 40) tensor, states a strided view of a
    pool (slot stride > D * (K-1), at an offset), sequences at non-consecutive slots."""

    def __init__(self, act_dtype, state_dtype, K, with_bias, lens=(1, 6, 1, 2, 13), slots=(7, 2, 9, 0, 4),
                 D=200, num_slots=11, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.K, self.D, self.lens = K, D, list(lens)
        T = sum(lens)
        self.wide = torch.randn(T, D + 40, generator=g).to(act_dtype)  # (T, D + 40)
        self.x = self.wide[:, 17:17 + D]  # (T, D), rows of stride D + 40
        self.weight = torch.randn(D, K, generator=g) * 0.5  # (D, K), the conv weight
        self.weight_t = self.weight.t().contiguous()  # (K, D) tap-major, as the kernel takes it
        self.bias = torch.randn(D, generator=g) if with_bias else None  # (D,)
        self.cu = cu(lens)  # (S+1,)
        self.slots = torch.tensor(slots, dtype=torch.int64)  # (S,)
        self.offset, self.shape = 3, (D, K - 1)
        self.pool = Pool(num_slots, 2 * D * (K - 1) + 7, state_dtype, seed=seed + 1)
        self.states = self.pool.view(self.offset, self.shape)  # (num_slots, D, K-1), slot stride 2D(K-1)+7

    def run(self, activation, **overrides):
        args = dict(x=self.x, conv_states=self.states, weight_t=self.weight_t, bias=self.bias, cu_seqlens=self.cu,
                    state_indices=self.slots, activation=activation)
        args.update(overrides)
        return recurrent.causal_conv1d(**args)

    def ref(self, activation):
        init = self.pool.expected_view(self.offset, self.shape)[1][self.slots]  # (S, D, K-1), states before the call
        return causal_conv1d_varlen_ref(self.x, self.weight, self.bias, self.cu, init, activation)

    def assert_pool_untouched(self):
        assert_bits_equal(self.pool.buf, self.pool.before, "state pool")


def _assert_output_close(y, y_ref, dtype, what):
    assert y.dtype == dtype and y.shape == y_ref.shape, what
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5, msg=what)
    else:  # both are float32 math rounded once to dtype: at most one ulp apart (plus float32 noise near 0)
        assert_within_ulps(y, y_ref, dtype, ulps=1, atol=1e-6, what=what)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("K", [2, 3, 4, 5])  # 2-4: compile-time widths; 5: the generic path
@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_conv_matches_ref(act_dtype, state_dtype, K, with_bias, activation):
    case = ConvCase(act_dtype, state_dtype, K, with_bias, seed=K)
    wide_before = case.wide.clone()
    y = case.run(activation)
    y_ref, fin_ref = case.ref(activation)
    assert y is not None, "the kernel declined a covered call"
    _assert_output_close(y, y_ref, act_dtype, "conv output")
    # The final state is a copy of the last K-1 inputs (no arithmetic): exactly the reference's,
    # rounded to the state dtype; every other byte of the pool (other slots, the gaps) is unchanged.
    expected, expected_states = case.pool.expected_view(case.offset, case.shape)
    expected_states[case.slots] = fin_ref.to(state_dtype)
    assert_bits_equal(case.pool.buf, expected, "state pool after the call")
    assert torch.equal(case.wide, wide_before)  # the input is read only


@pytest.mark.parametrize("K", [1, 16])  # no state at all; the widest kernel the C++ code takes
def test_conv_extreme_widths(K):
    case = ConvCase(torch.float32, torch.bfloat16, K, True, lens=(1, 3, 20), slots=(4, 1, 2), D=40, seed=11)
    y = case.run("silu")
    y_ref, fin_ref = case.ref("silu")
    assert y is not None
    _assert_output_close(y, y_ref, torch.float32, f"conv output K={K}")
    expected, expected_states = case.pool.expected_view(case.offset, case.shape)
    expected_states[case.slots] = fin_ref.to(torch.bfloat16)
    assert_bits_equal(case.pool.buf, expected, "state pool after the call")


def test_conv_packed_equals_one_call_per_sequence():
    """The group result does not depend on which sequences share the call."""
    case = ConvCase(torch.bfloat16, torch.float32, 4, True, seed=5)
    y_all = case.run("silu")
    after_all = case.pool.buf.clone()
    case.pool.buf.copy_(case.pool.before)
    for s in range(len(case.lens)):
        a, b = int(case.cu[s]), int(case.cu[s + 1])
        y_s = case.run("silu", x=case.x[a:b], cu_seqlens=cu([b - a]), state_indices=case.slots[s:s + 1].clone())
        assert_bits_equal(y_s, y_all[a:b], f"sequence {s}")
    assert_bits_equal(case.pool.buf, after_all, "states")


def test_conv_prefill_then_decode_equals_one_prefill():
    """Prefill in two chunks, then decode one token at a time, from the pooled state: the same outputs
    and final state as one call over the whole sequences (float32 state: exact continuation)."""
    case = ConvCase(torch.float32, torch.float32, 4, True, lens=(9, 14), slots=(3, 8), D=24, seed=6)
    y_whole = case.run(None)
    whole_states = case.states[case.slots].clone()
    case.pool.buf.copy_(case.pool.before)
    x = case.x
    pieces = {0: [(0, 4), (4, 7), (7, 8), (8, 9)], 1: [(0, 1), (1, 12), (12, 13), (13, 14)]}
    y = torch.empty_like(y_whole)
    for step in range(4):
        rows = [int(case.cu[s]) + pieces[s][step][0] for s in range(2)]
        lens = [pieces[s][step][1] - pieces[s][step][0] for s in range(2)]
        idx = torch.cat([torch.arange(r, r + n) for r, n in zip(rows, lens)])
        y[idx] = case.run(None, x=x[idx], cu_seqlens=cu(lens))
    torch.testing.assert_close(y, y_whole, rtol=0, atol=0)
    assert torch.equal(case.states[case.slots], whole_states)


def test_conv_empty_sequence_keeps_its_state():
    case = ConvCase(torch.float16, torch.float16, 4, False, lens=(3, 0, 5), slots=(1, 6, 2), D=16, seed=7)
    y = case.run("silu")
    y_ref, fin_ref = case.ref("silu")
    _assert_output_close(y, y_ref, torch.float16, "conv output")
    expected, expected_states = case.pool.expected_view(case.offset, case.shape)
    expected_states[case.slots] = fin_ref.to(torch.float16)
    assert_bits_equal(case.pool.buf, expected, "state pool")
    assert torch.equal(case.states[6], case.pool.expected_view(case.offset, case.shape)[1][6])


def test_conv_two_threads_match_one():
    """The OpenMP loop over (sequence, channel block) gives the same bits on two threads."""
    case = ConvCase(torch.bfloat16, torch.bfloat16, 4, True, lens=(1, 1, 30, 2, 1, 17), slots=(0, 2, 4, 6, 8, 10),
                    D=300, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y2 = case.run("silu")
        states2 = case.pool.buf.clone()
        case.pool.buf.copy_(case.pool.before)
        torch.set_num_threads(1)
        y1 = case.run("silu")
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(y2, y1, "output")
    assert_bits_equal(states2, case.pool.buf, "states")


@pytest.mark.parametrize("change", [
    "gelu", "x_int", "x_float64", "x_cols_strided", "states_float64", "states_transposed", "weight_noncontig",
    "weight_half", "bias_half", "cu_int32", "slots_int32", "slots_noncontig", "width_17",
])
def test_conv_declines_uncovered_calls(change):
    case = ConvCase(torch.float32, torch.float32, 4, True, D=16, seed=9)
    activation, over = "silu", {}
    if change == "gelu":
        activation = "gelu"
    elif change == "x_int":
        over["x"] = torch.randint(-3, 3, case.x.shape, dtype=torch.int32)
    elif change == "x_float64":
        over["x"] = case.x.double()
    elif change == "x_cols_strided":
        over["x"] = case.wide[:, ::2][:, :case.D]  # column stride 2
    elif change == "states_float64":
        over["conv_states"] = torch.zeros(11, case.D, 3, dtype=torch.float64)
    elif change == "states_transposed":
        over["conv_states"] = case.pool.view(case.offset, (3, case.D)).transpose(1, 2)  # (slots, D, K-1), D-major
    elif change == "weight_noncontig":
        over["weight_t"] = case.weight.t()
    elif change == "weight_half":
        over["weight_t"] = case.weight_t.half()
    elif change == "bias_half":
        over["bias"] = case.bias.half()
    elif change == "cu_int32":
        over["cu_seqlens"] = case.cu.int()
    elif change == "slots_int32":
        over["state_indices"] = case.slots.int()
    elif change == "slots_noncontig":
        over["state_indices"] = torch.stack([case.slots, case.slots], 1)[:, 0]
    elif change == "width_17":  # wider than the C++ kernel's 16 taps: a PyTorch-path call, not an error
        case = ConvCase(torch.float32, torch.float32, 17, True, D=16, seed=9)
    assert case.run(activation, **over) is None
    case.assert_pool_untouched()


# ----------------------------------------------------------------------------------------------
# Mamba2 scan
# ----------------------------------------------------------------------------------------------


class ScanCase:
    """A varlen scan call on one group of a larger batch: the group's tokens are rows [3, 3 + T) of
    (T + 5)-row tensors; x, B, C, dt are column slices of one projection in the activation dtype; y is
    a float32 buffer of all T + 5 rows filled with a sentinel; states a strided view of a pool."""

    Y_SENTINEL = 7.25

    def __init__(self, act_dtype, state_dtype, P, G, H=4, lens=(1, 9, 1, 17), slots=(5, 0, 3, 8), num_slots=9,
                 with_D=True, with_bias=True, seed=0, N=16):
        g = torch.Generator().manual_seed(seed)
        self.N = N
        self.H, self.P, self.G = H, P, G
        self.lens = list(lens)
        T = sum(lens)
        self.rows = slice(3, 3 + T)
        widths = [H * P, G * N, G * N, H, 5]
        proj = torch.randn(T + 5, sum(widths), generator=g)
        proj[:, sum(widths[:3]):sum(widths[:4])] = proj[:, sum(widths[:3]):sum(widths[:4])] * 1.5 - 1.0  # raw dt
        self.proj = proj.to(act_dtype)  # (T + 5, H*P + 2GN + H + 5)
        self.x_all, self.B_all, self.C_all, self.dt_all, _ = torch.split(self.proj, widths, dim=1)
        self.A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)  # (H,)
        self.D = torch.randn(H, generator=g) if with_D else None  # (H,)
        self.dt_bias = torch.randn(H, generator=g) * 0.5 - 1.0 if with_bias else None  # (H,)
        self.cu = cu(lens)
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.offset, self.shape = 11, (H, P, N)
        self.pool = Pool(num_slots, H * P * N + 40, state_dtype, seed=seed + 1)
        self.states = self.pool.view(self.offset, self.shape)  # (num_slots, H, P, N)
        self.y = torch.full((T + 5, H * P), self.Y_SENTINEL)  # (T + 5, H*P) float32

    def run(self, dt_softplus=True, dt_limit=NO_LIMIT, **overrides):
        r = self.rows
        args = dict(ssm_states=self.states, x=self.x_all[r], dt=self.dt_all[r], A=self.A, B=self.B_all[r],
                    C=self.C_all[r], D=self.D, dt_bias=self.dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                    cu_seqlens=self.cu, state_indices=self.slots, y=self.y[r])
        args.update(overrides)
        return recurrent.mamba2_scan(**args)

    def ref(self, dt_softplus=True, dt_limit=NO_LIMIT):
        r, H, P, G, N = self.rows, self.H, self.P, self.G, self.N
        T = r.stop - r.start
        init = self.pool.expected_view(self.offset, self.shape)[1][self.slots]  # (S, H, P, N) before the call
        y, fin = mamba2_chunk_scan_varlen_ref(
            self.x_all[r].reshape(T, H, P), self.dt_all[r], self.A, self.B_all[r].reshape(T, G, N),
            self.C_all[r].reshape(T, G, N), 0, self.D, self.dt_bias, dt_softplus, dt_limit, self.cu, init)
        return y.reshape(T, H * P), fin

    def check(self, y_ref, fin_ref, y_rtol=2e-6):
        r = self.rows
        st = self.states.dtype
        # y: float32, only at the group's rows
        assert_close_rel(self.y[r], y_ref, y_rtol, "scan output")
        outside = torch.ones(self.y.shape[0], dtype=torch.bool)
        outside[r] = False
        assert (self.y[outside] == self.Y_SENTINEL).all(), "rows outside the group were written"
        # stored states: the float32 final state rounded once to the state dtype (one ulp of it, plus
        # float32 noise relative to the state's scale)
        scale = float(fin_ref.abs().max())
        assert_within_ulps(self.states[self.slots], fin_ref.to(st), st, ulps=1, atol=1e-6 * scale,
                           what="stored final states")
        # nothing else in the pool changed
        expected, expected_states = self.pool.expected_view(self.offset, self.shape)
        expected_states[self.slots] = self.states[self.slots]
        assert_bits_equal(self.pool.buf, expected, "state pool outside the written slots")


@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.001, 0.1)], ids=["nolimit", "clamp"])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("P", [64, 48])  # 64: the compile-time head dim; 48: the generic path
@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_scan_matches_ref(act_dtype, state_dtype, P, G, dt_limit):
    case = ScanCase(act_dtype, state_dtype, P, G, seed=P + G)
    proj_before = case.proj.clone()
    assert case.run(dt_limit=dt_limit) is True
    case.check(*case.ref(dt_limit=dt_limit))
    assert torch.equal(case.proj, proj_before)  # inputs are read only


@pytest.mark.parametrize("with_D,with_bias,dt_softplus", [
    (False, False, True), (False, True, True), (True, False, False), (False, False, False)])
@pytest.mark.parametrize("P", [64, 32])
def test_scan_optional_params(with_D, with_bias, dt_softplus, P):
    case = ScanCase(torch.bfloat16, torch.float32, P, 2, H=6, with_D=with_D, with_bias=with_bias, seed=3)
    if not dt_softplus:  # a raw dt is used as the step: keep it positive
        dt = case.dt_all.float().abs() * 0.2
        case.dt_all.copy_(dt.to(case.dt_all.dtype))
        if case.dt_bias is not None:
            case.dt_bias = case.dt_bias.abs() * 0.1
    assert case.run(dt_softplus=dt_softplus, dt_limit=(0.0, 0.3)) is True
    case.check(*case.ref(dt_softplus=dt_softplus, dt_limit=(0.0, 0.3)))


@pytest.mark.parametrize("P", [64, 48])
def test_scan_decode_group(P):
    """A decode group (one token per sequence) takes the single-step path."""
    case = ScanCase(torch.float16, torch.bfloat16, P, 1, lens=(1, 1, 1, 1, 1), slots=(8, 1, 6, 2, 4), seed=4)
    assert case.run() is True
    case.check(*case.ref())


@pytest.mark.parametrize("lens", [(1, 1, 1, 1, 1), (1, 9, 1, 17, 1)], ids=["decode", "mixed"])
@pytest.mark.parametrize("N,G,P", [(64, 1, 64), (128, 2, 48), (64, 2, 32)])
@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_scan_vector_step_state_sizes(act_dtype, state_dtype, N, G, P, lens):
    """d_state 64 and 128 take the vectorized single-token step (and prefetch the next state)."""
    slots = (8, 1, 6, 2, 4)
    case = ScanCase(act_dtype, state_dtype, P, G, H=4, lens=lens, slots=slots, seed=N + P, N=N)
    assert case.run() is True
    case.check(*case.ref())


def test_scan_long_sequence_float32():
    """A long float32 sequence stays within float32 noise of the reference (no drift)."""
    case = ScanCase(torch.float32, torch.float32, 64, 2, lens=(200,), slots=(4,), seed=5)
    assert case.run() is True
    case.check(*case.ref())


def test_scan_prefill_then_decode_equals_one_call():
    """Chunked prefill then decode steps through a float32 pool == one call over whole sequences."""
    case = ScanCase(torch.float32, torch.float32, 48, 2, lens=(6, 11), slots=(2, 7), seed=6)
    r0 = case.rows.start
    assert case.run() is True
    y_whole, states_whole = case.y.clone(), case.states[case.slots].clone()
    case.pool.buf.copy_(case.pool.before)
    case.y.fill_(case.Y_SENTINEL)
    pieces = [[(0, 3), (3, 5), (5, 6)], [(0, 7), (7, 10), (10, 11)]]
    for step in range(3):
        idx = torch.cat([r0 + int(case.cu[s]) + torch.arange(*pieces[s][step]) for s in range(2)])
        lens = [pieces[s][step][1] - pieces[s][step][0] for s in range(2)]
        y = torch.empty(len(idx), case.H * case.P)
        assert case.run(x=case.x_all[idx], dt=case.dt_all[idx], B=case.B_all[idx], C=case.C_all[idx],
                        cu_seqlens=cu(lens), y=y) is True
        case.y[idx] = y
    assert_close_rel(case.y, y_whole, 1e-5, "outputs")
    assert_close_rel(case.states[case.slots], states_whole, 1e-5, "states")


def test_scan_two_threads_match_one():
    case = ScanCase(torch.bfloat16, torch.bfloat16, 64, 2, lens=(1, 1, 12, 1, 5), slots=(0, 1, 2, 3, 4), seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert case.run()
        y2, pool2 = case.y.clone(), case.pool.buf.clone()
        case.pool.buf.copy_(case.pool.before)
        torch.set_num_threads(1)
        assert case.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(case.y, y2)
    assert_bits_equal(case.pool.buf, pool2, "states")


@pytest.mark.parametrize("change", [
    "y_bf16", "dt_other_dtype", "x_int", "states_float64", "states_inner_transposed", "A_half", "D_noncontig",
    "dt_bias_half", "cu_int32", "slots_int32", "x_cols_strided", "x_width",
])
def test_scan_declines_uncovered_calls(change):
    case = ScanCase(torch.float32, torch.float32, 32, 2, seed=8)
    r, over = case.rows, {}
    if change == "y_bf16":
        over["y"] = torch.zeros(r.stop - r.start, case.H * case.P, dtype=torch.bfloat16)
    elif change == "dt_other_dtype":
        over["dt"] = case.dt_all[r].bfloat16()
    elif change == "x_int":
        over["x"] = torch.zeros(r.stop - r.start, case.H * case.P, dtype=torch.int32)
    elif change == "states_float64":
        over["ssm_states"] = torch.zeros(9, case.H, case.P, case.N, dtype=torch.float64)
    elif change == "states_inner_transposed":
        over["ssm_states"] = case.pool.view(case.offset, (case.H, case.N, case.P)).transpose(2, 3)
    elif change == "A_half":
        over["A"] = case.A.half()
    elif change == "D_noncontig":
        over["D"] = torch.stack([case.D, case.D], 1)[:, 0]
    elif change == "dt_bias_half":
        over["dt_bias"] = case.dt_bias.half()
    elif change == "cu_int32":
        over["cu_seqlens"] = case.cu.int()
    elif change == "slots_int32":
        over["state_indices"] = case.slots.int()
    elif change == "x_cols_strided":
        over["x"] = case.proj[r, ::2][:, :case.H * case.P]
    elif change == "x_width":  # x is not (T, H*P) for the states' H, P
        over["x"] = case.x_all[r][:, :-1]
    y_before = case.y.clone()
    assert case.run(**over) is False
    assert_bits_equal(case.pool.buf, case.pool.before, "state pool")
    assert torch.equal(case.y, y_before)


SUBNORMAL = 1e-39  # a float32 subnormal (the smallest normal float32 is 1.18e-38)
x86_only = pytest.mark.skipif(not isa.cpu_info().is_x86, reason="the kernels flush subnormals on x86 only (MXCSR)")


def assert_thread_keeps_subnormals():
    """torch's operators on this thread and on its OpenMP workers still produce subnormals: a kernel that
    flushed them restored each thread's floating-point mode."""
    one = torch.full((1,), SUBNORMAL) * 0.5  # this thread
    many = torch.full((1 << 17,), SUBNORMAL) * 0.5  # split over the OpenMP threads
    assert bool((one != 0).all()) and bool((many != 0).all()), "subnormals are flushed after the kernel returned"


@x86_only
@pytest.mark.parametrize("lens,N,P", [((1, 1, 1), 64, 64), ((9, 1, 17), 64, 64), ((9, 1, 17), 16, 48)],
                         ids=["decode-vector-step", "prefill-P64", "prefill-generic"])
def test_scan_flushes_subnormal_state(lens, N, P):
    """Subnormal values are flushed to zero inside the scan (a decay exp(dt * A) below 1.2e-38 made every
    multiply a slow microcode assist): a subnormal state decayed by 0.5 with no input is stored as 0, not
    as the subnormal 5e-40; torch keeps its IEEE subnormals after the call."""
    case = ScanCase(torch.float32, torch.float32, P, 1, H=2, lens=lens, slots=(4, 0, 7), seed=9, N=N)
    case.states[case.slots] = SUBNORMAL
    x = torch.zeros_like(case.x_all[case.rows])
    A = torch.full((case.H,), -2.0 * math.log(2.0))  # dt = 0.5 (clamped): decay exp(0.5 * A) = 0.5
    assert case.run(x=x, A=A, dt_limit=(0.5, 0.5)) is True
    assert torch.count_nonzero(case.states[case.slots]) == 0, "a subnormal state survived the scan"
    assert torch.count_nonzero(case.y[case.rows]) == 0
    assert_thread_keeps_subnormals()


def _assert_pool_close(buf, expected, state_dtype, what):
    """A state pool after a call against the expected one: float32 within float32 noise, 16-bit states
    within one ulp (the float32 state rounded once)."""
    if state_dtype == torch.float32:
        torch.testing.assert_close(buf, expected, rtol=1e-5, atol=1e-5, msg=what)
    else:
        assert_within_ulps(buf, expected, state_dtype, ulps=1, atol=1e-6, what=what)


# ----------------------------------------------------------------------------------------------
# Mamba1 selective scan
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_gate", [True, False], ids=["gate", "nogate"])
@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_mamba1_scan_matches_ref(act_dtype, state_dtype, with_gate):
    """Varlen (decode rows of one token among prefills), non-consecutive slots in a strided pool:
    outputs and final states against the token-by-token reference."""
    from hybridserve.ops.selective_scan import selective_scan_varlen_ref

    g = torch.Generator().manual_seed(5)
    lens, slots, Dm, N = [1, 7, 1, 12], [6, 1, 3, 0], 24, 16
    T = sum(lens)
    wide = torch.randn(T, 4 * Dm, generator=g).to(act_dtype)  # x, dt, z as column slices of one tensor
    x, dt, z = wide[:, :Dm], wide[:, Dm:2 * Dm] * 0.5, wide[:, 2 * Dm:3 * Dm]
    B, C = (torch.randn(T, N, generator=g).to(act_dtype) for _ in range(2))
    A = -torch.rand(Dm, N, generator=g) - 0.1
    D, dt_bias = torch.randn(Dm, generator=g), torch.randn(Dm, generator=g) * 0.3
    pool = Pool(8, Dm * N + 5, state_dtype, seed=6)
    states = pool.view(2, (Dm, N))
    index = torch.tensor(slots, dtype=torch.int64)
    y = torch.full((T, Dm), float("nan")).to(act_dtype)
    gate = z if with_gate else None
    assert recurrent.mamba1_scan(states, x, dt, A, B, C, D, gate, dt_bias, True, cu(lens), index, y)
    copy, expected_states = pool.expected_view(2, (Dm, N))
    y_ref, final = selective_scan_varlen_ref(x, dt, A, B, C, D, gate, dt_bias, True, cu(lens),
                                             expected_states[index].float())
    _assert_output_close(y, y_ref.to(act_dtype), act_dtype, "mamba1 y")
    expected_states[index] = final.to(state_dtype)
    _assert_pool_close(pool.buf, copy, state_dtype, "mamba1 states")


@x86_only
def test_mamba1_scan_flushes_subnormal_state():
    """As the Mamba2 scan: a subnormal state decayed by 0.5 with no input is stored as 0, and torch keeps
    its IEEE subnormals after the call."""
    lens, Dm, N = [1, 5], 8, 16
    T = sum(lens)
    states = torch.full((3, Dm, N), SUBNORMAL)
    x, dt = torch.zeros(T, Dm), torch.full((T, Dm), 0.5)  # raw dt, no softplus: step 0.5
    A = torch.full((Dm, N), -2.0 * math.log(2.0))  # decay exp(0.5 * A) = 0.5
    B, C = torch.ones(T, N), torch.ones(T, N)
    y = torch.full((T, Dm), float("nan"))
    assert recurrent.mamba1_scan(states, x, dt, A, B, C, None, None, None, False, cu(lens), torch.tensor([2, 0]), y)
    assert torch.count_nonzero(states[[2, 0]]) == 0, "a subnormal state survived the scan"
    assert torch.count_nonzero(y) == 0
    assert bool((states[1] == SUBNORMAL).all()), "a slot outside the call changed"
    assert_thread_keeps_subnormals()


def test_mamba1_scan_declines_uncovered_calls():
    states = torch.zeros(2, 8, 300)  # d_state above the kernel's longest row
    x = torch.zeros(1, 8)
    assert not recurrent.mamba1_scan(states, x, x, torch.zeros(8, 300), torch.zeros(1, 300), torch.zeros(1, 300),
                                     None, None, None, True, cu([1]), torch.tensor([0]), torch.zeros(1, 8))


@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_linear_attention_matches_ref(act_dtype, state_dtype):
    """MiniMax's decayed linear attention: interleaved [q | k | v] heads, varlen, strided pool slots."""
    from hybridserve.ops.linear_attention import linear_attention_varlen_ref

    g = torch.Generator().manual_seed(8)
    lens, slots, H, D = [1, 9, 1, 4], [3, 0, 5, 1], 3, 16
    T = sum(lens)
    qkv = (torch.randn(T, H * 3 * D, generator=g) * 0.5).to(act_dtype)
    q, k, v = qkv.view(T, H, 3 * D).split(D, dim=-1)
    decay = torch.rand(H, generator=g) * 0.5
    pool = Pool(6, H * D * D + 3, state_dtype, seed=9)
    states = pool.view(1, (H, D, D))
    index = torch.tensor(slots, dtype=torch.int64)
    y = torch.full((T, H * D), float("nan")).to(act_dtype)
    assert recurrent.linear_attention(states, qkv, H, D, decay, cu(lens), index, y)
    copy, expected_states = pool.expected_view(1, (H, D, D))
    y_ref, final = linear_attention_varlen_ref(q, k, v, decay, cu(lens), expected_states[index].float())
    _assert_output_close(y, y_ref.reshape(T, H * D).to(act_dtype), act_dtype, "linear attention y")
    expected_states[index] = final.to(state_dtype)
    _assert_pool_close(pool.buf, copy, state_dtype, "linear attention states")


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])  # Qwen3-Next's beta; OLMo-Hybrid's 2 sigmoid(b)
@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_gated_delta_rule_matches_ref(act_dtype, state_dtype, beta_scale):
    """Qwen3-Next: two value heads per key head, l2-normalized q/k, varlen, strided pool slots; the
    projection split into the conv input and z as ``ops/gated_delta_net_mixer.py`` does."""
    from hybridserve.ops.gated_delta import gated_delta_rule_varlen_ref

    g = torch.Generator().manual_seed(10)
    lens, slots, Hk, Hv, Dk, Dv = [1, 8, 1, 3], [4, 0, 2, 5], 2, 4, 16, 8
    T, R = sum(lens), Hv // Hk
    qkvz = torch.randn(T, Hk * (2 * Dk + 2 * R * Dv), generator=g).to(act_dtype)
    mixed, z = recurrent.gdn_split(qkvz, Hk, Dk, R * Dv)
    grouped = qkvz.view(T, Hk, 2 * Dk + 2 * R * Dv)
    q, k, v, zz = torch.split(grouped, [Dk, Dk, R * Dv, R * Dv], dim=-1)
    assert torch.equal(mixed, torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1))
    assert torch.equal(z, zz.reshape(T, -1))
    ba = torch.randn(T, 2 * Hv, generator=g).to(act_dtype)
    A_log, dt_bias = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g) * 0.5
    pool = Pool(6, Hv * Dk * Dv + 5, state_dtype, seed=11)
    states = pool.view(3, (Hv, Dk, Dv))
    index = torch.tensor(slots, dtype=torch.int64)
    out = torch.full((T, Hv * Dv), float("nan")).to(act_dtype)
    assert recurrent.gated_delta_rule(states, mixed, ba, A_log, dt_bias, True, cu(lens), index, out, Hk, beta_scale)
    b, a = torch.split(ba.view(T, Hk, 2 * R), [R, R], dim=-1)
    beta = b.reshape(T, Hv).float().sigmoid() * beta_scale
    decay = -A_log.exp() * torch.nn.functional.softplus(a.reshape(T, Hv).float() + dt_bias)
    copy, expected_states = pool.expected_view(3, (Hv, Dk, Dv))
    qm, km, vm = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    y_ref, final = gated_delta_rule_varlen_ref(qm.reshape(T, Hk, Dk), km.reshape(T, Hk, Dk), vm.reshape(T, Hv, Dv),
                                               decay, beta, cu(lens), expected_states[index].float(),
                                               use_qk_l2norm=True)
    _assert_output_close(out, y_ref.reshape(T, Hv * Dv).to(act_dtype), act_dtype, "gated delta out")
    expected_states[index] = final.to(state_dtype)
    _assert_pool_close(pool.buf, copy, state_dtype, "gated delta states")


def _kda_case(act_dtype, state_dtype, seed=12):
    """A KDA call's inputs: q, k, v, f column slices of one wide projection, varlen, strided pool slots."""
    g = torch.Generator().manual_seed(seed)
    lens, slots, H, Dk, Dv = [1, 7, 1, 3], [4, 0, 2, 5], 3, 16, 16
    T = sum(lens)
    wide = torch.randn(T, 4 * H * Dk + 5, generator=g).to(act_dtype)  # (T, [q | k | v | f | 5 more])
    q, k, v, f = (wide[:, i * H * Dk:(i + 1) * H * Dk] for i in range(4))  # (T, H Dk) rows of stride 4 H Dk + 5
    b = torch.randn(T, H, generator=g).to(act_dtype)
    gate = torch.randn(T, H * Dv, generator=g).to(act_dtype)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * Dk, generator=g)
    norm_w = torch.randn(Dv, generator=g)
    return dict(lens=lens, slots=torch.tensor(slots, dtype=torch.int64), H=H, Dk=Dk, Dv=Dv, q=q, k=k, v=v, f=f, b=b,
                gate=gate, A_log=A_log, dt_bias=dt_bias, norm_w=norm_w)


def _run_kda(c, state_dtype, gated, pool_seed=13):
    H, Dk, Dv, T = c["H"], c["Dk"], c["Dv"], c["q"].shape[0]
    pool = Pool(6, H * Dk * Dv + 5, state_dtype, seed=pool_seed)
    out = torch.full((T, H * Dv), float("nan")).to(c["q"].dtype)
    assert recurrent.kda(pool.view(3, (H, Dk, Dv)), c["q"], c["k"], c["v"], c["f"], c["b"], c["A_log"], c["dt_bias"],
                         True, cu(c["lens"]), c["slots"], out, c["gate"] if gated else None,
                         c["norm_w"] if gated else None, 1e-6)
    return out, pool


@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_kda_matches_ref(act_dtype, state_dtype):
    """Kimi delta attention against ``ops/kda.py``'s token-by-token reference: per-channel decay from the
    forget projection as ``KimiForgetGate`` computes it, beta = sigmoid(b), l2-normalized q/k. Without a
    gate the output is the recurrence's (one rounding: within one ulp of the reference); with one, the
    sigmoid-gated norm of that very output (``SigmoidGatedRMSNorm``, within one ulp) and the same states."""
    from hybridserve.layers.kda import SigmoidGatedRMSNorm
    from hybridserve.ops.kda import kda_varlen_ref

    c = _kda_case(act_dtype, state_dtype)
    H, Dk, Dv, T = c["H"], c["Dk"], c["Dv"], c["q"].shape[0]
    out, pool = _run_kda(c, state_dtype, gated=False)
    copy, expected_states = Pool(6, H * Dk * Dv + 5, state_dtype, seed=13).expected_view(3, (H, Dk, Dv))
    decay = -c["A_log"].exp().view(H, 1) * torch.nn.functional.softplus(
        c["f"].float() + c["dt_bias"]).view(T, H, Dk)  # (T, H, Dk)
    beta = c["b"].float().sigmoid()  # (T, H)
    idx = c["slots"]
    y_ref, final = kda_varlen_ref(c["q"].reshape(T, H, Dk), c["k"].reshape(T, H, Dk), c["v"].reshape(T, H, Dv),
                                  decay, beta, cu(c["lens"]), expected_states[idx].float(), use_qk_l2norm=True)
    _assert_output_close(out, y_ref.reshape(T, H * Dv).to(act_dtype), act_dtype, "kda out")
    expected_states[idx] = final.to(state_dtype)
    _assert_pool_close(pool.buf, copy, state_dtype, "kda states")

    gated, gated_pool = _run_kda(c, state_dtype, gated=True)
    assert_bits_equal(gated_pool.buf, pool.buf, "kda states with the gated norm")
    norm = SigmoidGatedRMSNorm(Dv, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(c["norm_w"])
        expected = norm(out.view(T * H, Dv), c["gate"].view(T * H, Dv)).view(T, H * Dv)
    _assert_output_close(gated, expected, act_dtype, "kda gated norm")


def test_kda_declines_uncovered_calls():
    c = _kda_case(torch.bfloat16, torch.float32)
    H, Dk, Dv, T = c["H"], c["Dk"], c["Dv"], c["q"].shape[0]
    pool = Pool(6, H * Dk * Dv + 5, torch.float32, seed=13)
    before = pool.buf.clone()
    out = torch.zeros(T, H * Dv, dtype=torch.bfloat16)
    states = pool.view(3, (H, Dk, Dv))
    args = [states, c["q"], c["k"], c["v"], c["f"], c["b"], c["A_log"], c["dt_bias"], True, cu(c["lens"]),
            c["slots"], out]
    for position, bad in ((1, c["q"].float()), (6, c["A_log"].to(torch.bfloat16)), (7, c["dt_bias"][:H]),
                          (11, out[:, :H * Dv - 1])):
        assert not recurrent.kda(*args[:position], bad, *args[position + 1:]), position
    assert not recurrent.kda(*args, c["gate"], None)  # a gate needs the norm weight
    assert_bits_equal(pool.buf, before, "declined calls leave the pool alone")
    assert not out.any()
