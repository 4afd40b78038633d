"""The Mamba2 scan's chunked (SSD) path on the AMX tiles (``csrc/mamba2_chunked_amx.h``): prefill sequences
of 64+ tokens with bf16 activations, against the token-by-token float32 reference
(``mamba2_chunk_scan_varlen_ref``), per shape class: a sequence below, at and above the chunk size, several
sequences (decode rows among them) in one call, non-zero incoming states, G > 1 groups, every state dtype;
head_dim / d_state the tiles do not take, and float32 activations, keep the token-by-token path.

Tolerance, from the operands rounded to bf16: the decay-weighted W = C.B^T * exp(cs_t - cs_u) * dt_u is
rounded once (relative error <= 2^-8, bf16's unit roundoff); the operands that carry the state, w * x into
it and the float32 state S out of it (into C.S), are each a hi + lo pair of bf16 (<= 2^-16 of each value);
every sum is float32. Each term of an output is therefore off by at most (2^-8 + 2^-16) of its magnitude,
each term of a final state by at most 2^-16 of its magnitude, so

    |y - y_reference| <= (2^-8 + 2^-15) * y_reference_on_magnitudes + float32 noise,
    |state - state_reference| <= 2^-15 * state_reference_on_magnitudes + float32 noise,

where *_on_magnitudes is the reference run on |x|, |B|, |C|, |D| and |initial state| (every decay and step
is positive, so it sums the magnitudes of the same terms). A stored 16-bit state adds one ulp of its
dtype."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.kernels import fallbacks, isa, recurrent
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen_ref
from tests.kernels.helpers import DTYPES, Pool, assert_bits_equal, cu, dtype_id, needs_compiler, spacing

BF16_TERMS = 2.0**-8 + 2.0**-15  # relative error of one term of an output (module docstring)
STATE_TERMS = 2.0**-15  # relative error of one term of a final state: hi + lo operands only
F32_NOISE = 1e-6  # float32 sums, relative to the magnitudes' reference

pytestmark = needs_compiler


@pytest.fixture
def amx():
    """The kernels at the amx level (skipped, naming what is missing, on CPUs without AMX-BF16 tiles or under
    a lower --cpu-isa cap); the previous cap is restored after."""
    missing = isa.cpu_info().missing("amx")
    if missing:
        pytest.skip(f"the chunked Mamba2 scan needs {', '.join(missing)}, which this CPU lacks")
    if isa.cap() != "auto" and isa.LEVELS.index(isa.cap()) < isa.LEVELS.index("amx"):
        pytest.skip(f"the amx level is above this run's --cpu-isa cap ({isa.cap()})")
    previous = isa.cap()
    isa.set_cap("amx")
    try:
        yield
    finally:
        isa.set_cap(previous)


class Case:
    """One packed call: x, B, C, dt column slices of one projection in act_dtype; states a strided pool view
    with random (non-zero) incoming states at non-consecutive slots."""

    def __init__(self, lens, act_dtype=torch.bfloat16, state_dtype=torch.float32, H=4, P=64, G=1, N=64, seed=0,
                 strong_decay=False):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.H, self.P, self.G, self.N = list(lens), H, P, G, N
        T = sum(lens)
        widths = [H * P, G * N, G * N, H]
        proj = torch.randn(T, sum(widths) + 3, generator=g)
        proj[:, sum(widths[:3]):sum(widths)] = proj[:, sum(widths[:3]):sum(widths)] * 1.5 - 1.0  # raw dt
        self.proj = proj.to(act_dtype)
        self.x, self.B, self.C, self.dt = torch.split(self.proj[:, :sum(widths)], widths, dim=1)
        A = -torch.exp(torch.rand(H, generator=g) * 2 - 1)
        if strong_decay:  # Granite's range: exp(dt * A) reaches the subnormal floats
            A = -torch.linspace(1.0, 64.0, H)
        self.A = A.contiguous()
        self.D = torch.randn(H, generator=g)
        self.dt_bias = torch.randn(H, generator=g) * 0.5
        self.slots = torch.tensor([7, 1, 4, 0, 5, 2][:len(lens)], dtype=torch.int64)
        self.pool = Pool(9, H * P * N + 24, state_dtype, seed=seed + 1)
        self.states = self.pool.view(5, (H, P, N))  # (9, H, P, N)

    def run(self):
        y = torch.full((sum(self.lens), self.H * self.P), float("nan"))
        assert recurrent.mamba2_scan(self.states, self.x, self.dt, self.A, self.B, self.C, self.D, self.dt_bias,
                                     True, (0.0, math.inf), cu(self.lens), self.slots, y)
        return y, self.states[self.slots].clone()

    def reference(self, magnitudes=False):
        """(y, final states) of the float32 token-by-token reference (on magnitudes: every input's |.|)."""
        T, H, P, G, N = sum(self.lens), self.H, self.P, self.G, self.N
        f = (lambda t: t.float().abs()) if magnitudes else (lambda t: t.float())
        init = self.pool.expected_view(5, (H, P, N))[1][self.slots]
        y, fin = mamba2_chunk_scan_varlen_ref(
            f(self.x).reshape(T, H, P), self.dt.float(), self.A, f(self.B).reshape(T, G, N),
            f(self.C).reshape(T, G, N), 0, f(self.D), self.dt_bias, True, (0.0, math.inf), cu(self.lens), f(init))
        return y.reshape(T, H * P), fin

    def reset(self):
        self.pool.buf.copy_(self.pool.before)


def assert_within_bf16_terms(actual, expected, magnitudes, what, state_dtype=torch.float32, terms=BF16_TERMS):
    bound = (terms + F32_NOISE) * magnitudes + F32_NOISE * float(expected.abs().max())
    if state_dtype != torch.float32:
        bound = bound + spacing(expected, state_dtype)
    err = (actual.float() - expected).abs()
    assert torch.isfinite(actual.float()).all(), what
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than the bf16 bound; "
                           f"max err {err.max().item():.3g}, max err / magnitude {(err / magnitudes).max().item():.3g}")


