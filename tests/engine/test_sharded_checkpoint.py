"""A checkpoint saved in shards (``save_pretrained(max_shard_size=...)``: ``model.safetensors.index.json`` and
several files) loads through the index and generates exactly what the single-file checkpoint does."""

from __future__ import annotations

import glob
import json
import os

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make


def test_a_sharded_checkpoint_generates_as_the_single_file_one(ckpt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    single = make(ckpt_dir, "bamba")
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(single, dtype="float32").save_pretrained(sharded, max_shard_size="100KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2 and not os.path.exists(os.path.join(sharded, "model.safetensors"))
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) == len(shards)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2, 40]}, {"prompt_token_ids": list(range(3, 30))}]
    want = LLM(single, cache_memory="8MiB", enable_progress_bar=False).generate(prompts, params)
    got = LLM(sharded, cache_memory="8MiB", enable_progress_bar=False).generate(prompts, params)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in a.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in e.items()} for e in b.outputs[0].logprobs]
