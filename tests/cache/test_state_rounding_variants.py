"""The rounding schemes that benchmarks/state_precision.py patches into CodedState (benchmarks/state_rounding.py)."""

import math

import pytest
import torch

from hybridserve.cache.state_codec import CodedState, uniform_noise
from tests.gguf.benchmark_script import load_benchmark

precision = load_benchmark("state_precision")
rounding = precision.state_rounding  # (imported by the benchmark from its own folder)


def _coded(slots: int, shape: tuple[int, ...], dtype: torch.dtype = torch.int8) -> CodedState:
    codes = torch.zeros(slots, *shape, dtype=dtype)
    return CodedState(codes, torch.zeros(slots, *shape[:-1], dtype=torch.bfloat16), layer=3)


def _write(state: CodedState, slots: list[int], values: torch.Tensor, position: int = 7) -> None:
    idx = torch.tensor(slots)
    state.write(idx, values, torch.full_like(idx, 5), torch.full_like(idx, position))


def test_patched_stochastic_writes_the_engine_codes():
    values = torch.randn(2, 4, 32)
    engine, patched = _coded(3, (4, 32)), _coded(3, (4, 32))
    _write(engine, [0, 2], values)
    with rounding.patched(rounding.Rounding("stochastic")):
        _write(patched, [0, 2], values)
    assert torch.equal(engine.codes, patched.codes) and torch.equal(engine.scale, patched.scale)


def test_subtractive_int8_error_is_within_half_a_step_and_unbiased():
    x = torch.full((64, 64), 0.3)  # (rows, n): every code step s = 0.3 / 127 rounded up to bfloat16
    x[:, 0] = 1.0  # the row maximum sets the scale
    u = uniform_noise(torch.tensor([1]), torch.tensor([9]), 0, tuple(x.shape))[0]
    sub = rounding.Rounding("subtractive")
    codes, row_scale, groups = rounding.encode(x, torch.int8, sub, u)
    step = row_scale.float()[:, None]
    err = (rounding.decode(codes, row_scale, sub, u, groups) - x)[:, 1:] / step[:, :1]  # in code steps
    assert float(err.abs().max()) <= 0.5
    assert abs(float(err.mean())) < 0.02
    stochastic = rounding.decode(codes, row_scale, rounding.Rounding("stochastic"), u, groups)
    assert float(((stochastic - x)[:, 1:] / step).abs().max()) > 0.75  # decoding without u: up to a whole step


def test_subtractive_slot_reads_back_within_half_a_step():
    values = torch.randn(2, 4, 32)
    state = _coded(3, (4, 32))
    with rounding.patched(rounding.Rounding("subtractive")):
        _write(state, [2, 0], values)
        back = state.read(torch.tensor([0, 2, -1]))
    step = state.scale.float()[[2, 0]][..., None]
    assert float(((back[[1, 0]] - values) / step).abs().max()) <= 0.5
    assert not bool(back[2].any())  # a padded row reads zeros


def test_a_zeroed_slot_reads_zeros_and_a_copied_one_is_refused():
    state = _coded(3, (4, 32))
    with rounding.patched(rounding.Rounding("subtractive", groups=2)):
        _write(state, [0], torch.randn(1, 4, 32))
        state.codes[0].zero_()
        state.scale[0].zero_()  # what the pool does for a new sequence
        assert not bool(state.read(torch.tensor([0])).any())
        _write(state, [0], torch.randn(1, 4, 32))
        state.codes[1].copy_(state.codes[0])
        state.scale[1].copy_(state.scale[0])
        with pytest.raises(RuntimeError, match="slot 1 of layer 3 holds codes this prototype did not write"):
            state.read(torch.tensor([1]))


def test_weyl_noise_advances_by_the_golden_ratio_per_position():
    weyl = rounding.Rounding("subtractive", weyl=True)
    keys = torch.tensor([4, 4])
    u = rounding.noise(weyl, keys, torch.tensor([10, 11]), 2, (3, 8))
    step = torch.remainder(u[1] - u[0], 1.0)
    assert torch.allclose(step, torch.full_like(step, rounding.WEYL_STEP), atol=1e-5)
    fresh = rounding.noise(rounding.Rounding("subtractive"), keys, torch.tensor([10, 11]), 2, (3, 8))
    assert not torch.allclose(torch.remainder(fresh[1] - fresh[0], 1.0), step, atol=1e-3)


