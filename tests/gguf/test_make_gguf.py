"""benchmarks/make_gguf.py's staging: what llama.cpp's converter is given for Jamba, Bamba and a vision-language
checkpoint (the converter itself runs in benchmarks/gguf_accuracy.py, not here)."""

import json

import pytest

from tests.gguf.benchmark_script import load_benchmark

tokenizers = pytest.importorskip("tokenizers")


def _make_gguf():
    return load_benchmark("make_gguf")


def _staged(tmp_path, config: dict) -> dict:
    """The tokenizer.json that ``stage`` writes for a checkpoint with ``config``."""
    make_gguf = _make_gguf()
    model, staged = tmp_path / "model", tmp_path / "staged"
    model.mkdir(parents=True)
    staged.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    make_gguf.stage(str(model), str(staged), make_gguf.BASE_TOKENIZER)
    return json.loads((staged / "tokenizer.json").read_text())


def test_jamba_tokenizer_is_staged_as_a_llama_bpe_that_tokenizes_the_same(tmp_path):
    """The converter's Llama-HF vocab reader needs byte fallback and a Sequence decoder; the ids do not change."""
    jamba = _staged(tmp_path / "jamba", {"model_type": "jamba", "vocab_size": 4200})
    plain = _staged(tmp_path / "plain", {"model_type": "mamba2", "vocab_size": 4200})
    assert jamba["model"]["byte_fallback"] is True and jamba["decoder"]["type"] == "Sequence"
    assert plain["decoder"]["type"] != "Sequence"
    text = "Hello world, GGUF tokenizers: 123 ok! \u00e9t\u00e9"
    as_llama, as_plain = (tokenizers.Tokenizer.from_str(json.dumps(t)) for t in (jamba, plain))
    assert as_llama.encode(text).ids == as_plain.encode(text).ids
    assert as_llama.get_vocab_size() == 4200
    assert as_llama.decode(as_llama.encode(text).ids) == as_plain.decode(as_plain.encode(text).ids)


def test_bamba_config_gets_the_rotary_size_the_converter_reads():
    make_gguf = _make_gguf()
    bamba = {"model_type": "bamba", "hidden_size": 256, "num_attention_heads": 4,
             "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    assert make_gguf.converter_config(bamba)["attn_rotary_emb"] == 32
    assert make_gguf.converter_config({**bamba, "attn_rotary_emb": 64})["attn_rotary_emb"] == 64
    assert "attn_rotary_emb" not in make_gguf.converter_config({**bamba, "model_type": "granitemoehybrid"})


def test_vision_language_checkpoint_takes_its_vocab_from_text_config(tmp_path):
    tok = _staged(tmp_path, {"model_type": "qwen3_5", "text_config": {"vocab_size": 4150}})
    assert tokenizers.Tokenizer.from_str(json.dumps(tok)).get_vocab_size() == 4150


def test_dense_granite_hybrid_is_staged_with_no_experts_used():
    """llama.cpp aborts on expert_used_count > expert_count: the converter copies num_experts_per_tok (2 by
    transformers' default) beside expert_count 0, so a dense Granite hybrid is staged with 0 experts used."""
    from transformers import GraniteMoeHybridConfig

    make_gguf = _make_gguf()
    dense = GraniteMoeHybridConfig(num_local_experts=0).to_dict()
    assert dense["num_experts_per_tok"] == 2  # transformers' default, what the converter would write
    assert make_gguf.converter_config(dense)["num_experts_per_tok"] == 0
    moe = GraniteMoeHybridConfig(num_local_experts=4, num_experts_per_tok=2).to_dict()
    assert make_gguf.converter_config(moe)["num_experts_per_tok"] == 2
    bamba = {"model_type": "bamba", "hidden_size": 256, "num_attention_heads": 4, "num_experts_per_tok": 2}
    assert make_gguf.converter_config(bamba)["num_experts_per_tok"] == 2
