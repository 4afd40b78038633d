"""GGUF checkpoints (models/gguf/): tiny random checkpoints written to GGUF as llama.cpp's converter writes them
(tests/gguf/gguf_writer.py) load through the real loader and generate what the safetensors checkpoint does."""

import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.kernels import isa, linear_w4, linear_w6k  # noqa: E402
from hybridserve.layers.linear_w4 import W4Linear  # noqa: E402
from hybridserve.layers.linear_w6k import W6KLinear  # noqa: E402
from hybridserve.layers.linear_w8 import W8Linear  # noqa: E402
from hybridserve.models.loader import load_hf_config  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.gguf.gguf_writer import GGUF_ARCH, write_gguf  # noqa: E402
from tests.layers.test_int8_weights import compare_near_tie  # noqa: E402

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)
PROMPTS = [[5, 9, 33, 4, 7], list(range(3, 22))]


def _run(path: str, **options):
    llm = LLM(path, cache_memory="16MiB", max_num_seqs=2, enable_progress_bar=False, **options)
    return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


#: Falcon-H1's muP multipliers are folded into its weights by llama.cpp's converter (and the fixture), which moves
#: float32 logprobs by a few 1e-6; every other family's are bit-identical
LOGPROB_TOLERANCE = {"falcon_h1": 1e-4}
#: llama.cpp writes no ``topk_group`` (it routes over all groups): one group, so that HF's routing is the same
#: llama.cpp's Qwen3-Next has no dense MLP layers (``mlp_only_layers``)
#: llama.cpp's LFM2-MoE has no output tensor (the LM head is the embedding)
OVERRIDES = {"nemotron_h": {"n_group": 1, "topk_group": 1}, "qwen3_next": {"mlp_only_layers": []},
             "lfm2_moe": {"tie_word_embeddings": True},
             "nemotron_h_dense": {"hybrid_override_pattern": "M*-M-", "n_group": 1, "topk_group": 1}}


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("mamba", torch.float32),
                                          ("mamba2", torch.float32), ("granitemoehybrid_dense", torch.float32),
                                          ("nemotron_h", torch.float32), ("nemotron_h_dense", torch.float32),
                                          ("granitemoehybrid", torch.float32), ("falcon_h1", torch.float32),
                                          ("lfm2", torch.float32), ("jamba", torch.float32),
                                          ("qwen3_next", torch.float32), ("qwen3_5", torch.float32),
                                          ("qwen3_5_moe", torch.float32), ("lfm2_moe", torch.float32),
                                          ("bamba", torch.float32), ("qwen3_5", torch.bfloat16),
                                          ("lfm2_moe", torch.bfloat16), ("bamba", torch.bfloat16),
                                          ("mamba2", torch.bfloat16), ("granitemoehybrid_dense", torch.bfloat16),
                                          ("nemotron_h", torch.bfloat16), ("lfm2", torch.bfloat16)])
def test_float_gguf_gives_the_safetensors_greedy_tokens(tmp_path, family, dtype):
    path = checkpoints.make(str(tmp_path), family.removesuffix("_dense"), dtype=dtype, **OVERRIDES.get(family, {}))
    kind = "F32" if dtype == torch.float32 else "BF16"
    file = write_gguf(path, str(tmp_path / f"model-{kind}.gguf"), kind)
    assert str(load_hf_config(file).dtype).removeprefix("torch.") == str(dtype).removeprefix("torch.")
    _, reference = _run(path)
    _, run = _run(file)
    tolerance = LOGPROB_TOLERANCE.get(family, 0.0)
    for a, b in zip(reference, run):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert set(la) == set(lb)
            assert all(abs(x.logprob - lb[t].logprob) <= tolerance for t, x in la.items())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_multi_token_prediction_layers_in_the_file_are_skipped(tmp_path, family):
    """llama.cpp's converter appends a checkpoint's MTP layers as extra blocks (``nextn_predict_layers``): the file
    loads without them and generates what the checkpoint does."""
    base = checkpoints.make(str(tmp_path), family, **OVERRIDES.get(family, {}))
    path = checkpoints.add_mtp_weights(base, num_layers=1)
    file = write_gguf(path, str(tmp_path / "model-mtp.gguf"))
    assert gguf.GGUFReader(file).fields[f"{GGUF_ARCH[family if family == 'qwen3_next' else 'qwen3_5_text']}"
                                        ".nextn_predict_layers"].contents() == 1
    config = load_hf_config(file)
    assert config.num_hidden_layers == 4 and len(config.layer_types) == 4
    _, reference = _run(base)
    _, run = _run(file)
    for a, b in zip(reference, run):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(x.logprob == lb[t].logprob for t, x in la.items())


