"""Output text: decoded incrementally (the tokenizers library's streaming decoder, or a short window
per step; never the whole output again), always a prefix of the whole output decoded at once and equal
to it at the end; ``detokenize=False`` gives token ids only."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.default_model import default_model_path
from hybridserve.engine.detokenizer import Detokenizer, _StreamDecoder, _WindowDecoder

TEXTS = ["Once upon a time, there was a little girl named Lily.",
         "Naïve café — déjà vu: 東京 and 🙂 emoji, tabs\tand  double  spaces.",
         "  leading spaces, trailing space ", "a\nnew line, then 12345 digits and (brackets)!"]


@pytest.fixture(scope="module")
def detok():
    return Detokenizer.from_path(default_model_path())


def _step_through(detok, ids, skip_special_tokens=True):
    """Feeds ids one at a time; checks the accumulated text after each against the full decode."""
    text, prefix, read = "", 0, 0
    for i in range(1, len(ids) + 1):
        delta, prefix, read = detok.decode_increment(ids[:i], prefix, read, skip_special_tokens)
        text += delta
        full = detok.decode(ids[:i], skip_special_tokens)
        assert full.startswith(text), (i, text, full)
        if not full.endswith("\ufffd"):
            assert text == full, (i, text, full)
        assert read - prefix <= 8, "the decode window grew"
    return text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_tracks_full_decode(detok, text):
    ids = detok.encode(text)
    assert _step_through(detok, ids) == detok.decode(ids)


def test_incremental_text_with_random_and_special_tokens(detok):
    rng = random.Random(0)
    vocab = detok.tokenizer.vocab_size
    specials = list(detok.tokenizer.all_special_ids)
    for _ in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(40)]
        for skip in (True, False):
            _step_through(detok, ids, skip)


def _decoders(detok, skip):
    return {"stream": _StreamDecoder(detok.tokenizer._tokenizer, skip), "window": _WindowDecoder(detok, skip)}


def _step_through_decoders(detok, ids, skip_special_tokens=True):
    """Both incremental decoders, fed one token at a time: each accumulated text a prefix of the full
    decode, equal to it whenever its last character is complete, and the two always alike."""
    decoders = _decoders(detok, skip_special_tokens)
    texts = dict.fromkeys(decoders, "")
    for i in range(1, len(ids) + 1):
        full = detok.decode(ids[:i], skip_special_tokens)
        for name, decoder in decoders.items():
            texts[name] += decoder.add(ids[:i])
            assert full.startswith(texts[name]), (name, i, texts[name], full)
            if not full.endswith("\ufffd"):
                assert texts[name] == full, (name, i, texts[name], full)
    return texts


@pytest.mark.parametrize("text", TEXTS)
def test_both_decoders_track_the_full_decode(detok, text):
    ids = detok.encode(text)
    assert set(_step_through_decoders(detok, ids).values()) == {detok.decode(ids)}


def test_both_decoders_with_random_special_and_out_of_vocabulary_tokens(detok):
    rng = random.Random(1)
    vocab = detok.tokenizer.vocab_size
    specials = list(detok.tokenizer.all_special_ids)
    for _ in range(40):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab + 8) for _ in range(40)]
        for skip in (True, False):
            _step_through_decoders(detok, ids, skip)


def test_the_engine_streams_with_the_tokenizers_decoder(detok):
    """A Rust-backed tokenizer that does not clean up spaces gets the streaming decoder; one without a
    backend (or that cleans up) the window of decode calls."""
    assert isinstance(detok.incremental(), _StreamDecoder)

    class Slow:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    assert isinstance(Detokenizer(Slow()).incremental(), _WindowDecoder)


def test_no_tokenizer_gives_no_text():
    assert Detokenizer(None).decode_increment([5, 6], 0, 0) == ("", 0, 0)


def test_engine_text_and_stop_strings():
    llm = LLM(enable_progress_bar=False, cache_memory="64MiB")
    prompt = "Once upon a time"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert full.text == llm.engine.detokenizer.decode(full.token_ids)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]


def test_detokenize_false_gives_token_ids_only():
    llm = LLM(enable_progress_bar=False, cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    with_text = llm.generate(["Once upon a time"], params)[0].outputs[0]
    params.detokenize = False
    ids_only = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    assert all(lp.decoded_token is None for step in ids_only.logprobs for lp in step.values())
    assert all(lp.decoded_token is not None for step in with_text.logprobs for lp in step.values())


@pytest.mark.parametrize("kwargs, message", [
    ({"detokenize": "no"}, "detokenize"),
    ({"detokenize": False, "stop": ["x"]}, "needs detokenize=True"),
])
def test_detokenize_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_text_is_decoded_when_read(monkeypatch):
    """Each step's snapshot has the text of every token so far (a prefix of the whole decode, equal to it
    once the last character is complete), an aborted request keeps the text of its tokens, and a request
    without stop strings run to its end is decoded once, at its end, never token by token."""
    from hybridserve.engine.detokenizer import IncrementalDecoder

    llm = LLM(enable_progress_bar=False, cache_memory="64MiB")
    engine, detok = llm.engine, llm.engine.detokenizer
    ids = detok.encode("Once upon a time")
    engine.add_request("streamed", ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine.add_request("aborted", ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    snapshots = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out.outputs[0]
            full = detok.decode(done.token_ids)
            assert full.startswith(done.text) and (done.text == full or full.endswith("\ufffd")), (done.text, full)
            snapshots += out.request_id == "streamed"
            if out.request_id == "aborted" and len(done.token_ids) == 5:
                engine.abort_request("aborted")
    assert snapshots == 24

    calls = []
    for cls in IncrementalDecoder.__subclasses__():
        monkeypatch.setattr(cls, "add", _counting(cls.add, calls))
    whole = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert whole[0].outputs[0].text == detok.decode(whole[0].outputs[0].token_ids) and calls == []
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                            stop=["\x00never"]))
    assert calls == list(range(1, 25))  # a stop string: the text is searched after every token


def _counting(add, calls):
    def counted(self, token_ids):
        calls.append(len(token_ids))
        return add(self, token_ids)
    return counted
