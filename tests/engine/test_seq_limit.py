"""``max_num_seqs`` above what the cache pool holds is clamped at start with one WARNING naming both numbers
(``engine/seq_limit.py``); a pool that holds not even one sequence is an error at start."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cache.capacity import max_sequences
from tests.checkpoints import make


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    path = make(str(tmp_path_factory.mktemp("ckpt")), "bamba")
    layout = LLM(path, cache_memory="4MiB", max_num_seqs=2, enable_progress_bar=False).engine.layout
    return path, layout


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.endswith("seq_limit")]


def test_max_num_seqs_above_what_fits_is_clamped_with_one_warning(bamba, caplog):
    path, layout = bamba
    one = layout.slot_bytes + layout.page_bytes
    with caplog.at_level("WARNING", logger="hybridserve.engine.seq_limit"):
        llm = LLM(path, cache_memory=5 * one, max_num_seqs=64, enable_progress_bar=False)
    fits = max_sequences(layout, llm.engine.pool.num_bytes, 1)
    assert 1 <= fits < 64
    assert llm.engine.scheduler.max_num_seqs == fits == llm.engine.config.max_num_seqs
    captured = llm.engine.runner.captured_decode
    assert captured is None or captured.max_rows == fits  # no bucket larger than what can run
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    for text in ("max_num_seqs=64", f"clamped to {fits}", f"{layout.state_bytes_per_sequence} bytes",
                 f"cache_memory={llm.engine.pool.num_bytes}", "--cache-memory"):
        assert text in warnings[0], (text, warnings[0])
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * (fits + 2), SamplingParams(temperature=0, max_tokens=3))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_max_num_seqs_that_fits_is_kept_silently(bamba, caplog):
    path, layout = bamba
    with caplog.at_level("WARNING", logger="hybridserve.engine.seq_limit"):
        llm = LLM(path, cache_memory="4MiB", max_num_seqs=3, enable_progress_bar=False)
    assert llm.engine.scheduler.max_num_seqs == 3 and not _warnings(caplog)


def test_a_pool_that_holds_no_sequence_is_an_error(bamba):
    path, layout = bamba
    with pytest.raises(ValueError, match=r"holds no sequence: one needs at least \d+ bytes .*raise --cache-memory"):
        LLM(path, cache_memory=layout.slot_bytes, enable_progress_bar=False)