def _dequantized_twin(file: str, out: str) -> str:
    """The same GGUF file with every block tensor replaced by gguf's own dequantization of it (F32): every block
    type the engine keeps coded holds its values exactly (Q4_K's scales and mins sub-scaled, ``docs/gguf.md``)."""
    r = gguf.GGUFReader(file)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A llama checkpoint whose linears have 256 in-features (one k-quant super-block)."""
    path = str(tmp_path_factory.mktemp("gguf") / "llama-256")
    checkpoints.build(checkpoints.llama_config(hidden_size=256), path, std=0.03, dtype=torch.bfloat16)
    return path


def _on_int8_activations(layer) -> bool:
    """Whether the quantized layers' few-row float32 calls quantize their activations here (W4A8, Q6_K's int8
    path: the avx2 level and above)."""
    if layer is W4Linear:
        return linear_w4.path(1, torch.float32) == linear_w4.W4A8_PATH
    return layer is W6KLinear and linear_w6k.path(1, torch.float32) == linear_w6k.A8_PATH


@pytest.mark.parametrize("kind,layer", [("Q8_0", W8Linear), ("Q6_K", W6KLinear), ("Q5_0", W8Linear),
                                        ("Q4_0", W4Linear), ("Q4_K", W4Linear),
                                        ("Q5_1", None)])
def test_quantized_gguf_runs_quantized_and_equals_its_dequantized_weights(tmp_path, wide_llama, kind, layer):
    """The 4-bit and Q6_K layers' few-row calls run on int8 activations from the avx2 level on (W4A8, Q6_K's int8
    path): there the greedy tokens keep the near-tie rule against the twin's, and the logprob comparison runs at
    the generic level (activations as they are). Q6_K covers the untied ``output.weight`` too."""
    file = write_gguf(wide_llama, str(tmp_path / f"model-{kind}.gguf"), kind)
    twin = _dequantized_twin(file, str(tmp_path / "twin.gguf"))
    _, reference = _run(twin, dtype="float32")
    options = {}
    if _on_int8_activations(layer):
        _, w4a8 = _run(file, dtype="float32")
        _, steps = compare_near_tie(w4a8, reference)  # tokens equal up to a near-tie of the reference
        assert steps > 0
        options = {"cpu_isa": "generic"}
    previous = isa.cap()
    try:
        llm, run = _run(file, dtype="float32", **options)
    finally:
        isa.set_cap(previous)
    model = llm.engine.model
    if layer is None:  # a type read dequantized: no quantized layer at all
        assert not any(isinstance(m, (W8Linear, W4Linear)) for m in model.modules())
    else:
        assert sum(isinstance(m, layer) for m in model.modules()) >= 3 * 4  # q, k, v, o (or more) of 3 layers
    if layer is W6KLinear:
        assert isinstance(model.lm_head, W6KLinear)  # the file's output.weight
    for a, b in zip(reference, run):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            for t, x in la.items():
                assert abs(x.logprob - lb[t].logprob) < 2e-3


def test_tied_q6_k_embedding_gives_a_6_bit_lm_head(tmp_path):
    """A tied checkpoint whose ``token_embd`` is Q6_K (as in llama.cpp's Q4_K_M files): the LM head is a W6KLinear
    over the file's blocks (no bf16 copy of the embedding packed for it), the embedding lookup reads the
    dequantized table, and the tokens are the dequantized twin's (the near-tie rule on int8 activations; logprobs
    within 2e-3 at the generic level)."""
    path = str(tmp_path / "llama-tied")
    checkpoints.build(checkpoints.llama_config(hidden_size=256, tie_word_embeddings=True), path, std=0.03,
                      dtype=torch.bfloat16)
    file = write_gguf(path, str(tmp_path / "model-Q6_K.gguf"), "Q6_K", quantize_embeddings=True)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(file).tensors}
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    twin = _dequantized_twin(file, str(tmp_path / "twin.gguf"))
    _, reference = _run(twin, dtype="float32")
    if _on_int8_activations(W6KLinear):
        _, int8_run = _run(file, dtype="float32")
        _, steps = compare_near_tie(int8_run, reference)
        assert steps > 0
    previous = isa.cap()
    try:
        llm, run = _run(file, dtype="float32", cpu_isa="generic")
    finally:
        isa.set_cap(previous)
    model = llm.engine.model
    assert isinstance(model.lm_head, W6KLinear) and not hasattr(model.lm_head, "weight")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for a, b in zip(reference, run):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(x.logprob - lb[t].logprob) < 2e-3 for t, x in la.items())


def test_q6_k_linears_are_dequantized_without_the_cpu_kernels(tmp_path):
    """With --no-cpu-kernels a Q6_K file's linears become plain linears over their dequantized weights at start
    (no call dequantizes again) and the tied LM head is the embedding again: the dequantized twin's tokens."""
    path = str(tmp_path / "llama-tied")
    checkpoints.build(checkpoints.llama_config(hidden_size=256, tie_word_embeddings=True), path, std=0.03,
                      dtype=torch.bfloat16)
    file = write_gguf(path, str(tmp_path / "model-Q6_K.gguf"), "Q6_K", quantize_embeddings=True)
    twin = _dequantized_twin(file, str(tmp_path / "twin.gguf"))
    _, reference = _run(twin, dtype="float32", cpu_kernels=False)
    llm, plain = _run(file, dtype="float32", cpu_kernels=False)
    model = llm.engine.model
    assert not any(isinstance(m, W6KLinear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for a, b in zip(reference, plain):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(x.logprob - lb[t].logprob) < 2e-3 for t, x in la.items())


def test_env_names_the_q6_k_kernel(tmp_path, capsys):
    """``hybridserve env --model`` counts a Q6_K file's 6-bit linears and names their kernel's paths."""
    import json

    from hybridserve.entrypoints.cli import main

    path = str(tmp_path / "llama")
    checkpoints.build(checkpoints.llama_config(hidden_size=256), path, std=0.03, dtype=torch.bfloat16)
    file = write_gguf(path, str(tmp_path / "model-Q6_K.gguf"), "Q6_K")
    assert main(["env", "--json", "--model", file]) == 0
    report = json.loads(capsys.readouterr().out)
    q6k = report["model"]["weights"]["q6_k"]
    # q, k, v, o, gate, up of 3 layers (down's 96 in-features are no whole super-block: F32), and the LM head
    assert q6k["linears"] == 3 * 6 + 1
    assert q6k["kernel"] == report["kernels"]["ops"]["linear_w6k"]["variant"]


def test_8bit_gguf_weights_are_dequantized_without_the_cpu_kernels(tmp_path, wide_llama):
    """With --no-cpu-kernels the int8 codes of a Q8_0 file are dequantized at start (no W8Linear), same output."""
    file = write_gguf(wide_llama, str(tmp_path / "model-Q8_0.gguf"), "Q8_0")
    _, kernels = _run(file, dtype="float32")
    llm, plain = _run(file, dtype="float32", cpu_kernels=False)
    assert not any(isinstance(m, W8Linear) for m in llm.engine.model.modules())
    for a, b in zip(kernels, plain):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(x.logprob - lb[t].logprob) < 2e-3 for t, x in la.items())