def token_path_result(case):
    """The same call through the token-by-token path (the avx512_bf16 level has no chunked path)."""
    previous = isa.cap()
    isa.set_cap("avx512_bf16")
    try:
        case.reset()
        out = case.run()
    finally:
        isa.set_cap(previous)
        case.reset()
    return out


def check_against_reference(case, state_dtype=torch.float32):
    y, fin = case.run()
    y_ref, fin_ref = case.reference()
    y_mag, fin_mag = case.reference(magnitudes=True)
    assert_within_bf16_terms(y, y_ref, y_mag, "scan output")
    assert_within_bf16_terms(fin, fin_ref, fin_mag, "final states", state_dtype, terms=STATE_TERMS)
    expected_pool, expected_states = case.pool.expected_view(5, (case.H, case.P, case.N))
    expected_states[case.slots] = case.states[case.slots]
    assert_bits_equal(case.pool.buf, expected_pool, "state pool outside the call's slots")
    return y


def rows_of(lens, which):
    starts = cu(lens).tolist()
    return slice(starts[which], starts[which + 1])


@pytest.mark.parametrize("length", [64, 150, 256], ids=["at-chunk", "above-chunk-partial", "four-chunks"])
def test_chunked_matches_reference(amx, length):
    case = Case([length], seed=length)
    assert recurrent.mamba2_scan_path(torch.bfloat16, case.P, case.N, length) == "chunked"
    y = check_against_reference(case)
    y_token, _ = token_path_result(case)
    assert not torch.equal(y, y_token), "the chunked path did not run (same bits as the token path)"


def test_chunked_below_min_tokens_takes_token_path(amx):
    case = Case([63], seed=3)
    assert recurrent.mamba2_scan_path(torch.bfloat16, case.P, case.N, 63) == "token"
    y = check_against_reference(case)
    assert torch.equal(y, token_path_result(case)[0])


@pytest.mark.parametrize("state_dtype", DTYPES, ids=dtype_id)
def test_chunked_mixed_call_nonzero_states(amx, state_dtype):
    """Decode rows, a short prompt chunk and two long ones in one call, each continuing a random state."""
    lens = [1, 150, 17, 64, 1]
    case = Case(lens, state_dtype=state_dtype, H=6, P=32, G=2, N=96, seed=11)
    y = check_against_reference(case, state_dtype)
    y_token, _ = token_path_result(case)
    for i, n in enumerate(lens):
        same = torch.equal(y[rows_of(lens, i)], y_token[rows_of(lens, i)])
        assert same == (n < recurrent.CHUNKED_SCAN_MIN_TOKENS), f"sequence {i} ({n} tokens) took the wrong path"


def test_chunked_two_threads_match_one(amx):
    case = Case([1, 150, 64], H=6, G=2, seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y2, fin2 = case.run()
        case.reset()
        torch.set_num_threads(1)
        y1, fin1 = case.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2) and torch.equal(fin1, fin2)


def test_chunked_strong_decay(amx):
    """Decays down to the subnormal floats (A to -64): the masked exponentials stay finite and exact enough."""
    case = Case([200], H=8, seed=5, strong_decay=True)
    check_against_reference(case)


