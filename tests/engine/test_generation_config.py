"""generation_config.json: every end-of-sequence id stops a sequence, and its sampling fields are the defaults of
the requests that leave them unset (hybridserve/generation_config.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.generation_config import GenerationDefaults, load_generation_defaults
from hybridserve.structured_output.params import StructuredOutputsParams
from tests.server.server_utils import make_checkpoint

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Bamba with a tokenizer (eos ``</s>``), and the greedy tokens it generates for PROMPT."""
    path = make_checkpoint(str(tmp_path_factory.mktemp("gencfg") / "bamba"))
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    return path, llm.engine.eos_token_id, greedy.token_ids


def variant(base_path: str, root, name: str, config: dict | None = None, generation: dict | None = None) -> str:
    """A copy of the checkpoint with these config.json fields changed and this generation_config.json (None: the
    copy's own)."""
    path = str(root / name)
    shutil.copytree(base_path, path)
    if config:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    if generation is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    return path


def first_new_token(tokens: list[int], exclude: int) -> tuple[int, int]:
    """``(position, token)`` of the first token in ``tokens`` that appears for the first time and is not
    ``exclude``, after position 1 (so the stop is visibly early)."""
    for i, t in enumerate(tokens):
        if i >= 1 and t != exclude and t not in tokens[:i]:
            return i, t
    raise AssertionError(f"no usable token in {tokens}")


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_the_second_eos_id_of_a_list_stops_and_is_not_printed(base, tmp_path, where):
    path, eos, greedy = base
    pos, end_of_turn = first_new_token(greedy, eos)
    ids = [eos, end_of_turn]
    ckpt = (variant(path, tmp_path, "cfg", config={"eos_token_id": ids}) if where == "config.json"
            else variant(path, tmp_path, "gen", generation={"eos_token_id": ids}))
    llm = LLM(ckpt, cache_memory="8MiB", enable_progress_bar=False)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == greedy[:pos + 1] and out.finish_reason == "stop"
    assert set(ids) <= set(llm.engine.eos_token_ids)
    tok = llm.get_tokenizer()
    # the end-of-turn token is an ordinary (not special) token here: still never part of the text
    assert out.text == tok.decode(greedy[:pos])
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False))[0].outputs[0]
    assert kept.text == tok.decode(greedy[:pos], skip_special_tokens=False)
    # ignore_eos runs past every EOS id
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_min_tokens_masks_every_eos_id(base, tmp_path):
    path, eos, greedy = base
    pos, end_of_turn = first_new_token(greedy, eos)
    llm = LLM(variant(path, tmp_path, "gen", generation={"eos_token_id": [eos, end_of_turn]}),
              cache_memory="8MiB", enable_progress_bar=False)
    forced = SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={end_of_turn: 100.0})
    out = llm.generate(PROMPT, forced)[0].outputs[0]
    assert end_of_turn not in out.token_ids[:4]
    assert out.token_ids[-1] == end_of_turn and len(out.token_ids) == 5 and out.finish_reason == "stop"


def test_a_complete_grammar_ends_on_any_eos_id(base, tmp_path):
    """The grammar engine knows one EOS id; the others end a complete output too (and only a complete one)."""
    path, eos, greedy = base
    llm0 = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    end_of_turn = next(t for t in llm0.get_tokenizer().encode(" fox") if t != eos)
    llm = LLM(variant(path, tmp_path, "gen", generation={"eos_token_id": [eos, end_of_turn]}),
              cache_memory="8MiB", enable_progress_bar=False)
    # the end-of-turn id pushed up and the grammar engine's EOS down: the grammar still decides where it may go
    # (a complete "yes" may go on: "yesyes..."; the end-of-turn id is allowed only there)
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={end_of_turn: 100.0, eos: -100.0},
                            structured_outputs=StructuredOutputsParams(regex="(yes)+"))
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    assert out.token_ids[-1] == end_of_turn


def test_an_added_special_token_as_eos_stops(tmp_path):
    """A tokenizer with an added special token (an end-of-turn marker) that generation_config.json lists as EOS."""
    from tests.checkpoints import bamba_config, build
    from tests.server.server_utils import train_tokenizer

    tokenizer = train_tokenizer(chat_template=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end_of_turn|>"]})
    end_of_turn = tokenizer.convert_tokens_to_ids("<|end_of_turn|>")
    path = str(tmp_path / "added")
    build(bamba_config(vocab_size=len(tokenizer)), path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tokenizer.eos_token_id, end_of_turn]}, f)
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    assert llm.get_tokenizer().encode("a<|end_of_turn|>")[-1] == end_of_turn  # one token, as added
    for skip in (True, False):
        params = SamplingParams(temperature=0, max_tokens=10, min_tokens=2, logit_bias={end_of_turn: 100.0},
                                skip_special_tokens=skip)
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert out.token_ids[-1] == end_of_turn and len(out.token_ids) == 3 and out.finish_reason == "stop"
        assert "<|end_of_turn|>" not in out.text


