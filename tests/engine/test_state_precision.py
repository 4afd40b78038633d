"""The stored state dtype is real and it matters.

* float32 model on the PyTorch paths (``cpu_kernels=False``): the state dtype is the only source of
  error. Over a long greedy decode (a 520-token prompt, 520 generated), float32 SSM state stays with
  HF float32 (at least 50 tokens, within 1e-4) while bfloat16 state is at least 10x further off on the
  same steps. A family without a temporal state (LFM2: short conv only) gets the same test on its conv
  state, through ``mamba_cache_dtype``. With the CPU kernels on (the default), float32 linears sum in
  another order than torch's, a second source of error of about 1e-6; float32 state then stays within
  the same 1e-4 of HF.

  Every run is another numerical path than HF's, so each is held to the near-tie rule (``compare``):
  where its greedy token differs from HF's, each side's token must be in the other's top 5, and the
  comparison stops there. bfloat16 state moves logprobs by ~1e-2, enough to flip a near tie of a random
  model, and which one flips first depends on the CPU (its float32 sums run in another order): on an
  Intel AVX-512/AMX CPU the xLSTM run parts from HF at token 31 at every ISA cap (HF's top two 0.047
  apart, ours 0.003 apart and swapped), where the CPUs the test was written on kept 50. So the bfloat16
  run's error is measured on the steps before its own divergence, and the float32 runs' on those same
  steps (xLSTM there: 1.3e-2 against 1.2e-6).
* bf16 model with float32 SSM state: the layout and the pool's real tensors say float32 SSM state
  and bf16 conv state and KV; both state dtypes' errors against HF float32 are reported.
"""

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything

# family -> (temporal state tensor names, conv state tensor names)
FAMILIES = {
    "zamba2": (("ssm",), ("conv",)),
    "falcon_h1": (("ssm",), ("conv",)),
    "mamba2": (("ssm",), ("conv",)),
    "bamba": (("ssm",), ("conv",)),
    "mamba": (("ssm",), ("conv",)),
    "falcon_mamba": (("ssm",), ("conv",)),
    "jamba": (("ssm",), ("conv",)),
    "qwen3_next": (("recurrent",), ("conv",)),
    "qwen3_5": (("recurrent",), ("conv",)),
    "qwen3_5_moe": (("recurrent",), ("conv",)),
    "olmo_hybrid": (("recurrent",), ("conv",)),
    "kimi_linear": (("recurrent",), ("conv",)),  # KDA layers; the MLA latent is KV
    "xlstm": (("C", "n", "m"), ()),  # matrix memory, normalizer and max state: all temporal; no conv state
    "granitemoehybrid": (("ssm",), ("conv",)),
    "nemotron_h": (("ssm",), ("conv",)),
    "minimax": (("kv_state",), ()),
    "lfm2": ((), ("conv",)),  # no temporal state: its conv state is the one tested (see below)
    "lfm2_moe": ((), ("conv",)),
    "lfm3": ((), ("conv",)),
}
PROMPT_LEN = 520
NEW_TOKENS = 520


def _long_prompt(vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()


def _run(path: str, prompt: list[int], **options) -> tuple[list[int], list[dict]]:
    llm = LLM(path, max_num_batched_tokens=256, cache_memory="64MiB", max_model_len=2048, **options)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))[0]
    assert released_everything(llm.engine)
    return out.outputs[0].token_ids, out.outputs[0].logprobs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dtype_isolated_in_float32_model(ckpt_dir, family):
    temporal, _ = FAMILIES[family]
    option = "mamba_ssm_cache_dtype" if temporal else "mamba_cache_dtype"  # conv state when no temporal one
    path = make(ckpt_dir, family)
    from transformers import AutoConfig

    prompt = _long_prompt(AutoConfig.from_pretrained(path).vocab_size)
    ref = hf_greedy(path, [prompt], NEW_TOKENS)
    runs = {}
    for state_dtype, kernels in (("float32", False), ("bfloat16", False), ("float32", True)):
        toks, lps = _run(path, prompt, cpu_kernels=kernels, **{option: state_dtype})
        runs[state_dtype, kernels] = compare([toks], [lps], ref)  # raises on a divergence that is no near tie
    for kernels in (False, True):
        cmp = runs["float32", kernels]
        assert cmp.compared_tokens >= 50, ("float32", kernels, cmp.diverged_at)
        assert cmp.mean_abs_error <= 1e-4, ("float32", kernels, cmp.mean_abs_error)
    # bf16 state against float32 state on the same steps: those before the bf16 run's near-tie divergence
    steps = runs["bfloat16", False].compared_tokens
    assert steps > 0, ("bfloat16", runs["bfloat16", False].diverged_at)
    errors = {key: sum(cmp.abs_errors[:steps]) / steps for key, cmp in runs.items()}
    assert errors["bfloat16", False] >= 10 * errors["float32", False], (steps, errors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_model_with_float32_state(ckpt_dir, family, record_property):
    temporal, conv = FAMILIES[family]
    path32 = make(ckpt_dir, family)
    path16 = make(ckpt_dir, family, dtype=torch.bfloat16)
    from transformers import AutoConfig

    prompt = _long_prompt(AutoConfig.from_pretrained(path32).vocab_size)[:200]
    ref = hf_greedy(path32, [prompt], 100)
    llm = LLM(path16, mamba_ssm_cache_dtype="float32", cache_memory="32MiB")
    layout = llm.cache_layout()
    assert layout["dtype"] == "bfloat16" and layout["mamba_ssm_cache_dtype"] == "float32"
    assert layout["mamba_cache_dtype"] == "bfloat16" and layout["kv_cache_dtype"] == "bfloat16"
    for entry in layout["layers"]:
        real = llm.engine.pool.layer_caches[entry["index"]]
        for t in entry["tensors"]:
            per_token = t["per"] == "token"  # K/V pages (or MLA's latent pages), else a state slot's tensor
            tensor = getattr(real, t["name"]) if per_token else real.state[t["name"]]
            assert str(tensor.dtype).removeprefix("torch.") == t["dtype"]
            assert list(tensor.shape[1:]) == (t["shape"] if not per_token
                                              else [layout["block_size"], *t["shape"]])
            want = "float32" if t["name"] in temporal else "bfloat16"
            assert t["dtype"] == want, (entry, t)
    report = {}
    for state_dtype in ("float32", "bfloat16"):
        llm = LLM(path16, mamba_ssm_cache_dtype=state_dtype, cache_memory="32MiB")
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=100, logprobs=1, ignore_eos=True))[0]
        toks, lps = out.outputs[0].token_ids, out.outputs[0].logprobs
        agree = next((i for i, (a, b) in enumerate(zip(toks, ref[0].tokens)) if a != b), len(toks))
        err = sum(abs(lps[i][toks[i]].logprob - float(ref[0].logprobs[i][toks[i]])) for i in range(agree))
        report[state_dtype] = {"agreeing_tokens": agree, "mean_abs_logprob_error": err / max(agree, 1)}
    record_property("bf16_model_state_errors", report)
    print(f"\n{family} bf16 model vs HF float32: {report}")