def test_chunked_continues_across_calls(amx):
    """Two prefill chunks of 128 tokens through a float32 pool == one call over 256 tokens, bit for bit: the
    chunk boundaries fall at the same tokens and the state between the calls is the float32 one carried."""
    whole = Case([256], seed=9)
    y_whole, fin_whole = whole.run()
    whole.reset()
    y_parts = []
    for part in (slice(0, 128), slice(128, 256)):
        y = torch.empty(128, whole.H * whole.P)
        assert recurrent.mamba2_scan(whole.states, whole.x[part], whole.dt[part], whole.A, whole.B[part],
                                     whole.C[part], whole.D, whole.dt_bias, True, (0.0, math.inf), cu([128]),
                                     whole.slots, y)
        y_parts.append(y)
    assert torch.equal(torch.cat(y_parts), y_whole)
    assert torch.equal(whole.states[whole.slots], fin_whole)


@pytest.mark.parametrize("P,N", [(40, 64), (64, 48)], ids=["head_dim-40", "d_state-48"])
def test_shapes_off_the_tiles_take_token_path(amx, P, N):
    """head_dim not a multiple of 16, d_state not of 32: the token path, the same bits as below amx, and one
    counted fallback naming the shape."""
    case = Case([96], P=P, N=N, H=2, seed=P + N)
    assert recurrent.mamba2_scan_path(torch.bfloat16, P, N, 96) == "token"
    fallbacks.reset()
    y = check_against_reference(case)
    reasons = [reason for (op, reason) in fallbacks.counts() if op == "mamba2_chunked_scan"]
    assert reasons and f"head_dim {P}" in reasons[0] and f"d_state {N}" in reasons[0], fallbacks.counts()
    fallbacks.reset()
    assert torch.equal(y, token_path_result(case)[0])


def test_float32_activations_take_token_path(amx):
    case = Case([96], act_dtype=torch.float32, seed=4)
    assert recurrent.mamba2_scan_path(torch.float32, case.P, case.N, 96) == "token"
    fallbacks.reset()
    y = check_against_reference(case)
    assert not fallbacks.counts()
    assert torch.equal(y, token_path_result(case)[0])


def test_path_below_amx_is_token():
    previous = isa.cap()
    isa.set_cap("avx512_bf16")
    try:
        assert recurrent.mamba2_scan_path(torch.bfloat16, 64, 128, 512) == "token"
    finally:
        isa.set_cap(previous)


def test_env_report_names_each_path():
    """``hybridserve env`` (kernels/report.py) says which scan path each case takes, per level."""
    from hybridserve.kernels import report

    at_amx = report.mamba2_scan_variant("amx")
    assert "chunked (SSD) form" in at_amx and "AMX-BF16 tiles" in at_amx and "token-by-token" in at_amx
    assert f"{recurrent.CHUNKED_SCAN_MIN_TOKENS}+ tokens" in at_amx
    below = report.mamba2_scan_variant("avx512_bf16")
    assert "token-by-token" in below and "needs the amx level" in below


@pytest.mark.parametrize("family,overrides", [("mamba2", {"state_size": 32}),
                                              ("granitemoehybrid", {"mamba_d_state": 32})])
def test_engine_prefill_on_chunked_path_against_hf(amx, ckpt_dir, monkeypatch, family, overrides):
    """A bf16 model whose d_state the tiles take (32): its 150-token prompt is scanned in the chunked form
    (the scan calls are watched), nothing is counted as declined, and greedy decoding against HF float32
    follows the near-tie rule."""
    from hybridserve import LLM, SamplingParams
    from tests.checkpoints import make
    from tests.hf_reference import compare, hf_greedy

    path32 = make(ckpt_dir, family, **overrides)
    path16 = make(ckpt_dir, family, dtype=torch.bfloat16, **overrides)
    prompt = torch.randint(3, 120, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    paths = []  # per scan call: (its longest sequence, the path that sequence takes)
    scan = recurrent.mamba2_scan

    def watched(ssm_states, x, *args):
        cu_seqlens = args[-3]
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        paths.append((longest, recurrent.mamba2_scan_path(x.dtype, ssm_states.shape[2], ssm_states.shape[3], longest)))
        return scan(ssm_states, x, *args)

    fallbacks.reset()
    llm = LLM(path16, mamba_ssm_cache_dtype="float32", cache_memory="32MiB", enforce_eager=True)
    monkeypatch.setattr(recurrent, "mamba2_scan", watched)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True))[0]
    assert (150, "chunked") in paths, paths
    assert not fallbacks.counts(), fallbacks.counts()
    compare([out.outputs[0].token_ids], [out.outputs[0].logprobs], hf_greedy(path32, [prompt], 12))
