"""``hybridserve drift`` and ``hybridserve.evaluation.drift``: the state-precision drift report.

On a tiny Bamba checkpoint (Mamba2 + attention, with a tokenizer), few tokens: float32 state against float32
state is exactly 0 at every position (runs repeat bit for bit), bfloat16 state drifts (> 0); the teacher-forced
scores line up with the positions generation saw; the buckets split at the end of the prompt; the JSON holds to
its schema; the PNG is drawn when matplotlib is installed, and without it the table and JSON are still written
with the install command named; bad settings fail before any engine starts, with the flag named.
"""

from __future__ import annotations

import json
import logging

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints.cli import main
from hybridserve.evaluation.drift import (
    DEFAULT_TEXT,
    DriftSettings,
    check_state_dtypes,
    greedy_params,
    measure_drift,
    score_run,
)
from hybridserve.evaluation.drift_figures import figures, position_buckets
from tests.checkpoints import make
from tests.server.server_utils import make_checkpoint

PROMPT, GENERATED, BUCKET = 24, 16, 10
SMALL = ["--prompt-tokens", str(PROMPT), "--generate-tokens", str(GENERATED), "--bucket", str(BUCKET),
         "--cache-memory", "32MiB", "--no-progress"]

FIGURES = {"type": ["object", "null"], "required": ["positions", "mean", "max", "top1_agreement"],
           "properties": {"positions": {"type": "integer", "minimum": 1}, "mean": {"type": "number", "minimum": 0},
                          "max": {"type": "number", "minimum": 0},
                          "top1_agreement": {"type": "number", "minimum": 0, "maximum": 1}}}
RUN = {"type": "object", "required": ["dtypes", "state_bytes_per_sequence", "seconds"],
       "properties": {"dtypes": {"type": "object", "required": ["dtype", "kv_cache_dtype", "mamba_cache_dtype",
                                                                 "mamba_ssm_cache_dtype"]},
                      "state_bytes_per_sequence": {"type": "integer", "minimum": 1},
                      "seconds": {"type": "number", "minimum": 0}}}
