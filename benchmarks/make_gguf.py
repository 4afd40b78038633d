"""Convert a benchmark checkpoint (make_bench_model.py) to GGUF, so llama.cpp can run it as a peer.

The checkpoint has no tokenizer, and llama.cpp's converter needs one whose size is the model's vocab.
This script gives it one: the shipped model's byte-level BPE tokenizer (hybridserve/default_model),
grown with extra merges to exactly ``vocab_size`` tokens. The converter recognises a BPE
pre-tokenizer by hashing its output on a test string; the grown tokenizer's hash is unknown to it,
so it is mapped to ``--pre`` (default ``gpt-2``: the byte-level GPT-2 split, which is what that
tokenizer uses). The converter also reads ``layer_types`` as "mamba"/"attention" (the names of the
published Granite-4.0-H configs), whereas transformers now writes "linear_attention"/"full_attention";
a dense Granite hybrid (no experts) is staged with ``num_experts_per_tok`` 0, since the converter writes it as
llama.cpp's ``expert_used_count`` and llama.cpp refuses a count above ``expert_count`` (0). A staged copy of the
checkpoint (links to the weights, a rewritten config.json, the tokenizer files)
is what gets converted, so the checkpoint folder itself only gains the GGUF files. The converter reads a
Jamba checkpoint's tokenizer only as a Llama one (sentencepiece, or a BPE with byte fallback and a
``Sequence`` decoder): for Jamba the grown tokenizer is staged in that form (byte fallback on, its
byte-level decoder inside a ``Sequence``), which tokenizes the same (every byte is in its vocab).
Converting a Llama checkpoint needs the ``sentencepiece`` package installed (the converter imports it
before it falls back to the BPE tokenizer).

    python benchmarks/make_gguf.py /tmp/bench-granite-100m --llama-cpp /work/llama.cpp --outtype bf16 f32

writes /tmp/bench-granite-100m/model-bf16.gguf and model-f32.gguf. Run it with a Python that has
torch, transformers, tokenizers and numpy (the converter's own needs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_TOKENIZER = os.path.join(REPO, "hybridserve", "default_model", "tokenizer.json")
# the converter's names for the layer kinds, from the names transformers writes now
LAYER_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}
# families whose converter reads the tokenizer only as a Llama one (see the module docstring)
LLAMA_VOCAB_FAMILIES = {"jamba"}
# experts per token written for a Granite hybrid without experts: the converter copies num_experts_per_tok
# (transformers' default 2) to expert_used_count beside expert_count 0, and llama.cpp's loader asserts
# expert_used_count <= expert_count, so llama-quantize and every llama.cpp tool abort on such a file
DENSE_GRANITE_EXPERTS_USED = 0


def grow_tokenizer(tok: dict, size: int) -> dict:
    """Add BPE merges to a tokenizer.json dict until its vocab has ``size`` entries.

    Each new token joins two of the most frequent merged tokens (the earliest merges), taken in a
    growing square (pairs among the first k, then k+1, ...), so the result is deterministic and
    every new token is one merge of two tokens already in the vocab. Many of them never come out of
    real text (they span a pre-tokenizer split); the benchmarks feed token ids and do not need them to."""
    model = tok["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = model["merges"]
    if len(vocab) > size:
        raise ValueError(f"base tokenizer has {len(vocab)} tokens, more than the model's {size}")
    as_pairs = bool(merges) and isinstance(merges[0], list)
    frequent = [a + b for a, b in (m if as_pairs else m.split(" ") for m in merges)]
    next_id = max(vocab.values()) + 1

    def add(a: str, b: str) -> None:
        nonlocal next_id
        if len(vocab) < size and a + b not in vocab:
            vocab[a + b] = next_id
            merges.append([a, b] if as_pairs else f"{a} {b}")
            next_id += 1

    for k, newest in enumerate(frequent):
        for older in frequent[:k]:
            add(older, newest)
            add(newest, older)
        add(newest, newest)
        if len(vocab) == size:
            return tok
    raise ValueError(f"could not grow the tokenizer to {size} tokens")


def as_llama_bpe(tok: dict) -> dict:
    """The tokenizer.json dict in the form llama.cpp's Llama-HF vocab reader accepts: byte fallback on, the
    decoder inside a ``Sequence``. Byte-level BPE has every byte in its vocab, so it tokenizes the same."""
    out = dict(tok, model=dict(tok["model"], byte_fallback=True))
    out["decoder"] = {"type": "Sequence", "decoders": [tok["decoder"]] if tok.get("decoder") else []}
    return out


def special_tokens(tok: dict, config: dict) -> dict[str, str]:
    """tokenizer_config.json entries naming the checkpoint's bos/eos/pad ids by their token text."""
    by_id = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    out = {}
    for key in ("bos", "eos", "pad"):
        token_id = config.get(f"{key}_token_id")
        if token_id in by_id:
            out[f"{key}_token"] = by_id[token_id]
    return out


