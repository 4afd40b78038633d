"""benchmarks/gguf_perplexity.py: hybridserve scores the chunks and positions llama-perplexity scores, and the
figures are read from llama-perplexity's own output lines."""


import pytest

from tests.gguf.benchmark_script import load_benchmark


def _gguf_perplexity():
    return load_benchmark("gguf_perplexity")


def test_chunks_and_scored_positions_are_llama_perplexitys():
    gp = _gguf_perplexity()
    ids = list(range(100, 140))
    assert gp.chunk_prompts(ids, 8, 3, None) == [ids[0:8], ids[8:16], ids[16:24]]
    # a vocab that adds BOS: llama-perplexity puts it in place of each chunk's first token
    assert gp.chunk_prompts(ids, 8, 2, 1) == [[1, *ids[1:8]], [1, *ids[9:16]]]
    # logits at ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1: ctx - 1 - ctx/2 tokens per chunk
    assert list(gp.scored_positions(8)) == [5, 6, 7]
    assert len(gp.scored_positions(512)) == 255
    with pytest.raises(ValueError, match="40 tokens, fewer than --chunks 6 x --ctx 8"):
        gp.chunk_prompts(ids, 8, 6, None)


def test_llama_perplexity_summaries_are_read():
    gp = _gguf_perplexity()
    base = "0.15.317.097 I Final estimate: PPL = 566.0128 +/- 58.40112\n"
    assert gp.parse_llama_perplexity(base) == {"ppl": 566.0128}
    kld = ("Mean PPL(Q)                   : 563.250704 ±  58.364829\n"
           "Mean PPL(base)                : 563.369612 ±  58.052024\n"
           "Mean    KLD:   0.000218 ±   0.000006\n"
           "Same top p: 98.725 ± 0.351 %\n")
    assert gp.parse_llama_perplexity(kld) == {"ppl_q": 563.250704, "kld": 0.000218, "same_top_p_pct": 98.725}
    assert gp.parse_llama_perplexity("chunk  PPL\n   1  845.0691 ±  186.4709\n") == {}