REPORT_SCHEMA = {
    "type": "object",
    "required": ["schema", "model", "shipped_model", "architecture", "reference_state_dtype", "settings", "cpu",
                 "versions", "reference", "state_dtypes", "buckets", "token_ids"],
    "properties": {
        "schema": {"const": "hybridserve.drift/1"},
        "reference_state_dtype": {"const": "float32"},
        "settings": {"type": "object", "required": ["prompt_tokens", "generate_tokens", "bucket", "seed",
                                                    "max_num_batched_tokens", "text"]},
        "cpu": {"type": "object", "required": ["model", "arch", "isa_in_force"],
                "properties": {"model": {"type": "string"}, "isa_in_force": {"type": "string"}}},
        "reference": RUN,
        "state_dtypes": {"type": "object", "minProperties": 1,
                         "additionalProperties": {"allOf": [RUN, {"required": ["all", "prompt", "generated"],
                                                                  "properties": {"all": FIGURES, "prompt": FIGURES,
                                                                                 "generated": FIGURES}}]}},
        "buckets": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["start", "end", "phase", "figures"],
            "properties": {"start": {"type": "integer", "minimum": 1}, "end": {"type": "integer"},
                           "phase": {"enum": ["prompt", "generated"]},
                           "figures": {"type": "object", "additionalProperties": FIGURES}}}},
        "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("drift") / "bamba"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("drift_text") / "text.txt"
    path.write_text(DEFAULT_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def report(ckpt, text_file):
    settings = DriftSettings(prompt_tokens=PROMPT, generate_tokens=GENERATED, bucket=BUCKET)
    text = open(text_file, encoding="utf-8").read()
    return measure_drift(ckpt, ["float32", "bf16"], text, settings, {"cache_memory": "32MiB"})


def test_float32_state_against_itself_is_exactly_zero_everywhere(report):
    same = report["state_dtypes"]["float32"]
    assert same["all"]["positions"] == PROMPT + GENERATED - 1
    assert same["all"]["max"] == 0.0 and same["all"]["top1_agreement"] == 1.0
    assert all(row["figures"]["float32"]["max"] == 0.0 for row in report["buckets"])


def test_bfloat16_state_drifts_and_halves_the_state(report):
    bf16 = report["state_dtypes"]["bfloat16"]  # named "bf16": the engine's alias resolved
    assert bf16["dtypes"]["mamba_ssm_cache_dtype"] == "bfloat16"
    assert bf16["all"]["mean"] > 0 and bf16["prompt"]["max"] > 0 and bf16["generated"]["max"] > 0
    assert bf16["all"]["max"] < 1.0  # rounding noise, not another model
    assert bf16["state_bytes_per_sequence"] < report["reference"]["state_bytes_per_sequence"]
    rows = [row["figures"]["bfloat16"] for row in report["buckets"]]
    assert sum(r["positions"] for r in rows) == PROMPT + GENERATED - 1
    assert max(r["max"] for r in rows) == bf16["all"]["max"]
    assert [r["start"] for r in report["buckets"] if r["phase"] == "generated"][0] == PROMPT


def test_the_report_holds_to_its_schema(report, ckpt):
    jsonschema = pytest.importorskip("jsonschema")
    decoded = json.loads(json.dumps(report))  # JSON-ready as it is
    jsonschema.validate(decoded, REPORT_SCHEMA)
    assert len(decoded["token_ids"]) == PROMPT + GENERATED
    assert decoded["settings"]["max_num_batched_tokens"] == 1  # the state rounded after every token
    assert decoded["model"] == ckpt and decoded["shipped_model"] is False


def test_scores_line_up_with_the_positions_generation_saw(ckpt, report):
    """Position i scores token i: the teacher-forced logprob of each generated token equals the logprob the
    greedy decode gave it (float32 both; decode and one-token prefill steps differ by float32 noise only)."""
    ids = report["token_ids"]
    llm = LLM(ckpt, cache_memory="32MiB", max_num_batched_tokens=1, max_num_seqs=1, mamba_ssm_cache_dtype="float32")
    out = llm.generate([{"prompt_token_ids": ids[:PROMPT]}],
                       greedy_params(0, max_tokens=GENERATED, ignore_eos=True, logprobs=2), use_tqdm=False)[0]
    generated = out.outputs[0]
    assert generated.token_ids == ids[PROMPT:]
    decoded = [entry[token].logprob for entry, token in zip(generated.logprobs, generated.token_ids)]
    scored = score_run(llm, ids, DriftSettings(prompt_tokens=PROMPT, generate_tokens=GENERATED), "t", None).scores
    assert max(abs(a - b) for a, b in zip(decoded, scored.target_logprobs[PROMPT - 1:])) < 1e-4
    for entry, token, top in zip(generated.logprobs, generated.token_ids, scored.top_token_ids[PROMPT - 1:]):
        if top != token:  # greedy: the scored argmax is the next token, unless the two were near-tied in decoding
            assert top in entry and abs(entry[top].logprob - entry[token].logprob) < 1e-4, (top, token, entry)


def test_buckets_split_at_the_end_of_the_prompt():
    buckets = position_buckets(520, 1040, 64)
    assert (buckets[0].start, buckets[0].end, buckets[0].phase) == (1, 64, "prompt")
    assert [(b.start, b.end) for b in buckets if b.end == 520 or b.start == 520] == [(512, 520), (520, 584)]
    assert all(a.end == b.start for a, b in zip(buckets, buckets[1:])) and buckets[-1].end == 1040
    assert all(b.phase == ("prompt" if b.end <= 520 else "generated") for b in buckets)
    assert all(b.phase == "prompt" for b in position_buckets(100, 100, 64))  # nothing generated
    deltas, agree = [0.5, 0.1, 0.3, 0.0], [True, False, True, True]
    assert figures(deltas, agree, 2, 4) == {"positions": 2, "mean": pytest.approx(0.2), "max": 0.3,
                                            "top1_agreement": 0.5}
    assert figures(deltas, agree, 5, 5) is None


def test_cli_writes_table_json_and_plot(ckpt, text_file, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install 'hybridserve[plot]')")
    out_json, out_png = tmp_path / "drift.json", tmp_path / "drift.png"
    rc = main(["drift", "--model", ckpt, "--text", text_file, "--state-dtypes", "bfloat16", *SMALL,
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "bfloat16" in table and "top-1 agreement" in table
    assert json.loads(out_json.read_text())["state_dtypes"]["bfloat16"]["all"]["mean"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_cli_without_matplotlib_still_writes_table_and_json(ckpt, text_file, tmp_path, capsys, monkeypatch):
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed (nor imported before)
    out_json, out_png = tmp_path / "drift.json", tmp_path / "drift.png"
    rc = main(["drift", "--model", ckpt, "--text", text_file, "--state-dtypes", "float16", *SMALL,
               "--generate-tokens", "0", "--json", str(out_json), "--plot", str(out_png)])
    captured = capsys.readouterr()
    assert rc == 1 and not out_png.exists()
    assert "pip install 'hybridserve[plot]'" in captured.err
    assert "float16" in captured.out  # the table
    assert "drift: float16 state: scoring: done" in captured.err  # a line per run
    written = json.loads(out_json.read_text())
    assert written["settings"]["generate_tokens"] == 0 and written["state_dtypes"]["float16"]["generated"] is None


@pytest.mark.parametrize("argv, message", [
    (["--state-dtypes", "bfloat16,int3"], "'int3' is not a recurrent-state dtype the engine accepts"),
    (["--state-dtypes", "bf16,bfloat16"], "names 'bfloat16' twice"),
    (["--state-dtypes", ","], "--state-dtypes is empty"),
    (["--prompt-tokens", "1"], "--prompt-tokens"),
    (["--bucket", "0"], "--bucket"),
    (["--mamba-ssm-cache-dtype", "bfloat16"], "list the dtypes in --state-dtypes"),
    (["--text", "/nonexistent/drift.txt"], "--text '/nonexistent/drift.txt' cannot be read"),
])
def test_bad_settings_fail_before_any_engine_starts(argv, message, capsys, monkeypatch):
    import hybridserve.entrypoints.llm as llm_module

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(llm_module, "LLM", no_engine)
    assert main(["drift", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "int3" in argv[-1]:
        assert "allowed values: auto, float32, bfloat16, float16" in err


def test_a_text_shorter_than_the_prompt_is_refused(ckpt, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.", encoding="utf-8")
    assert main(["drift", "--model", ckpt, "--text", str(short), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"fewer than --prompt-tokens {PROMPT}" in err and "--text FILE" in err


def test_prompt_and_continuation_must_fit_the_model_length(ckpt, text_file, capsys):
    assert main(["drift", "--model", ckpt, "--text", text_file, *SMALL, "--max-model-len", "30"]) == 2
    err = capsys.readouterr().err
    assert f"= {PROMPT + GENERATED} tokens exceed max_model_len=30 (--max-model-len" in err, err


def test_a_model_without_temporal_state_shows_no_drift_and_says_why(ckpt_dir, caplog):
    lfm2 = make(ckpt_dir, "lfm2")  # short convolutions only: no state --mamba-ssm-cache-dtype governs
    prompt = [(7 * i) % 100 + 3 for i in range(16)]
    with caplog.at_level(logging.WARNING, logger="hybridserve.evaluation.drift"):
        report = measure_drift(lfm2, ["bfloat16"], prompt, DriftSettings(prompt_tokens=16, generate_tokens=8, bucket=8),
                               {"cache_memory": "32MiB"})
    assert report["state_dtypes"]["bfloat16"]["all"]["max"] == 0.0
    assert "no temporal state" in caplog.text


def test_an_entry_sets_the_conv_state_dtype_after_a_colon(ckpt_dir):
    """``SSM:CONV`` runs with that conv-state dtype too; LFM2's short convolutions drift only through it."""
    lfm2 = make(ckpt_dir, "lfm2")
    prompt = [(7 * i) % 100 + 3 for i in range(16)]
    report = measure_drift(lfm2, ["float32:int8", "bfloat16"], prompt,
                           DriftSettings(prompt_tokens=16, generate_tokens=8, bucket=8), {"cache_memory": "32MiB"})
    coded, plain = report["state_dtypes"]["float32:int8"], report["state_dtypes"]["bfloat16"]
    assert coded["dtypes"]["mamba_cache_dtype"] == "int8" and coded["all"]["max"] > 0.0
    assert plain["all"]["max"] == 0.0 and coded["state_bytes_per_sequence"] < report["reference"][
        "state_bytes_per_sequence"]


def test_state_dtype_names_are_the_engines_own():
    assert check_state_dtypes(["fp16", "BF16", "float32"], {}) == ["float16", "bfloat16", "float32"]
    assert check_state_dtypes(["int8:int8", "bf16:BF16"], {}) == ["int8:int8", "bfloat16:bfloat16"]
    with pytest.raises(ValueError, match="'int8:fp8'.*an 8-bit conv state is int8"):
        check_state_dtypes(["int8:fp8"], {})
    with pytest.raises(ValueError, match="cache_memory"):  # another option's own error comes first
        check_state_dtypes(["bfloat16"], {"cache_memory": "lots"})


def test_sampling_is_greedy_whatever_the_model_defaults():
    params = greedy_params(7, max_tokens=3)
    assert params.greedy and params.seed == 7 and not params.adjusts_logits
    assert all(params.is_set(name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"))
    assert isinstance(params, SamplingParams)
