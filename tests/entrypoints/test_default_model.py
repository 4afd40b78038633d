"""The shipped default model: loads in HF transformers, hybridserve matches it, the CLI prints English."""

import re
import subprocess
import sys

from hybridserve import LLM, SamplingParams
from hybridserve.default_model import default_model_path
from tests.hf_reference import compare, hf_greedy

PROMPT = "Once upon a time"


def test_default_model_matches_hf():
    path = default_model_path()
    llm = LLM(cache_memory="64MiB")  # no model named: the shipped one
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in (PROMPT, "It is a truth universally acknowledged", "She said")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True))
    refs = hf_greedy(path, prompts, 24)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= 36, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3


def test_cli_without_model_prints_english():
    out = subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "generate", PROMPT,
                          "--max-tokens", "40"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(PROMPT)
    words = re.findall(r"[A-Za-z]+", text[len(PROMPT):].lower())
    common = {"the", "a", "and", "of", "to", "i", "in", "was", "he", "she", "it", "that", "be", "her", "his",
              "not", "is", "you", "with", "for", "as", "had", "have", "my", "but", "at", "so", "very", "all"}
    assert len(words) >= 10
    assert sum(w in common for w in words) >= 4, text
