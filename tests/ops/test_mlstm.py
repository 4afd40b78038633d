"""The mLSTM cell (``ops/mlstm.py``): the chunkwise varlen prefill against the token-by-token reference and
HF's own native kernels (outputs and final C, n, m), lengths not multiples of the chunk, initial states,
the single-token update on strided slots in every state dtype, and the exactly stored max state."""

from __future__ import annotations

import pytest
import torch

from hybridserve.ops.mlstm import fit_max_state, mlstm_update, mlstm_update_ref, mlstm_varlen, mlstm_varlen_ref


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


def _inputs(T, H, Dk, Dv, seed=0):
    """q, k (T, H, Dk), v (T, H, Dv), gate pre-activations i, f (T, H) as HF's init spreads them: input
    gates around -10 .. 2, forget gates mostly open (long memories) with some closing."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(T, H, Dk, generator=g), torch.randn(T, H, Dk, generator=g), torch.randn(T, H, Dv, generator=g)
    i = torch.randn(T, H, generator=g) * 4 - 4
    f = torch.randn(T, H, generator=g) * 3 + 3
    return q, k, v, i, f


def _initial(S, H, Dk, Dv, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, H, Dk, Dv, generator=g), torch.randn(S, H, Dk, generator=g).abs(),
            torch.randn(S, H, generator=g))


def _pool(slots, H, Dk, Dv, dtype):
    """C (slots, H, Dk, Dv), n (slots, H, Dk), m (slots, H): views of one zeroed buffer with one slot stride (the
    pool's layout, 5 elements of padding per slot), and the buffer."""
    width = H * Dk * Dv + H * Dk + H + 5
    buf = torch.zeros(slots, width, dtype=dtype)
    C = buf[:, :H * Dk * Dv].unflatten(1, (H, Dk, Dv))
    n = buf[:, H * Dk * Dv:H * Dk * Dv + H * Dk].unflatten(1, (H, Dk))
    return (C, n, buf[:, H * Dk * Dv + H * Dk:H * Dk * Dv + H * Dk + H]), buf


def _assert_close_rel(a, b, rtol):
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


@pytest.mark.parametrize("lens", [[1, 7, 16, 33, 70], [64], [5]])
@pytest.mark.parametrize("chunk_size", [8, 16, 64])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunkwise_prefill_state_equals_stepped_state(lens, chunk_size, with_init):
    H, Dk, Dv = 3, 8, 12
    q, k, v, i, f = _inputs(sum(lens), H, Dk, Dv)
    init = _initial(len(lens), H, Dk, Dv) if with_init else None
    out, final = mlstm_varlen(q, k, v, i, f, _cu(lens), init, chunk_size=chunk_size)
    out_ref, final_ref = mlstm_varlen_ref(q, k, v, i, f, _cu(lens), init)
    assert out.shape == (sum(lens), H, Dv) and out.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    for name, a, b, shape in zip("Cnm", final, final_ref, [(H, Dk, Dv), (H, Dk), (H,)]):
        assert a.shape == (len(lens), *shape), name
        _assert_close_rel(a, b, 1e-5)


@pytest.mark.parametrize("length", [1, 16, 37, 128])
def test_prefill_matches_hf_native_kernels(length):
    """The same outputs and last state as HF's own token loop (``mlstm_recurrent_sequence_native``) and, over
    whole chunks, its chunkwise kernel (``mlstm_chunkwise_native_autograd``), from a given initial state."""
    hf = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    if getattr(hf, "external_xlstm", False):
        pytest.skip("transformers runs the external xlstm package here, not its native kernels")
    H, Dk, Dv = 2, 16, 8
    q, k, v, i, f = _inputs(length, H, Dk, Dv, seed=3)
    C0, n0, m0 = _initial(1, H, Dk, Dv, seed=4)
    out, (C, n, m) = mlstm_varlen(q, k, v, i, f, _cu([length]), (C0, n0, m0), chunk_size=16)
    bhsd = [t.transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, S, D)
    gates = [t.t()[None] for t in (i, f)]  # (1, H, S)
    runs = [hf.mlstm_recurrent_sequence_native(*bhsd, *gates, C0, n0, m0[..., None], return_last_states=True)]
    if length % 16 == 0:
        runs.append(hf.mlstm_chunkwise_native_autograd(*bhsd, *gates, C0, n0, m0[..., None], return_last_states=True,
                                                       chunk_size=16))
    for h_hf, (C_hf, n_hf, m_hf) in runs:
        _assert_close_rel(out, h_hf[0].transpose(0, 1), 1e-5)
        _assert_close_rel(C, C_hf, 1e-5)
        _assert_close_rel(n, n_hf, 1e-5)
        _assert_close_rel(m, m_hf[..., 0], 1e-6)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_update_matches_ref_on_strided_slots(state_dtype):
    """Slots 2 and 5 of a pool-like buffer (one slot stride for C, n and m), in their own dtype."""
    B, H, Dk, Dv, slots = 2, 3, 8, 6, 7
    results = []
    for fn in (mlstm_update, mlstm_update_ref):
        (C, n, m), pool = _pool(slots, H, Dk, Dv, state_dtype)
        C0, n0, m0 = _initial(slots, H, Dk, Dv, seed=5)
        C.copy_(C0), n.copy_(n0), m.copy_(m0)
        h = [fn((C, n, m), *_inputs(B, H, Dk, Dv, seed=s), torch.tensor([2, 5])) for s in range(3)]
        results.append((torch.stack(h), pool))
    (h, pool), (h_ref, pool_ref) = results
    _assert_close_rel(h, h_ref, 1e-5)
    assert torch.equal(pool[[0, 1, 3, 4, 6]], pool_ref[[0, 1, 3, 4, 6]])  # other slots untouched
    _assert_close_rel(pool.float(), pool_ref.float(), 1e-5 if state_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stored_max_state_is_exact_and_the_state_unchanged(dtype):
    """fit_max_state gives an m the dtype holds exactly, and a state with the same outputs and the same future."""
    H, Dk, Dv = 4, 8, 6
    C, n, m = _initial(1, H, Dk, Dv, seed=6)
    m = m * 7 + 0.0123  # |m| up to ~20: bf16 rounds it by up to 0.06
    Cf, nf, mf = fit_max_state(C, n, m, dtype)
    assert torch.equal(mf, mf.to(dtype).float()) and not torch.equal(mf, m)
    q, k, v, i, f = _inputs(9, H, Dk, Dv, seed=7)
    h, final = mlstm_varlen(q, k, v, i, f, _cu([9]), (C, n, m))
    hf, final_f = mlstm_varlen(q, k, v, i, f, _cu([9]), (Cf, nf, mf))
    _assert_close_rel(hf, h, 1e-5)
    (C1, n1, m1), (C2, n2, m2) = final, final_f  # the same memory C e^m, n e^m
    _assert_close_rel(C2 * m2.exp()[..., None, None], C1 * m1.exp()[..., None, None], 1e-5)
    _assert_close_rel(n2 * m2.exp()[..., None], n1 * m1.exp()[..., None], 1e-5)