def test_u8_scales_round_up_by_less_than_an_eighth():
    s = torch.tensor([0.0, 1e-9, 2.0 ** -22, 0.3, 1.0, 1.01, 7.9, rounding.U8_SCALE_MAX])
    up = rounding.scale_up_u8(s)
    assert up[0] == 0 and up[1] == 2.0 ** -22
    assert bool((up >= s).all()) and bool((up[2:] < s[2:] * (1 + 2.0 ** -rounding.U8_MANTISSA_BITS)).all())
    mantissa, exp = torch.frexp(up[1:])
    assert bool((mantissa * 16 == torch.round(mantissa * 16)).all())  # 1 + 3 mantissa bits
    with pytest.raises(ValueError, match="above the 8-bit scale's largest"):
        rounding.scale_up_u8(torch.tensor([rounding.U8_SCALE_MAX * 1.01]))


def test_scale_groups_keep_an_outlier_from_coarsening_the_other_half():
    x = torch.full((1, 16), 0.01)
    x[0, 0] = 10.0  # an outlier in the first half
    grouped = rounding.Rounding("stochastic", groups=2)
    codes, row_scale, groups = rounding.encode(x, torch.int8, grouped, None)
    assert groups.shape == (1, 2) and bool((codes.abs() <= 127).all())
    err_grouped = (rounding.decode(codes, row_scale, grouped, None, groups) - x)[0, 8:].abs().max()
    row = rounding.Rounding("stochastic")
    codes, row_scale, _ = rounding.encode(x, torch.int8, row, None)
    err_row = (rounding.decode(codes, row_scale, row, None, None) - x)[0, 8:].abs().max()
    assert float(err_grouped) < 0.01 * float(err_row)
    assert rounding.bytes_per_row(128, grouped) == rounding.bytes_per_row(128, row) == 130


def test_subtractive_e4m3_error_is_within_half_an_ulp_inside_a_binade():
    v = torch.linspace(1.2, 1.8, 4096)  # inside [1, 2): ulp 1/8
    u = uniform_noise(torch.tensor([2]), torch.tensor([3]), 1, (4096,))[0]
    sub = rounding.Rounding("subtractive")
    codes = rounding._e4m3_subtractive(v, u)
    back = rounding.decode(codes, torch.ones(()), sub, u, None)
    err = (back - v) * 8  # in ulps
    assert float(err.abs().max()) <= 0.5 + 1e-6 and abs(float(err.mean())) < 0.02
    neg = rounding.decode(rounding._e4m3_subtractive(-v, u), torch.ones(()), sub, u, None)
    assert torch.allclose(neg, -back)


def test_variant_names_are_checked():
    assert precision.parse_variant("int8/subtractive-weyl-g2") == ("int8", rounding.Rounding("subtractive", True, 2))
    assert precision.parse_variant("bfloat16/nearest")[0] == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown state dtype 'int4'; allowed: \['bfloat16'"):
        precision.parse_variant("int4/stochastic")
    with pytest.raises(ValueError, match="rounds to nearest only"):
        precision.parse_variant("bfloat16/stochastic")
    with pytest.raises(ValueError, match="bad part 'g0'"):
        precision.parse_variant("int8/subtractive-g0")
    with pytest.raises(ValueError, match="unknown base 'dither'"):
        precision.parse_variant("int8/dither")


def test_the_benchmark_measures_a_patched_variant(tmp_path):
    from tests.checkpoints import make

    path = make(str(tmp_path), "mamba2")
    result = precision.measure(path, "mamba2", 8, 8, ["int8/stochastic", "int8/subtractive-g2"], keys=(0, 1))
    figures = result["variants"]
    assert figures["int8/stochastic"]["mean"] > 0 and math.isfinite(figures["int8/subtractive-g2"]["mean"])
    assert figures["int8/subtractive-g2"]["mean"] != figures["int8/stochastic"]["mean"]
    assert len(set(figures["int8/stochastic"]["mean_per_key"])) == 2  # the keys round differently
    assert figures["int8/stochastic"]["x_bf16"] is None  # no bfloat16/nearest among the variants
