"""The memory bars on real-size configs (published dimensions, transformers' config classes, no weights).

For every family, dtype combination and context length: attention blocks of at most 64 tokens
whatever the state size; capacity within 1% of the ideal byte count (exact state bytes per
sequence plus exact KV bytes per token, nothing else); and one budget for KV and state, so that the
same pool fills with many short sequences or with a few long ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.cache.capacity import bytes_per_sequence, ideal_bytes_per_sequence, max_sequences, pool_geometry
from hybridserve.cache.layout import ALIGN, align_up, compute_layout
from hybridserve.config import EngineConfig
from hybridserve.planning.planner import plan_cache
from tests.cache.real_configs import REAL_CONFIGS

CACHE_MEMORY = 80 * 2**30  # one H100's worth
CONTEXTS = (1000, 4096, 131072)  # short (not a multiple of the block), default, long
DTYPE_CASES = {
    "auto": {},
    "float32 state": {"mamba_cache_dtype": "float32", "mamba_ssm_cache_dtype": "float32"},
    "fp8 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8 KV, float32 state": {"kv_cache_dtype": "fp8_e4m3", "mamba_ssm_cache_dtype": "float32"},
    "int8 state": {"mamba_ssm_cache_dtype": "int8"},  # codes and bfloat16 row scales
    "fp8 KV, fp8 state": {"kv_cache_dtype": "fp8_e4m3", "mamba_ssm_cache_dtype": "fp8_e4m3"},
}


def _config(family: str):
    """The family's config, or a skip while its model class has not landed in the registry."""
    from hybridserve.models.registry import model_class

    config = REAL_CONFIGS[family]()
    try:
        model_class(config.architectures[0])
    except (ValueError, ImportError) as exc:
        pytest.skip(f"{family}: model class not available yet ({exc})")
    return config