@pytest.mark.parametrize("family", ["nemotron_h", "lfm2_moe", "qwen3_5_moe"])
def test_quantized_experts_are_read_dequantized(tmp_path, family):
    """A MoE file's Q8_0 expert blocks (3-D) load dequantized, its other linears stay 8-bit (Qwen3.5's with their
    value heads regrouped on the int8 codes, its out_proj columns on the dequantized weight)."""
    path = checkpoints.make(str(tmp_path), family, **OVERRIDES.get(family, {}))
    file = write_gguf(path, str(tmp_path / "model-Q8_0.gguf"), "Q8_0")
    twin = _dequantized_twin(file, str(tmp_path / "twin.gguf"))
    llm, run = _run(file, dtype="float32")
    assert any(isinstance(m, W8Linear) for m in llm.engine.model.modules())
    _, reference = _run(twin, dtype="float32")
    for a, b in zip(reference, run):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(x.logprob - lb[t].logprob) < 2e-3 for t, x in la.items())


def _one_line_error(path: str, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
    return message


def test_unsupported_tensor_type_is_refused_naming_it(tmp_path):
    path = checkpoints.make(str(tmp_path), "llama")
    file = write_gguf(path, str(tmp_path / "model.gguf"), "MXFP4")
    _one_line_error(file, file, "MXFP4", "tensor output.weight",
                    "supported: F32, F16, BF16, Q4_0, Q4_K, Q5_0, Q6_K, Q8_0, Q4_1, Q5_1, Q5_K")


def test_unknown_architecture_is_refused_naming_it(tmp_path):
    file = str(tmp_path / "bert.gguf")
    w = gguf.GGUFWriter(file, "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(file, file, "'bert' is not supported", "granitehybrid")


def test_truncated_file_is_refused(tmp_path):
    path = checkpoints.make(str(tmp_path), "mamba2")
    file = write_gguf(path, str(tmp_path / "model.gguf"))
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 1000)
    _one_line_error(file, file, "not a readable GGUF file")


def test_folder_holding_one_gguf_loads_and_two_are_refused(tmp_path):
    path = checkpoints.make(str(tmp_path), "mamba2")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_gguf(path, str(folder / "model.gguf"))
    assert load_hf_config(str(folder)).model_type == "mamba2"
    shutil.copy(folder / "model.gguf", folder / "other.gguf")
    _one_line_error(str(folder), "several GGUF files", "model.gguf, other.gguf")


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from tokenizers import Tokenizer

    from hybridserve.engine.detokenizer import Detokenizer

    base = os.path.join(os.path.dirname(__file__), "..", "..", "hybridserve", "default_model", "tokenizer.json")
    reference = Tokenizer.from_file(base)
    vocab = reference.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    with open(base) as f:
        merges = [m if isinstance(m, str) else " ".join(m) for m in json.load(f)["model"]["merges"]]
    file = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(file, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * len(tokens))
    w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    detok = Detokenizer.from_path(file)
    text = "Hello world, GGUF tokenizers: 123 ok!"
    assert detok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    rendered = detok.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<user>hi"