# ------------------------------------------------------------------------------------------ sampling defaults
def test_sampling_params_tell_unset_fields_from_set_ones():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.max_tokens == 16  # the public defaults are unchanged
    assert not p.is_set("temperature") and not p.is_set("max_tokens")
    assert SamplingParams(temperature=1.0).is_set("temperature")  # set, even to the default value
    p.top_p = 0.5
    assert p.is_set("top_p") and not p.is_set("top_k")
    filled = SamplingParams(top_k=3).with_defaults({"top_k": 7, "temperature": 0.25})
    assert filled.top_k == 3 and filled.temperature == 0.25 and not filled.is_set("temperature")


def _write(folder, body: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        f.write(body)
    return str(folder)


def test_the_file_gives_the_sampling_defaults(tmp_path):
    folder = _write(tmp_path / "m", json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                                                "repetition_penalty": 1.1, "max_new_tokens": 50, "eos_token_id": 2}))
    found = load_generation_defaults("auto", folder)
    assert found.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
                              "max_tokens": 50}
    assert "temperature=0.7" in found.describe() and "generation_config.json" in found.describe()
    params = found.apply(SamplingParams(temperature=0.2))
    assert params.temperature == 0.2 and params.top_p == 0.9 and params.max_tokens == 50  # explicit wins
    assert load_generation_defaults("vllm", folder) == GenerationDefaults()
    other = _write(tmp_path / "other", json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_defaults(other, folder).sampling == {"temperature": 0.0}  # do_sample false: greedy
    assert load_generation_defaults("auto", str(tmp_path)).sampling == {}  # no file: no defaults


@pytest.mark.parametrize("body, words", [('{"temperature": 0.5,', ["generation_config.json", "could not be read"]),
                                         ('{"top_p": 3}', ["generation_config.json", "top_p=3"])])
def test_a_broken_file_is_an_error_naming_it(tmp_path, body, words):
    folder = _write(tmp_path / "m", body)
    with pytest.raises(ValueError) as err:
        load_generation_defaults("auto", folder)
    assert all(w in str(err.value) for w in words), err.value


def test_the_setting_is_auto_vllm_or_a_folder_with_the_file(tmp_path):
    with pytest.raises(ValueError, match="--generation-config"):
        EngineConfig(generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_generation_defaults(str(tmp_path), str(tmp_path))
    assert EngineConfig(generation_config="VLLM").generation_config == "vllm"


def test_generate_takes_the_model_defaults_unless_set(base, tmp_path):
    path, _, greedy = base
    ckpt = variant(path, tmp_path, "gen", generation={"max_new_tokens": 3, "repetition_penalty": 0.2,
                                                      "do_sample": False})
    llm = LLM(ckpt, cache_memory="8MiB", enable_progress_bar=False)
    unset = llm.generate(PROMPT, SamplingParams(ignore_eos=True))[0].outputs[0]
    penalized = llm.generate(PROMPT, SamplingParams(temperature=0, repetition_penalty=0.2, max_tokens=3,
                                                    ignore_eos=True))[0].outputs[0]
    assert unset.token_ids == penalized.token_ids != greedy[:3]  # greedy, penalized, 3 tokens: all from the file
    explicit = llm.generate(PROMPT, SamplingParams(max_tokens=12, repetition_penalty=1.0, ignore_eos=True))[0]
    assert explicit.outputs[0].token_ids == greedy  # the request's own values win (greedy still from the file)
    assert len(llm.generate(PROMPT)[0].outputs[0].token_ids) <= 3  # no params at all: the file's defaults
    plain = LLM(ckpt, generation_config="vllm", cache_memory="8MiB", enable_progress_bar=False)
    assert len(plain.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True))[0].outputs[0].token_ids) == 16


def test_a_default_max_tokens_is_cut_to_what_fits(base, tmp_path):
    path, _, _ = base
    llm = LLM(variant(path, tmp_path, "gen", generation={"max_new_tokens": 1000}), max_model_len=32,
              cache_memory="8MiB", enable_progress_bar=False)
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    out = llm.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 32 - prompt_len and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):  # an explicit one is not cut
        llm.generate(PROMPT, SamplingParams(max_tokens=1000))


def test_the_cli_takes_the_model_defaults(base, tmp_path, capsys):
    from hybridserve.entrypoints.cli import main

    path, _, _ = base
    ckpt = variant(path, tmp_path, "gen", generation={"max_new_tokens": 3})
    assert main(["generate", PROMPT, "--model", ckpt, "--ignore-eos", "--logprobs", "0",
                 "--cache-memory", "8MiB"]) == 0
    assert len([line for line in capsys.readouterr().err.splitlines() if line.startswith("cli-0 #")]) == 3
    assert main(["generate", PROMPT, "--model", ckpt, "--ignore-eos", "--logprobs", "0", "--max-tokens", "5",
                 "--cache-memory", "8MiB"]) == 0
    assert len([line for line in capsys.readouterr().err.splitlines() if line.startswith("cli-0 #")]) == 5
    assert main(["generate", PROMPT, "--model", ckpt, "--ignore-eos", "--logprobs", "0", "--generation-config",
                 "vllm", "--cache-memory", "8MiB"]) == 0
    assert len([line for line in capsys.readouterr().err.splitlines() if line.startswith("cli-0 #")]) == 64
