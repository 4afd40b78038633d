"""8-bit conv state (``mamba_cache_dtype`` int8) on every family that has a conv state.

* Parity: against HF float32 under the near-tie rule (``tests/hf_reference.compare``), with the temporal state in
  int8 too where the family has one (the configuration that halves a sequence's state), as ``test_parity.py``
  runs it (prompts of mixed lengths, split prefills, queued requests).
* The kernel bodies take the codes in place (no call handed to the plain body) and the decode step is replayed
  from its capture.
* The plain body (decode, encode around the PyTorch op) gives the kernel body's greedy token, and conv states
  within a code step of each other. (Prefix hits and forks with an 8-bit conv state, bit for bit:
  ``tests/engine/test_state_8bit.py``.)
* ``cache_layout()`` and ``hybridserve plan --json`` count codes and exponents to the byte
  (``tests/engine/test_state_8bit.py``).
"""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.kernels import fallbacks
from tests.checkpoints import make
from tests.engine.test_state_8bit import assert_hf_parity
from tests.prefix_utils import released_everything

#: family -> whether it has a temporal state (then int8 too in these tests)
FAMILIES = {"mamba2": True, "bamba": True, "mamba": True, "falcon_mamba": True, "jamba": True,
            "granitemoehybrid": True, "nemotron_h": True, "zamba2": True, "falcon_h1": True, "qwen3_next": True,
            "qwen3_5": True, "qwen3_5_moe": True, "olmo_hybrid": True, "kimi_linear": True, "lfm2": False,
            "lfm2_moe": False, "lfm3": False}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def _llm(path: str, family: str, **options) -> LLM:
    opts = {"max_num_batched_tokens": 20, "max_num_seqs": 3, "cache_memory": "16MiB", "enable_progress_bar": False,
            **options}
    if FAMILIES[family]:
        opts.setdefault("mamba_ssm_cache_dtype", "int8")
    return LLM(path, mamba_cache_dtype="int8", **opts)


def _conv_views(llm: LLM) -> list[CodedConvState]:
    return [v for c in llm.engine.pool.layer_caches.values() if c.state for v in c.state.values()
            if isinstance(v, CodedConvState)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eight_bit_conv_state_matches_hf_under_the_near_tie_rule(ckpt_dir, family, record_property):
    path = make(ckpt_dir, family)
    llm = _llm(path, family)
    assert _conv_views(llm), "the pool holds 8-bit conv codes"
    assert_hf_parity(llm, path, record_property)


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
def test_the_plain_and_kernel_bodies_store_the_same_conv_state(ckpt_dir, family):
    """One prompt through the plain bodies (decode, PyTorch op, encode) and through the kernel bodies: the same
    greedy token, and conv states that decode within one code step of each other channel by channel (the two
    paths' float sums differ in their last bits, which can move a code across a rounding boundary)."""
    path = make(ckpt_dir, family)
    tokens, states = {}, {}
    for kernels in (False, True):
        llm = _llm(path, family, cpu_kernels=kernels, enforce_eager=True, enable_prefix_caching=False)
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        tokens[kernels] = out[0].outputs[0].token_ids
        slot = torch.tensor([0])  # the request's slot (the lowest free one), its bytes left as the request ended
        states[kernels] = [(v.read(slot)[0], torch.pow(2.0, v.scale[0].float())) for v in _conv_views(llm)]
        assert released_everything(llm.engine)
    assert tokens[False] == tokens[True]
    for (plain, step), (kernel, _) in zip(states[False], states[True]):
        assert plain.abs().sum() > 0, "the request wrote the slot"
        assert ((plain - kernel).abs() <= step[:, None] * 1.0001 + 1e-30).all()


def test_fp8_conv_state_is_refused_naming_the_allowed_values():
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError, match=r"mamba_cache_dtype='fp8_e4m3'.*auto, float32, bfloat16, float16, int8"):
        EngineConfig(model="x", mamba_cache_dtype="fp8_e4m3")