def write_tokenizer(folder: str, config: dict, base: str) -> int:
    """Write tokenizer.json and tokenizer_config.json for ``config``'s vocab into ``folder``; return the
    vocab size, checked by loading the result with the tokenizers library."""
    from tokenizers import Tokenizer

    with open(base) as f:
        tok = grow_tokenizer(json.load(f), config["vocab_size"])
    if config.get("model_type") in LLAMA_VOCAB_FAMILIES:
        tok = as_llama_bpe(tok)
    text = json.dumps(tok, ensure_ascii=False)
    size = Tokenizer.from_str(text).get_vocab_size()
    if size != config["vocab_size"]:
        raise ValueError(f"grown tokenizer has {size} tokens, the model {config['vocab_size']}")
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                   "clean_up_tokenization_spaces": False, **special_tokens(tok, config)}, f, indent=2)
    return size


def converter_config(config: dict) -> dict:
    """The checkpoint's config with ``layer_types`` in the converter's names; for Bamba, the rotary size
    ``attn_rotary_emb`` that the published Bamba configs carry (the converter writes RoPE's size only from it;
    transformers now keeps it as ``partial_rotary_factor``); for a dense Granite hybrid, ``num_experts_per_tok``
    0 (``DENSE_GRANITE_EXPERTS_USED``)."""
    out = dict(config)
    if "layer_types" in out:
        out["layer_types"] = [LAYER_KINDS.get(kind, kind) for kind in out["layer_types"]]
    if out.get("model_type") == "granitemoehybrid" and not out.get("num_local_experts"):
        out["num_experts_per_tok"] = DENSE_GRANITE_EXPERTS_USED
    if out.get("model_type") == "bamba" and "attn_rotary_emb" not in out:
        head_dim = out["hidden_size"] // out["num_attention_heads"]
        factor = (out.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        out["attn_rotary_emb"] = int(head_dim * factor)
    return out


def stage(model: str, folder: str, base_tokenizer: str) -> int:
    """Fill ``folder`` with what the converter reads: links to the checkpoint's files, a rewritten
    config.json and the tokenizer files. Returns the tokenizer's size."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    for name in os.listdir(model):
        if name.endswith((".safetensors", ".safetensors.index.json")) or name == "generation_config.json":
            os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(folder, name))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(converter_config(config), f, indent=2)
    # a vision-language checkpoint keeps the text model's vocab and special tokens in text_config
    text = {**config.get("text_config", {}), **{k: v for k, v in config.items() if k != "text_config"}}
    return write_tokenizer(folder, text, base_tokenizer)


def load_converter(llama_cpp: str, pre: str):
    """Import llama.cpp's convert_hf_to_gguf from ``llama_cpp`` (the source folder) with the BPE
    pre-tokenizer check falling back to ``pre`` for a hash it does not know; return its main()."""
    sys.path.insert(0, os.path.join(llama_cpp, "gguf-py"))
    sys.path.insert(0, llama_cpp)
    import convert_hf_to_gguf
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"make_gguf: unknown BPE pre-tokenizer hash, written as {pre!r}", file=sys.stderr)
            return pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    return convert_hf_to_gguf.main


def convert(main, staged: str, outfile: str, outtype: str, name: str, extra: list[str]) -> None:
    """Run the converter's main() on the staged folder, naming the model ``name`` in the GGUF."""
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", staged, "--outfile", outfile, "--outtype", outtype, "--model-name", name,
                *extra]
    try:
        main()
    finally:
        sys.argv = argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (from make_bench_model.py)")
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_SRC", "/work/llama.cpp"),
                        help="llama.cpp source folder (holds convert_hf_to_gguf.py and gguf-py)")
    parser.add_argument("--outtype", nargs="+", default=["bf16", "f32"], choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--out-dir", default=None, help="where model-<outtype>.gguf go (default: the checkpoint)")
    parser.add_argument("--pre", default="gpt-2", help="llama.cpp pre-tokenizer name for an unknown hash")
    parser.add_argument("--base-tokenizer", default=BASE_TOKENIZER, help="tokenizer.json to grow")
    parser.add_argument("--no-mtp", action="store_true",
                        help="pass --no-mtp to the converter (a checkpoint without multi-token-prediction layers, "
                             "such as a Qwen3-Next-like bench model)")
    a = parser.parse_args()
    out_dir = a.out_dir or a.model
    main_fn = load_converter(os.path.abspath(a.llama_cpp), a.pre)
    with tempfile.TemporaryDirectory(prefix="make_gguf-") as staged:
        size = stage(a.model, staged, a.base_tokenizer)
        print(f"make_gguf: tokenizer of {size} tokens staged in {staged}")
        for outtype in a.outtype:
            outfile = os.path.join(out_dir, f"model-{outtype}.gguf")
            convert(main_fn, staged, outfile, outtype, os.path.basename(os.path.abspath(a.model)),
                    ["--no-mtp"] if a.no_mtp else [])
            print(f"make_gguf: wrote {outfile}")


if __name__ == "__main__":
    main()