@pytest.mark.parametrize("dtypes", list(DTYPE_CASES))
@pytest.mark.parametrize("family", list(REAL_CONFIGS))
def test_small_blocks_and_capacity_within_one_percent(family, dtypes):
    config = _config(family)
    plan = plan_cache(config, EngineConfig(cache_memory=CACHE_MEMORY, **DTYPE_CASES[dtypes]))
    assert plan.layout.block_size == 16  # the default
    if "mamba_ssm_cache_dtype" in DTYPE_CASES[dtypes]:
        want = {"float32": torch.float32, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
        assert plan.dtypes.ssm_state == want[DTYPE_CASES[dtypes]["mamba_ssm_cache_dtype"]]
    if "kv_cache_dtype" in DTYPE_CASES[dtypes]:
        assert plan.dtypes.kv_cache == torch.float8_e4m3fn
    for block_size in (16, 64):
        layout = compute_layout(list(plan.specs), block_size)
        assert layout.block_size == block_size <= 64  # whatever the state size
        # no alignment padding at real sizes, but behind a tensor under a cache line (xLSTM's per-head max state)
        small = sum(align_up(p.nbytes) - p.nbytes for p in layout.state_placements if p.nbytes < ALIGN)
        assert layout.slot_bytes == layout.state_bytes_per_sequence + small
        if layout.has_kv:  # a page is block_size tokens of KV, never padded to a state's size
            assert layout.page_bytes == block_size * layout.kv_bytes_per_token
        geometry = pool_geometry(layout, CACHE_MEMORY)
        usable = geometry.num_pages * layout.page_bytes if layout.has_kv else geometry.num_slots * layout.slot_bytes
        assert CACHE_MEMORY - usable <= 0.01 * CACHE_MEMORY
        if block_size != 16:
            continue  # the 1% bar is for the default block; a 64-token block's last page wastes more on short contexts
        for tokens in CONTEXTS:
            ideal = ideal_bytes_per_sequence(layout, tokens)
            real = bytes_per_sequence(layout, tokens)
            assert real <= 1.01 * ideal, (tokens, real, ideal)  # padding: alignment and the last page only
            n = max_sequences(layout, CACHE_MEMORY, tokens)
            assert n >= math.floor(0.99 * CACHE_MEMORY / ideal), (tokens, n, CACHE_MEMORY / ideal)
            assert n * ideal <= CACHE_MEMORY  # and never more than the bytes allow


@pytest.mark.parametrize("family", ["bamba-9b", "nemotron-h-8b", "granite-4.0-h-small", "qwen3-next-80b-a3b",
                                    "jamba-v0.1", "falcon-h1-7b", "minimax-text-01", "qwen3.5-defaults",
                                    "qwen3.5-moe-vl-defaults", "olmo-hybrid-defaults"])
def test_one_budget_for_many_short_or_few_long(family):
    """With no static split, the pool's bytes go to state when requests are many and short, and to KV
    when they are few and long: both fill the pool to within 1% of its bytes."""
    config = _config(family)
    plan = plan_cache(config, EngineConfig(cache_memory=CACHE_MEMORY, mamba_ssm_cache_dtype="float32"))
    layout = plan.layout
    short, long = 256, 262144
    many = max_sequences(layout, CACHE_MEMORY, short)
    few = max_sequences(layout, CACHE_MEMORY, long)
    assert many > 20 * few >= 20
    state_share = many * layout.slot_bytes / CACHE_MEMORY
    kv_share = few * bytes_per_sequence(layout, long) / CACHE_MEMORY - few * layout.slot_bytes / CACHE_MEMORY
    assert state_share > 0.5 and kv_share > 0.5  # each mix gets most of the same pool ...
    for n, tokens in ((many, short), (few, long)):  # ... and fills it
        used = n * bytes_per_sequence(layout, tokens)
        assert used >= 0.99 * CACHE_MEMORY - bytes_per_sequence(layout, tokens)


@pytest.mark.parametrize("family", list(REAL_CONFIGS))
def test_captured_decode_costs_no_sequence(family):
    """With the engine's defaults (CPU kernels on, so decode steps are captured), a plan holds the ideal count
    of 4,096-token sequences: the padded rows of captured steps set no page and no slot aside (e.g.
    Nemotron-H-8B with float32 state in 4 GiB: 25 sequences, not 24)."""
    config = _config(family)
    for options in ({}, {"mamba_ssm_cache_dtype": "float32"}):
        for budget in (4 * 2**30, 6 * 2**30):
            plan = plan_cache(config, EngineConfig(cache_memory=budget, max_model_len=4096, **options))
            ideal = budget // ideal_bytes_per_sequence(plan.layout, 4096)
            assert plan.max_concurrent_sequences == ideal, (options, budget)


#: real-size families whose temporal state has rows of 64 or more (Mamba2 d_state 128, linear attention's and
#: mLSTM's value heads): 8-bit codes plus a bfloat16 scale per row make their whole state (bf16 conv state
#: included) at least 1.9x smaller than bf16 state
HALVED_STATE_FAMILIES = ["mamba-codestral-7b", "bamba-9b", "granite-4.0-h-small", "nemotron-h-8b", "falcon-h1-7b",
                         "minimax-text-01", "xlstm-7b"]


@pytest.mark.parametrize("family", HALVED_STATE_FAMILIES)
def test_8bit_state_is_1_9x_smaller_than_bf16(family):
    """`hybridserve plan`'s figures: one sequence's state at int8 and fp8_e4m3 is >= 1.9x smaller than at bf16
    (conv state bf16 in all three), and where the state is all a sequence holds (pure Mamba2: Codestral) a pool
    fits >= 1.9x the 4,096-token sequences. Row scales in float32 (4 bytes per 128 codes) left Codestral at
    1.89x and Bamba-9B at 1.90x (131.75 -> 69.75 and 59.40 -> 31.31 MiB)."""
    config = _config(family)
    budget = 16 * 2**30
    plans = {dtype: plan_cache(config, EngineConfig(cache_memory=budget, mamba_cache_dtype="bfloat16",
                                                    mamba_ssm_cache_dtype=dtype))
             for dtype in ("bfloat16", "int8", "fp8_e4m3")}
    state = {dtype: plan.layout.state_bytes_per_sequence for dtype, plan in plans.items()}
    for dtype in ("int8", "fp8_e4m3"):
        assert state["bfloat16"] >= 1.9 * state[dtype], (dtype, state)
        if not plans[dtype].layout.has_kv:
            fits = {d: max_sequences(plans[d].layout, budget, 4096) for d in ("bfloat16", dtype)}
            assert fits[dtype] >= 1.9 * fits["bfloat16"], fits


#: real-size families with a conv state beside a temporal state whose rows are 64 or more: with the conv state in
#: int8 too (an exponent byte per channel), the whole state is at least 1.9x smaller than bf16 state (with a
#: bf16 conv state the gated delta net and KDA families are at 1.85-1.89x, Zamba2 at 1.86x)
HALVED_WITH_CONV_FAMILIES = ["mamba-codestral-7b", "bamba-9b", "granite-4.0-h-small", "nemotron-h-8b",
                             "falcon-h1-7b", "zamba2-7b", "qwen3-next-80b-a3b", "qwen3.5-defaults",
                             "qwen3.5-moe-vl-defaults", "olmo-hybrid-defaults", "kimi-linear-defaults"]


@pytest.mark.parametrize("family", HALVED_WITH_CONV_FAMILIES)
def test_8bit_state_with_8bit_conv_state_is_1_9x_smaller_than_bf16(family):
    """`hybridserve plan`'s figures: with ``mamba_cache_dtype`` and ``mamba_ssm_cache_dtype`` int8, one sequence's
    state is >= 1.9x smaller than with both bf16, and where the state is all a sequence holds (pure Mamba2:
    Codestral) a pool fits >= 1.9x the 4,096-token sequences."""
    config = _config(family)
    budget = 16 * 2**30
    plans = {dtype: plan_cache(config, EngineConfig(cache_memory=budget, mamba_cache_dtype=dtype,
                                                    mamba_ssm_cache_dtype=dtype))
             for dtype in ("bfloat16", "int8")}
    state = {dtype: plan.layout.state_bytes_per_sequence for dtype, plan in plans.items()}
    assert state["bfloat16"] >= 1.9 * state["int8"], state
    conv = [t for spec in plans["int8"].specs for t in spec.state if t.exponent_scales]
    assert conv and all(t.coded and t.scale_dtype == "int8" and t.nbytes == math.prod(t.shape) + t.shape[0]
                        for t in conv)
    if not plans["int8"].layout.has_kv:
        fits = {d: max_sequences(plans[d].layout, budget, 4096) for d in plans}
        assert fits["int8"] >= 1.9 * fits["bfloat16"], fits


@pytest.mark.parametrize("family", list(REAL_CONFIGS))
def test_8bit_state_row_scales_are_bfloat16(family):
    """Every 8-bit temporal state tensor of a real-size config costs its codes plus 2 bytes per row, laid out as
    a bfloat16 ``<name>_scale`` entry right behind its codes."""
    config = _config(family)
    plan = plan_cache(config, EngineConfig(cache_memory=CACHE_MEMORY, mamba_ssm_cache_dtype="int8"))
    coded = [t for spec in plan.specs for t in spec.state if t.coded]  # (the conv state stays bf16 here)
    scales = {(p.layer, p.name): p for p in plan.layout.state_placements if p.name.endswith("_scale")}
    assert len(scales) == len(coded)
    for spec in plan.specs:
        for t in spec.state:
            if t.coded:
                assert t.nbytes == math.prod(t.shape) + 2 * math.prod(t.shape[:-1])
                placement = scales[(spec.index, t.scale_name)]
                assert placement.dtype == "bfloat16" and placement.nbytes == 2 * math.prod(t.shape[:-1])
