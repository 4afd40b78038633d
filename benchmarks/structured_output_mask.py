"""Structured output engines side by side: xgrammar vs llguidance, per-token mask time and compile time.

For each tokenizer and grammar, a fixed valid document is tokenized (its canonical tokenization, which both
engines accept), then a fresh matcher walks it token by token; each step times

* ``mask``: filling the next-token bitmask (an int32 row of ceil(V / 32) words),
* ``accept``: advancing the matcher by the document's next token,

the document ending with EOS (whose mask allows EOS alone). ``--repeats`` walks are timed; the table gives
the median over all steps of all walks and the 99th percentile. ``compile`` is the time to a matcher
ready for its first mask on a grammar never seen before (xgrammar: ``GrammarCompiler.compile_*`` with its
cache off + ``GrammarMatcher``; llguidance: ``LLMatcher`` construction, which parses the grammar; its
lexer is built lazily, so the first mask is given apart: ``first mask``). ``tokenizer`` is the one-off
tokenizer setup (xgrammar ``TokenizerInfo``, llguidance ``LLTokenizer``). ``apply`` times setting the
disallowed logits of a batch of ``--batch`` rows to -inf from their bitmasks (xgrammar's CPU kernel;
hybridserve's ``apply_token_bitmask`` for llguidance): the masks of evenly spaced steps of the walk, and
(``random``) masks of random bits.

Tokenizers: the shipped default model's (``hybridserve.default_model``, 4096 tokens), and, with
``--large-vocab N``, a byte-level BPE of N tokens trained here, offline, on the Python sources of this
interpreter (no large-vocabulary tokenizer ships with any installed package); it is saved to
``--large-tokenizer`` and reused on later runs.

``--end-to-end`` also times the engine on the default model: ``--batch`` requests constrained by the JSON
schema against the same requests unconstrained, generating as many tokens each.

    python benchmarks/structured_output_mask.py
    python benchmarks/structured_output_mask.py --large-vocab 128000 --end-to-end --json /tmp/so_mask.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"subject": {"enum": ["math", "art", "music"]}, "value": {"type": "number"}},
                      "required": ["subject", "value"], "additionalProperties": False},
        },
    },
    "required": ["name", "age", "tags", "address", "scores"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Elizabeth Bennet", "age": 20, "tags": ["reader", "walker", "witty"],
    "address": {"street": "Longbourn House", "city": "Meryton", "zip": "01234"},
    "scores": [{"subject": "art", "value": 7.5}, {"subject": "music", "value": 6},
               {"subject": "math", "value": 9.25}],
}
REGEX = r"([a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,10}\.(com|org|net), ){3}[a-z]{2,12}@[a-z]{3,10}\.(com|org|net)"
REGEX_TEXT = "jane.austen@chawton.org, fitzwilliam.darcy@pemberley.com, charles.bingley@meryton.net, " \
             "emma@highbury.org"


def cpu_model_name() -> str:
    """The "model name" of /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def train_large_tokenizer(vocab_size: int, path: str, max_bytes: int) -> str:
    """A byte-level BPE of ``vocab_size`` tokens trained on this interpreter's Python sources, saved to
    ``path`` (a tokenizer.json); reused when ``path`` exists."""
    if os.path.exists(path):
        return path
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "**", "*.py"), recursive=True))

    def texts():
        total = 0
        for name in files:
            try:
                with open(name, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            total += len(text)
            if total > max_bytes:
                return
            yield text

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    start = time.perf_counter()
    tok.train_from_iterator(texts(), trainer)
    print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - start:.0f} s -> {path}",
          file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tok.save(path)
    return path


def load_hf_tokenizer(tokenizer_json: str, eos: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=eos)


def _ms(ns: list[int]) -> tuple[float, float]:
    """(median, p99) of nanosecond timings, in microseconds."""
    ordered = sorted(ns)
    return statistics.median(ordered) / 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        start = time.perf_counter_ns()
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab_size)
        self.tokenizer_ns = time.perf_counter_ns() - start
        self.vocab_size = vocab_size

    def matcher(self, kind: str, source):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        compiled = (compiler.compile_json_schema(json.dumps(source)) if kind == "json"
                    else compiler.compile_regex(source))
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, hf_tok, vocab_size: int) -> None:
        import llguidance
        import torch

        self.llg, self.torch = llguidance, torch
        start = time.perf_counter_ns()
        self.tok = llguidance.LLTokenizer(hf_tok.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                          eos_token=hf_tok.eos_token_id)
        self.tokenizer_ns = time.perf_counter_ns() - start
        self.vocab_size = vocab_size

    def matcher(self, kind: str, source):
        grammar = (self.llg.LLMatcher.grammar_from_json_schema(json.dumps(source)) if kind == "json"
                   else self.llg.LLMatcher.grammar_from_regex(source))
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self, rows: int):
        return self.torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=self.torch.int32)

    def fill(self, matcher, bitmask, row: int = 0) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def apply(self, logits, bitmask) -> None:
        from hybridserve.structured_output.bitmask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask)


