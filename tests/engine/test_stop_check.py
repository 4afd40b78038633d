"""The pure stop check (engine/stop_check.py): a function of the sequence and its params alone."""

from __future__ import annotations

import copy

from hybridserve.engine.sequence import Sequence
from hybridserve.engine.stop_check import Stop, check_stop
from hybridserve.sampling_params import SamplingParams

EOS = 2
END_OF_TURN = 9  # a second end-of-sequence id (generation_config.json's list)


def _seq(output: list[int], text: str = "", prompt_len: int = 3, **params) -> Sequence:
    params.setdefault("max_tokens", 16)
    seq = Sequence("r", list(range(10, 10 + prompt_len)), SamplingParams(**params), arrival=0,
                   eos_token_ids=[EOS, END_OF_TURN])
    seq.output_token_ids = list(output)
    seq.output_text = text
    return seq


def test_goes_on_without_a_reason_to_stop():
    assert check_stop(_seq([5, 6]), 0, grammar_finished=False, max_model_len=64) is None


def test_eos_stops_unless_ignored_or_before_min_tokens():
    assert check_stop(_seq([5, EOS]), 0, False, 64) == Stop("stop", by_eos=True)
    assert check_stop(_seq([5, EOS], ignore_eos=True), 0, False, 64) is None
    assert check_stop(_seq([5, EOS], min_tokens=3), 0, False, 64) is None
    assert check_stop(_seq([5, 6, EOS], min_tokens=3), 0, False, 64) == Stop("stop", by_eos=True)


def test_every_end_of_sequence_id_stops():
    assert check_stop(_seq([5, END_OF_TURN]), 0, False, 64) == Stop("stop", by_eos=True)
    assert check_stop(_seq([5, END_OF_TURN], ignore_eos=True), 0, False, 64) is None


def test_a_stop_token_is_the_stop_reason():
    assert check_stop(_seq([5, 7], stop_token_ids=[7]), 0, False, 64) == Stop("stop", 7)
    assert check_stop(_seq([7, 5], stop_token_ids=[7]), 0, False, 64) is None  # only the last token counts


def test_a_stop_string_cuts_the_text_where_it_starts_or_ends():
    seq = _seq([5, 6], text="hello wor", stop=["lo w"])
    assert check_stop(seq, len("hello"), False, 64) == Stop("stop", "lo w", len("hel"))
    seq = _seq([5, 6], text="hello wor", stop=["lo w"], include_stop_str_in_output=True)
    assert check_stop(seq, len("hello"), False, 64) == Stop("stop", "lo w", len("hello w"))


def test_a_stop_string_is_searched_only_where_the_new_text_can_reach():
    # "ab" ended before the text this token added (which starts at 6): an earlier token's check saw it
    assert check_stop(_seq([5, 6], text="ab....xyz", stop=["ab"]), 6, False, 64) is None
    assert check_stop(_seq([5, 6], text="....axbyz", stop=["xb"]), 6, False, 64) == Stop("stop", "xb", 5)


def test_a_finished_grammar_stops_even_before_min_tokens():
    assert check_stop(_seq([5], min_tokens=4), 0, grammar_finished=True, max_model_len=64) == Stop("stop")


def test_length_from_max_tokens_or_the_model_length():
    assert check_stop(_seq([5, 6, 7], max_tokens=3), 0, False, 64) == Stop("length")
    assert check_stop(_seq([5, 6], max_tokens=3), 0, False, 64) is None
    assert check_stop(_seq([5, 6], prompt_len=6, max_tokens=8), 0, False, max_model_len=8) == Stop("length")


def test_it_changes_nothing():
    seq = _seq([5, EOS], text="hi stop there", stop=["stop"])
    before = copy.deepcopy(seq.__dict__)
    assert check_stop(seq, 0, True, 64) == Stop("stop", by_eos=True)
    assert seq.__dict__ == before
