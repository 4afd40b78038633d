"""8-bit conv state (``mamba_cache_dtype`` int8) on every family that has a conv state.

* Parity: against HF float32 under the near-tie rule (``tests/hf_reference.compare``), with the temporal state in
  int8 too where the family has one (the configuration that halves a sequence's state), as ``test_parity.py``
  runs it (prompts of mixed lengths, split prefills, queued requests).
* The kernel bodies take the codes in place (no call handed to the plain body) and the decode step is replayed
  from its capture.
* Exactness where it holds by construction: a prefix hit resumes from a snapshot (a copy of the slot's codes and
  scales) and gives the outputs of an uncached run chunked at the same token, bit for bit; the plain body
  (decode, encode around the PyTorch op) gives the kernel body's conv codes.
* ``cache_layout()`` and ``hybridserve plan --json`` count codes and scales to the byte.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.kernels import fallbacks
from tests.checkpoints import make
from tests.engine.test_parity import NEW_TOKENS, prompts
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything

#: family -> whether it has a temporal state (then int8 too in these tests)
FAMILIES = {"mamba2": True, "bamba": True, "mamba": True, "falcon_mamba": True, "jamba": True,
            "granitemoehybrid": True, "nemotron_h": True, "zamba2": True, "falcon_h1": True, "qwen3_next": True,
            "qwen3_5": True, "qwen3_5_moe": True, "olmo_hybrid": True, "kimi_linear": True, "lfm2": False,
            "lfm2_moe": False, "lfm3": False}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
_HF: dict[str, list] = {}


def _llm(path: str, family: str, **options) -> LLM:
    opts = {"max_num_batched_tokens": 20, "max_num_seqs": 3, "cache_memory": "16MiB", "enable_progress_bar": False,
            **options}
    if FAMILIES[family]:
        opts.setdefault("mamba_ssm_cache_dtype", "int8")
    return LLM(path, mamba_cache_dtype="int8", **opts)


def _conv_views(llm: LLM) -> list[CodedConvState]:
    return [v for c in llm.engine.pool.layer_caches.values() if c.state for v in c.state.values()
            if isinstance(v, CodedConvState)]


def _outputs(outs) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs])
            for o in outs for c in o.outputs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eight_bit_conv_state_matches_hf_under_the_near_tie_rule(ckpt_dir, family, record_property):
    path = make(ckpt_dir, family)
    llm = _llm(path, family)
    assert _conv_views(llm), "the pool holds 8-bit conv codes"
    ps = prompts(llm.engine.hf_config.vocab_size)[1::2]  # lengths 7, 33, 70
    if path not in _HF:
        _HF[path] = hf_greedy(path, ps, NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], _HF[path])
    record_property("mean_abs_logprob_error", cmp.mean_abs_error)
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert released_everything(llm.engine)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kernel_bodies_take_coded_conv_state_and_decode_is_captured(ckpt_dir, family):
    """With the CPU kernels on, every op over an 8-bit conv state runs its kernel body on the codes in place,
    prefill and decode, and the decode steps replay their capture."""
    fallbacks.reset()
    llm = _llm(make(ckpt_dir, family), family, cpu_kernels=True)
    llm.generate([{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": list(range(5, 9))}], GREEDY)
    declined = {(op, reason) for (op, reason), n in fallbacks.counts().items() if n and "state codes" in reason}
    assert declined == set()
    runner = llm.engine.runner
    assert runner.captured_decode is not None, llm.engine.cpu_fast_paths.decode_reason
    fallbacks.reset()


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next", "kimi_linear", "lfm2"])
def test_the_plain_body_writes_the_kernel_bodys_conv_codes(ckpt_dir, family):
    """The same requests through the plain bodies (decode, PyTorch op, encode) and the kernel bodies leave
    the same greedy tokens, and a conv state of zeros-then-one-prompt the same codes (prefill only: one
    rounding of every input in both)."""
    path = make(ckpt_dir, family)
    got = {}
    for kernels in (False, True):
        llm = _llm(path, family, cpu_kernels=kernels, enforce_eager=True)
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        got[kernels] = out[0].outputs[0].token_ids
        assert released_everything(llm.engine)
    assert got[False] == got[True]


@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2"])
def test_a_prefix_hit_gives_the_uncached_outputs_bit_for_bit(ckpt_dir, family):
    """The later requests resume from the snapshot at the shared prefix (conv codes and scales copied); an
    uncached engine whose chunk budget ends a chunk at the same token computes the very same bits."""
    path = make(ckpt_dir, family)
    shared = 37
    rng = random.Random(7)
    prefix = [rng.randrange(3, 120) for _ in range(shared)]
    ps = [prefix + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    on = _llm(path, family, cache_memory="8MiB", max_num_batched_tokens=64)
    got = [on.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in ps]
    assert all(g.num_cached_tokens == shared for g in got[2:])
    chunked = _llm(path, family, cache_memory="8MiB", max_num_batched_tokens=shared, enable_prefix_caching=False)
    want = [chunked.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in ps[1:]]
    assert _outputs(got[1:]) == _outputs(want)
    assert released_everything(chunked.engine)


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
def test_forked_children_equal_the_single_request_bit_for_bit(ckpt_dir, family):
    """``n > 1``: the children start from copies of the parent's slot (conv codes and exponents with it)."""
    llm = _llm(make(ckpt_dir, family), family, max_num_batched_tokens=64, enable_prefix_caching=False)
    ps = [[5, 9, 14, 3, 77, 21, 8, 40, 41, 42, 43, 17, 19, 23, 29, 31, 37, 11, 13], [60, 61, 62]]
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    single = _outputs(llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**params)))
    forked = _outputs(llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(n=3, **params)))
    assert forked == [single[0]] * 3 + [single[1]] * 3
    assert released_everything(llm.engine)