def bench_grammar(engine, kind: str, source, tokens: list[int], repeats: int, keep: int) -> tuple[dict, list]:
    """Compile, first-mask, and per-token mask / accept timings of one grammar on one engine; also the bitmasks
    of ``keep`` evenly spaced steps of the first walk."""
    compile_ns, first_ns, mask_ns, accept_ns = [], [], [], []
    bitmask = engine.bitmask(1)
    kept = []
    keep_at = set(range(0, len(tokens), max(1, len(tokens) // keep))) if keep else set()
    for rep in range(repeats):
        start = time.perf_counter_ns()
        m = engine.matcher(kind, source)
        compile_ns.append(time.perf_counter_ns() - start)
        for step, token in enumerate(tokens):
            start = time.perf_counter_ns()
            engine.fill(m, bitmask)
            mid = time.perf_counter_ns()
            ok = engine.accept(m, token)
            end = time.perf_counter_ns()
            if not ok:
                raise RuntimeError(f"{engine.name} refused token {step} ({token}) of the {kind} document")
            (first_ns if step == 0 else mask_ns).append(mid - start)
            accept_ns.append(end - mid)
            if rep == 0 and step in keep_at and len(kept) < keep:
                kept.append(bitmask[0].clone())
    mask = _ms(mask_ns)
    accept = _ms(accept_ns)
    return {"tokens": len(tokens), "compile_ms": statistics.median(compile_ns) / 1e6,
            "first_mask_us": statistics.median(first_ns) / 1e3, "mask_us": mask[0], "mask_p99_us": mask[1],
            "accept_us": accept[0], "accept_p99_us": accept[1], "mask_plus_accept_us": mask[0] + accept[0]}, kept


def bench_apply(engine, bitmask, repeats: int) -> float:
    """Median microseconds to mask a (R, V) float32 logits batch by ``bitmask`` (R, W)."""
    torch = engine.torch
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bitmask.shape[0], engine.vocab_size, generator=gen)
    times = []
    for _ in range(repeats):
        work = logits.clone()
        start = time.perf_counter_ns()
        engine.apply(work, bitmask)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def run(tokenizers: dict[str, str], engines: list[str], repeats: int, batch: int) -> list[dict]:
    import jsonschema

    jsonschema.validate(DOCUMENT, SCHEMA)
    if not re.fullmatch(REGEX, REGEX_TEXT):
        raise AssertionError("REGEX_TEXT does not match REGEX")
    results = []
    for tok_name, path in tokenizers.items():
        hf_tok = load_hf_tokenizer(path, "<|endoftext|>")
        vocab = len(hf_tok)
        docs = {"json": (SCHEMA, json.dumps(DOCUMENT)), "regex": (REGEX, REGEX_TEXT)}
        for eng_name in engines:
            engine = (XGrammarEngine if eng_name == "xgrammar" else LLGuidanceEngine)(hf_tok, vocab)
            gen = engine.torch.Generator().manual_seed(0)
            noise = engine.torch.randint(-2 ** 31, 2 ** 31 - 1, (batch, (vocab + 31) // 32), generator=gen,
                                         dtype=engine.torch.int32)
            apply_random_us = bench_apply(engine, noise, repeats * 5)
            for kind, (source, text) in docs.items():
                tokens = hf_tok.encode(text, add_special_tokens=False) + [hf_tok.eos_token_id]
                r, kept = bench_grammar(engine, kind, source, tokens, repeats, batch)
                r.update(tokenizer=tok_name, vocab=vocab, engine=eng_name, grammar=kind,
                         tokenizer_setup_ms=engine.tokenizer_ns / 1e6, apply_batch=len(kept),
                         apply_us=bench_apply(engine, engine.torch.stack(kept), repeats * 5),
                         apply_random_us=apply_random_us)
                results.append(r)
    return results


def end_to_end(batch: int, repeats: int) -> dict:
    """Decode time of the default model: ``batch`` requests constrained by SCHEMA (temperature 1, seeded) vs
    the same requests unconstrained, each generating as many tokens (``ignore_eos``); best of ``repeats``."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.default_model import default_model_path
    from hybridserve.sampling_params import StructuredOutputsParams

    llm = LLM(default_model_path(), cache_memory="64MiB")
    prompts = ["Elizabeth Bennet"] * batch
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=512,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(batch)]
    llm.generate(prompts, constrained, use_tqdm=False)  # warm-up (grammar compiled and cached)
    best_c = best_u = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        best_c = min(best_c, time.perf_counter() - start)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        start = time.perf_counter()
        llm.generate(prompts, plain, use_tqdm=False)
        best_u = min(best_u, time.perf_counter() - start)
    tokens = sum(lengths)
    return {"batch": batch, "tokens": tokens, "constrained_s": best_c, "unconstrained_s": best_u,
            "overhead_us_per_token": (best_c - best_u) / tokens * 1e6}


def print_table(results: list[dict]) -> None:
    head = (f"{'tokenizer':>10} {'vocab':>7} {'grammar':>7} {'engine':>10} {'tokens':>6} {'compile ms':>10} "
            f"{'1st mask us':>11} {'mask us':>8} {'p99':>7} {'accept us':>9} {'p99':>6} {'mask+acc':>8} "
            f"{'tok setup ms':>12} {'apply us':>8} {'random':>7}")
    print(head)
    for r in results:
        print(f"{r['tokenizer']:>10} {r['vocab']:>7} {r['grammar']:>7} {r['engine']:>10} {r['tokens']:>6} "
              f"{r['compile_ms']:>10.2f} {r['first_mask_us']:>11.1f} {r['mask_us']:>8.1f} {r['mask_p99_us']:>7.1f} "
              f"{r['accept_us']:>9.1f} {r['accept_p99_us']:>6.1f} {r['mask_plus_accept_us']:>8.1f} "
              f"{r['tokenizer_setup_ms']:>12.1f} {r['apply_us']:>8.1f} {r['apply_random_us']:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="xgrammar,llguidance")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="rows of the logits batch the apply time masks")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the apply step; the masks use one)")
    ap.add_argument("--large-vocab", type=int, default=0, help="also bench a BPE of this many tokens (0: off)")
    ap.add_argument("--large-tokenizer", default="/tmp/hybridserve-bench/large_bpe/tokenizer.json")
    ap.add_argument("--large-corpus-bytes", type=int, default=150_000_000)
    ap.add_argument("--end-to-end", action="store_true",
                    help="also time the default model decoding --batch requests with and without the JSON schema")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    from hybridserve.default_model import default_model_path

    tokenizers = {"default": os.path.join(default_model_path(), "tokenizer.json")}
    if a.large_vocab:
        tokenizers["large"] = train_large_tokenizer(a.large_vocab, a.large_tokenizer, a.large_corpus_bytes)
    import llguidance
    import torch

    torch.set_num_threads(a.threads)
    versions = {"llguidance": llguidance.__version__, "torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["xgrammar"] = version("xgrammar")
    except Exception:  # noqa: BLE001 - not installed
        pass
    print(f"CPU: {cpu_model_name()} | {os.cpu_count()} cores | torch threads {torch.get_num_threads()} | {versions}")
    engines = a.engines.split(",")
    if "xgrammar" in engines and "xgrammar" not in versions:
        print("xgrammar is not installed: benchmarking llguidance alone "
              "(pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 to compare)", file=sys.stderr)
        engines.remove("xgrammar")
    results = run(tokenizers, engines, a.repeats, a.batch)
    print_table(results)
    e2e = end_to_end(a.batch, 5) if a.end_to_end else None
    if e2e:
        print(f"default model, {e2e['batch']} requests, {e2e['tokens']} tokens: "
              f"constrained {e2e['constrained_s']:.3f} s,"
              f" unconstrained {e2e['unconstrained_s']:.3f} s, {e2e['overhead_us_per_token']:.0f} us per token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model_name(), "cores": os.cpu_count(), "versions": versions,
                       "results": results, "end_to_end": e2e}, f, indent=1)


if __name__ == "__main__":
    main()
