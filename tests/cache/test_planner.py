"""`hybridserve plan` against a real engine on a tiny checkpoint.

The planner reads config.json alone (a directory holding nothing else); the capacity it reports is
the number of max-model-len sequences that actually run together before the engine preempts: that
many run without a preemption, one more forces one.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints.cli import main
from tests.checkpoints import make
from tests.prefix_utils import released_everything

MAX_MODEL_LEN = 40  # 39 tokens computed (the last sampled token is never fed back): 3 pages of 16 either way
PROMPT_LEN = 8


def _plan(capsys, config_dir: str, cache_memory: int, options: dict[str, str]) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    assert main(["plan", config_dir, "--json", f"--cache-memory={cache_memory}",
                 f"--max-model-len={MAX_MODEL_LEN}", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def _run(llm: LLM, n: int) -> tuple[int, int]:
    """Run ``n`` sequences of max_model_len tokens; return (preemptions, most sequences running at once)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(n)
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - PROMPT_LEN, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{n}-{i}", torch.randint(3, 128, (PROMPT_LEN,), generator=g).tolist(), params)
    before, peak, done = engine.scheduler.num_preemptions, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - PROMPT_LEN
                done += 1
        peak = max(peak, len(engine.scheduler.running))
    assert done == n and released_everything(engine)
    return engine.scheduler.num_preemptions - before, peak


@pytest.mark.parametrize("family,options,spare_pages", [
    ("bamba", {}, 1),  # room for 4 sequences with less than one page to spare ...
    ("bamba", {}, -1),  # ... and one page short of that: 3
    ("bamba", {"kv_cache_dtype": "fp8_e4m3", "mamba_ssm_cache_dtype": "float32"}, 1),
    ("llama", {}, 1),
])
def test_planned_capacity_is_what_fits_before_preemption(ckpt_dir, tmp_path, capsys, family, options, spare_pages):
    path = make(ckpt_dir, family)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(f"{path}/config.json", config_only / "config.json")  # no weights, no tokenizer

    probe = _plan(capsys, str(config_only), 1 << 30, options)
    per_seq = probe["bytes_per_sequence"]
    assert per_seq == probe["slot_bytes"] + 3 * probe["page_bytes"]
    cache_memory = 4 * per_seq + spare_pages * probe["page_bytes"]
    plan = _plan(capsys, str(config_only), cache_memory, options)
    capacity = plan["max_concurrent_sequences"]
    assert capacity == (4 if spare_pages >= 0 else 3)
    llm = LLM(path, cache_memory=cache_memory, max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **options)
    layout = llm.cache_layout()
    assert layout["layers"] == plan["layers"]  # one format, the same figures
    for key in ("attention_block_size", "state_bytes_per_sequence", "kv_bytes_per_token", "page_bytes",
                "slot_bytes", "num_pages", "num_slots", "max_concurrent_sequences",
                "dtype", "kv_cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        assert layout[key] == plan[key], key
    preemptions, peak = _run(llm, capacity)
    assert preemptions == 0 and peak == capacity, "the planned capacity runs together without preemption"
    preemptions, peak = _run(llm, capacity + 1)
    # one more does not fit: the engine preempts, or (when even its first page and slot do not fit) queues it
    assert preemptions > 0 or peak <= capacity


def test_captured_decode_costs_no_sequence(ckpt_dir, tmp_path, capsys):
    """A pool of 40 sequences and a page, with captured decode steps: their padded rows hold no page and no
    slot, so plan and engine both count all 40, and 40 run together without preemption."""
    path = make(ckpt_dir, "bamba")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(f"{path}/config.json", config_only / "config.json")
    probe = _plan(capsys, str(config_only), 1 << 30, {})
    per_seq = probe["bytes_per_sequence"]
    cache_memory = 40 * per_seq + probe["page_bytes"]  # 40 sequences and a page: not room for a page and a slot more
    plan = _plan(capsys, str(config_only), cache_memory, {})
    assert plan["max_concurrent_sequences"] == 40
    llm = LLM(path, cache_memory=cache_memory, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    layout = llm.cache_layout()
    if llm.engine.runner.captured_decode is None:
        pytest.skip(f"decode not captured here ({llm.engine.cpu_fast_paths.decode_reason})")
    assert layout["max_concurrent_sequences"] == plan["max_concurrent_sequences"]
    preemptions, peak = _run(llm, 40)
    assert preemptions == 0 and peak == 40
    assert main(["plan", str(config_only), "--json", f"--cache-memory={cache_memory}",
                 f"--max-model-len={MAX_MODEL_LEN}", "--enforce-eager"]) == 0
    no_capture = json.loads(capsys.readouterr().out)
    assert no_capture["max_concurrent_sequences"] == 40  # the same with or without capture


def test_plan_human_output_and_alternatives(ckpt_dir, capsys):
    path = make(ckpt_dir, "bamba")
    assert main(["plan", path, "--cache-memory", "64MiB", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    for text in ("Cached tensors per layer", "mamba2", "attention", "ssm", "conv", "state bytes per sequence",
                 "KV bytes per token", "attention block size", "max concurrent sequences", "all auto",
                 "fp32 state", "fp8 KV", "int8 state"):
        assert text in out, text
    plan = _plan(capsys, path, 64 << 20, {"dtype": "bfloat16"})
    by_label = {a["label"]: a for a in plan["alternatives"]}
    assert set(by_label) == {"all auto", "fp32 state", "fp8 KV, fp32 state", "int8 state"}
    auto, fp32, fp8 = by_label["all auto"], by_label["fp32 state"], by_label["fp8 KV, fp32 state"]
    coded = by_label["int8 state"]
    assert coded["mamba_cache_dtype"] == coded["mamba_ssm_cache_dtype"] == "int8"
    assert coded["state_bytes_per_sequence"] * 3 < auto["state_bytes_per_sequence"]  # float32 state: 4x, less scales
    assert coded["max_concurrent_sequences"] >= plan["max_concurrent_sequences"]
    assert auto["mamba_ssm_cache_dtype"] == "float32"  # the checkpoint is float32: auto follows it
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and fp8["kv_bytes_per_token"] * 4 == auto["kv_bytes_per_token"]
    assert fp32["state_bytes_per_sequence"] == auto["state_bytes_per_sequence"]
    assert plan["state_bytes_per_sequence"] < fp32["state_bytes_per_sequence"]  # bf16 state vs float32
    entry = next(e for e in plan["layers"] if e["kind"] == "attention")
    assert [t["name"] for t in entry["tensors"]] == ["k", "v"] and entry["tensors"][0]["per"] == "token"


def test_plan_rejects_bad_input(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path), "--kv-cache-dtype", "int4"])