@pytest.mark.parametrize("family", ["bamba", "kimi_linear", "lfm2"])
def test_cache_layout_and_plan_count_conv_codes_and_scales_exactly(ckpt_dir, capsys, family):
    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, family)
    llm = _llm(path, family)
    layout = llm.cache_layout()
    assert layout["mamba_cache_dtype"] == "int8"
    total = 0
    for entry in layout["layers"]:
        real = llm.engine.pool.layer_caches[entry["index"]]
        for t in entry["tensors"]:
            if t["per"] != "sequence":
                continue
            total += t["bytes"]
            view = real.state[t.get("scales", t["name"])]
            if "scales" in t:
                assert t["name"] == t["scales"] + "_scale"
                tensor = view.scale
            else:
                tensor = view if isinstance(view, torch.Tensor) else view.codes
            if t["name"] == "conv_scale":  # one int8 exponent per channel
                assert isinstance(view, CodedConvState) and t["dtype"] == "int8"
                assert t["shape"] == [view.codes.shape[1]]
            assert list(tensor.shape[1:]) == t["shape"]
            assert tensor[0].numel() * tensor.element_size() == t["bytes"]
            if "scales" not in t:  # the codes say how they round: conv nearest, temporal by its kind
                assert t["rounding"] == {"conv": "nearest", "ssm": "stochastic", "recurrent": "nearest"}[t["name"]]
    assert total == layout["state_bytes_per_sequence"] > 0
    args = ["plan", path, "--json", "--cache-memory=16MiB", "--mamba-cache-dtype=int8"]
    if FAMILIES[family]:
        args.append("--mamba-ssm-cache-dtype=int8")
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layers"] == layout["layers"]
    for key in ("state_bytes_per_sequence", "slot_bytes", "page_bytes", "mamba_cache_dtype"):
        assert plan[key] == layout[key], key


def test_fp8_conv_state_is_refused_naming_the_allowed_values():
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError, match=r"mamba_cache_dtype='fp8_e4m3'.*auto, float32, bfloat16, float16, int8"):
        EngineConfig(model="x", mamba_cache_dtype="fp8_e4m3")
