"""Speculative decoding: outputs equal decoding without it, whatever the drafts and however many are rejected."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.spec_decode.acceptance import Verification, verify
from hybridserve.spec_decode.config import parse_speculative_config
from hybridserve.spec_decode.ngram import NgramIndex, propose
from tests.checkpoints import make
from tests.prefix_utils import released_everything

# every state kind, and attention only: family -> what its recurrent layers are
STATE_KINDS = {
    "bamba": "Mamba2 + attention",
    "mamba2": "Mamba2 only",
    "mamba": "Mamba1 only",
    "qwen3_next": "gated delta net + attention",
    "minimax": "linear attention + attention",
    "lfm2": "short conv + attention",
    "kimi_linear": "Kimi delta attention + MLA latent pages",
    "lfm3": "short conv + sliding-window and full attention (window pages released)",
    "xlstm": "mLSTM only",
    "llama": "attention only",
}
#: float32 rounding of the same positions run as one chunk instead of one token at a time
LOGPROB_NOISE = 1e-4
#: draft every step however few drafts are accepted (and in batches of up to 8), so rollback runs constantly
ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "acceptance_floor": 0.0,
          "disable_by_batch_size": 8}


def _opts(**kw):
    return {"cache_memory": "8MiB", "enable_progress_bar": False, "max_num_batched_tokens": 64, **kw}


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short pattern (n-gram drafts find matches) with noise around it."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pattern = [rng.randrange(3, 120) for _ in range(rng.randrange(2, 6))]
        out.append([rng.randrange(3, 120) for _ in range(rng.randrange(0, 4))] + pattern * rng.randrange(2, 5))
    return out


def _assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            assert ca.finish_reason == cb.finish_reason and ca.text == cb.text
            for ea, eb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
                assert sorted(ea) == sorted(eb)
                for tid in ea:
                    assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=LOGPROB_NOISE)
                    assert ea[tid].rank == eb[tid].rank


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _equals_plain_batched_and_alone(path, speculative_config, prompts, params):
    """Outputs with speculation equal those without it, batched (mixed steps, eager) and one stream at a time
    (captured verification steps); some drafts were rejected, and nothing is left held. Returns the engine."""
    want = _generate(LLM(path, **_opts()), prompts, params)
    spec = LLM(path, speculative_config=speculative_config, **_opts())
    _assert_same(_generate(spec, prompts, params), want)
    for p, w in zip(prompts, want):
        _assert_same(_generate(spec, [p], params), [w])
    stats = spec.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert released_everything(spec.engine)
    return spec.engine


@pytest.fixture(scope="module")
def bamba(ckpt_dir):
    return make(ckpt_dir, "bamba")


@pytest.mark.parametrize("family", list(STATE_KINDS))
def test_greedy_outputs_equal_decoding_without_speculation(ckpt_dir, family):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    _equals_plain_batched_and_alone(make(ckpt_dir, family), ALWAYS, _prompts(5, seed=1), params)


def test_mostly_accepted_drafts_give_the_same_tokens(bamba):
    """A prompt the model continues by repeating it: most drafts are accepted, some runs to the end."""
    plain = LLM(bamba, **_opts())
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # the model's own greedy continuation, repeated: its drafts are what it generates
    seed_prompt = [5, 17, 33]
    own = _generate(plain, [seed_prompt], params)[0].outputs[0].token_ids
    prompt = seed_prompt + own
    spec = LLM(bamba, speculative_config=ALWAYS, **_opts())
    _assert_same(_generate(spec, [prompt], params), _generate(plain, [prompt], params))
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert released_everything(spec.engine)


@pytest.mark.parametrize("family", list(STATE_KINDS))
def test_verification_is_captured_and_matches_eager(ckpt_dir, family):
    path = make(ckpt_dir, family)
    spec = LLM(path, speculative_config=ALWAYS, **_opts())
    eager = LLM(path, speculative_config=ALWAYS, enforce_eager=True, **_opts())
    assert spec.engine.runner.captured_steps and not eager.engine.runner.captured_steps
    assert spec.engine.cpu_fast_paths.as_dict()["verify"] == {"captured": True, "reason": None}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    for prompt in _prompts(3, seed=2):
        got, want = _generate(spec, [prompt], params)[0].outputs[0], _generate(eager, [prompt], params)[0].outputs[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}  # bit for bit


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7])
def test_max_tokens_and_stops_inside_an_accepted_run(bamba, max_tokens):
    plain = LLM(bamba, **_opts())
    spec = LLM(bamba, speculative_config=ALWAYS, **_opts())
    prompt = [5, 17, 33]
    own = _generate(plain, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    prompt = prompt + own.outputs[0].token_ids  # drafts will be accepted
    stop_id = own.outputs[0].token_ids[3]
    for params in (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=2)):
        _assert_same(_generate(spec, [prompt], params), _generate(plain, [prompt], params))
    assert released_everything(spec.engine)


def test_penalties_biases_and_min_tokens_apply_at_every_verified_position(bamba):
    """Row j of a verification is adjusted as decoding would adjust it after the first j drafts: the
    repetition, presence and frequency penalties see those drafts, min_tokens counts them."""
    plain, spec = LLM(bamba, **_opts()), LLM(bamba, speculative_config=ALWAYS, **_opts())
    prompt = [5, 17, 33]
    own = _generate(plain, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    prompt = prompt + own.outputs[0].token_ids  # drafts will be proposed and mostly accepted
    favourite = own.outputs[0].token_ids[2]
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.3),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={favourite: -3.0}),
             SamplingParams(temperature=0, max_tokens=24, min_tokens=6, stop_token_ids=[own.outputs[0].token_ids[1]]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.1, logprobs=3)]
    before = spec.engine.speculator.stats.num_drafts
    for params in cases:
        _assert_same(_generate(spec, [prompt], params), _generate(plain, [prompt], params))
    assert spec.engine.speculator.stats.num_drafts > before
    assert released_everything(spec.engine)


@pytest.mark.parametrize("kind", ["regex", "json", "choice"])
def test_structured_output_masks_every_verified_position(kind):
    """Row j of a verification is masked by the grammar as after the first j drafts (llguidance advanced
    through them and rolled back); drafts the grammar refuses are rejected; outputs equal decoding without
    speculation, and the grammar's own state ends where the emitted tokens put it."""
    from hybridserve import StructuredOutputsParams

    plain = LLM(**_opts(cache_memory="32MiB"))
    spec = LLM(speculative_config=ALWAYS, **_opts(cache_memory="32MiB"))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 60},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    sentence = r"(I am sure I shall be very much in love with (him|her)\. )+"
    structured = {"regex": StructuredOutputsParams(regex=sentence),
                  "json": StructuredOutputsParams(json=schema),
                  "choice": StructuredOutputsParams(choice=["I am sure I shall be very much in love with him. " * 3,
                                                            "no"])}[kind]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured, logprobs=2)
    prompt = "Once upon a time or two, and that I am sure I shall be very much in love with him. I am sure"
    _assert_same(spec.generate([prompt], params, use_tqdm=False), plain.generate([prompt], params, use_tqdm=False))
    assert spec.engine.speculator.stats.num_drafts > 0
    assert released_everything(spec.engine)


def test_stop_strings_inside_an_accepted_run():
    plain, spec = LLM(**_opts()), LLM(speculative_config=ALWAYS, **_opts())  # the shipped model, with a tokenizer
    text = _generate(plain, [plain.get_tokenizer().encode("Once upon a time")],
                     SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    _assert_same(spec.generate(["Once upon a time"], params, use_tqdm=False),
                 plain.generate(["Once upon a time"], params, use_tqdm=False))


def test_n_greater_than_one_and_seeded_sampling_complete(bamba):
    spec = LLM(bamba, speculative_config=ALWAYS, **_opts())
    plain = LLM(bamba, **_opts())
    greedy = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(2, seed=3)
    _assert_same(_generate(spec, prompts, greedy), _generate(plain, prompts, greedy))
    sampled = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    first = _generate(spec, prompts, sampled)
    again = _generate(spec, prompts, sampled)
    for a, b in zip(first, again):  # a seeded request is reproducible with speculation too
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(len(c.token_ids) == 16 for c in a.outputs)
    assert released_everything(spec.engine)


@pytest.mark.parametrize("family", ["bamba", "llama"])
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_preemption_during_speculation_gives_the_same_outputs(ckpt_dir, family, drafter):
    path = make(ckpt_dir, family)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(6, seed=4)
    want = _generate(LLM(path, **_opts()), prompts, params)
    config = ALWAYS if drafter == "ngram" else {"model": make(ckpt_dir, "bamba", dtype=torch.bfloat16),
                                                 "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    # the draft model's layers make pages and slots larger: a smaller pool preempts as often
    tight = LLM(path, speculative_config=config, **_opts(cache_memory="160KiB" if drafter == "ngram" else "120KiB"))
    got = _generate(tight, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.speculator.stats.num_drafts > 0
    _assert_same(got, want)
    assert released_everything(tight.engine)


def test_aborts_mid_verification_release_everything(bamba):
    spec = LLM(bamba, speculative_config=ALWAYS, **_opts())
    engine = spec.engine
    for i, prompt in enumerate(_prompts(4, seed=5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    verifying = 0
    for _ in range(40):
        engine.step()
        verifying += sum(1 for s in engine.scheduler.running if s.spec_slot is not None)
        if verifying >= 3:
            break
    assert verifying >= 3
    engine.abort_request("r0")
    engine.abort_all()
    assert released_everything(engine)


def test_drafting_backs_off_when_drafts_are_rejected(bamba):
    spec = LLM(bamba, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                          "acceptance_floor": 0.99}, **_opts())
    _generate(spec, _prompts(1, seed=6), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    stats = spec.engine.speculator.stats
    assert stats.num_backoffs > 0
    assert stats.num_drafts < 60 // 2  # it stopped drafting for whole stretches


def test_the_automatic_batch_limit_comes_from_the_captured_steps(bamba):
    spec = LLM(bamba, speculative_config={**ALWAYS, "disable_by_batch_size": "auto"}, **_opts())
    engine = spec.engine
    assert engine.spec_config.disable_by_batch_size is None
    assert engine.speculator.batch_limit in engine.runner.captured_decode.graphs  # a timed bucket
    eager = LLM(bamba, speculative_config={**ALWAYS, "disable_by_batch_size": "auto"}, enforce_eager=True,
                **_opts()).engine
    assert eager.speculator.batch_limit == eager.spec_config.max_batch_size  # nothing to time
    assert parse_speculative_config({"method": "ngram", "disable_by_batch_size": "auto"}).disable_by_batch_size is None


def test_no_drafting_beside_large_batches(bamba):
    spec = LLM(bamba, speculative_config={**ALWAYS, "disable_by_batch_size": 2}, **_opts())
    _generate(spec, _prompts(4, seed=7), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert spec.engine.speculator.stats.num_drafts == 0


# ------------------------------------------------------------------------------ the rejection rule
def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` (V,) against ``probs`` (V,) (cells with p > 0)."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("draft_kind", ["deterministic", "draft_model"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_keep_the_target_distribution(draft_kind, temperature):
    """The first and second tokens a verification emits follow the target's distribution exactly."""
    vocab, trials = 6, 6000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5  # rows: after the pending token, after draft 1, after draft 2
    params = SamplingParams(temperature=temperature)
    p = (logits / temperature).softmax(-1)
    q = torch.randn(2, vocab).softmax(-1)  # a draft model's (poor) distribution
    gen, default = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    draft_gen = torch.Generator().manual_seed(3)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    first_seen_draft1 = 0
    draft_1 = int(p[0].argmin())  # a deterministic draft that is mostly wrong
    for _ in range(trials):
        if draft_kind == "deterministic":
            drafts, probs = [draft_1, 2], None
        else:
            drafts = [int(torch.multinomial(q[0], 1, generator=draft_gen)), int(torch.multinomial(q[1], 1,
                                                                                                   generator=draft_gen))]
            probs = q
        verdict = verify(logits, [Verification(drafts, params, gen, probs)], default)[0]
        first[verdict.tokens[0]] += 1
        if verdict.tokens[0] == drafts[0] and len(verdict.tokens) > 1:
            first_seen_draft1 += 1
            second[verdict.tokens[1]] += 1
    assert _chi_square_pvalue(first, p[0]) > 1e-3
    # the token after an accepted first draft follows the target's row after that draft
    if first_seen_draft1 > 200:
        assert _chi_square_pvalue(second, p[1]) > 1e-3


def test_greedy_verdicts():
    logits = torch.full((4, 8), -5.0)
    for row, token in enumerate([3, 4, 5, 6]):
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0)
    gen = torch.Generator()
    all_ok, first_bad, second_bad = verify(torch.cat([logits, logits[:3], logits[:2]]), [
        Verification([3, 4, 5], greedy, None), Verification([7, 4], greedy, None), Verification([3], greedy, None)],
        gen)
    assert (all_ok.tokens, all_ok.num_accepted, all_ok.rows) == ([3, 4, 5, 6], 3, [0, 1, 2, 3])
    assert (first_bad.tokens, first_bad.num_accepted, first_bad.rows) == ([3], 0, [4])
    assert (second_bad.tokens, second_bad.num_accepted) == ([3, 4], 1)


# ------------------------------------------------------------------------------ drafting and config
def test_ngram_proposals_follow_the_latest_longest_match():
    index = NgramIndex(2)
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]
    assert propose(tokens, index, 3, 4) == [4, 7, 5]  # "1 2" last seen before "4 7 5"
    tokens = [8, 1, 2, 3, 0, 6, 1, 2, 5, 8, 1, 2]
    assert propose(tokens, NgramIndex(2), 2, 4) == [3, 0]  # "8 1 2" beats the later "1 2"
    assert propose([1, 2, 3, 4], NgramIndex(2), 3, 4) == []  # nothing repeats
    index = NgramIndex(1)
    grown = [4, 5, 4]
    assert propose(grown, index, 2, 3) == [5, 4]
    grown += [6, 4]
    assert propose(grown, index, 2, 3) == [6, 4]  # the index grows with the tokens


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "method='eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 16}, "at most 15"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds prompt_lookup_max"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "mtp", "model": "x"}, "only for a draft model"),
    ({"method": "ngram", "lookahead": 3}, "unknown keys ['lookahead']"),
    ('{"method": "ngram",', "not valid JSON"),
    ([1], "must be a dict"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=None) as err:
        parse_speculative_config(value)
    assert message in str(err.value)


def test_config_forms():
    assert parse_speculative_config(None) is None
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == ("ngram", 3, 5, 2)
    assert parse_speculative_config({"model": "/some/dir"}).method == "draft_model"


# ------------------------------------------------------------------------------ draft models
#: target -> a drafter of another family with random weights: its drafts are mostly wrong
POOR_DRAFTERS = {"bamba": "mamba2", "mamba": "llama", "qwen3_next": "lfm2", "minimax": "mamba", "lfm2": "bamba",
                 "llama": "qwen3_next", "mamba2": "minimax"}


@pytest.mark.parametrize("family", list(POOR_DRAFTERS))
def test_a_poor_draft_model_gives_the_outputs_of_decoding_without_it(ckpt_dir, family):
    drafter = make(ckpt_dir, POOR_DRAFTERS[family], seed=9)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    _equals_plain_batched_and_alone(make(ckpt_dir, family), {"model": drafter, "num_speculative_tokens": 3,
                                                             "acceptance_floor": 0.0,
                                     "disable_by_batch_size": 8}, _prompts(4, seed=8), params)


def test_the_target_as_its_own_draft_model_is_always_right(bamba):
    """Drafts from the same weights are the target's own greedy tokens: every one is accepted, and the
    draft model's layers (its own KV and state in the shared pool) stay in step with the target's."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(3, seed=10)
    want = _generate(LLM(bamba, **_opts()), prompts, params)
    spec = LLM(bamba, speculative_config={"model": bamba, "num_speculative_tokens": 4}, **_opts())
    assert spec.engine.draft_model.runner.captured_decode is not None
    for p, w in zip(prompts, want):
        _assert_same(_generate(spec, [p], params), [w])
    stats = spec.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    layers = spec.cache_layout()["layers"]
    assert len(layers) == 2 * len(LLM(bamba, **_opts()).cache_layout()["layers"])  # its layers are in the pool


def test_a_draft_model_with_another_vocabulary_is_refused(bamba, ckpt_dir):
    other = make(ckpt_dir, "llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 128"):
        LLM(bamba, speculative_config={"model": other}, **_opts())


def test_sampling_with_a_draft_model_completes_and_is_reproducible(bamba, ckpt_dir):
    drafter = make(ckpt_dir, "mamba2", seed=9)
    spec = LLM(bamba, speculative_config={"model": drafter, "num_speculative_tokens": 3, "acceptance_floor": 0.0,
                                     "disable_by_batch_size": 8},
               **_opts())
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    prompts = _prompts(3, seed=11)
    first, again = _generate(spec, prompts, params), _generate(spec, prompts, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert spec.engine.speculator.stats.num_drafts > 0
    assert released_everything(spec.engine)


def test_a_near_copy_draft_model_stays_in_step_after_rejections(bamba, ckpt_dir):
    """The target's weights in bfloat16 as drafter: nearly every draft is right, a few are not. Were the
    draft model's state or KV out of step after a rollback, its drafts would go wrong from there on."""
    drafter = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    spec = LLM(bamba, speculative_config={"model": drafter, "num_speculative_tokens": 4, "acceptance_floor": 0.0,
                                     "disable_by_batch_size": 8},
               **_opts())
    plain = LLM(bamba, **_opts())
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for p in _prompts(6, seed=3):
        _assert_same(_generate(spec, [p], params), _generate(plain, [p], params))
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks happened
    assert stats.num_accepted_tokens > 0.85 * stats.num_draft_tokens


# ------------------------------------------------------------------------------ MTP heads
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "nemotron_h_latent"])
def test_mtp_drafts_give_the_outputs_of_decoding_without_them(ckpt_dir, family):
    from tests.checkpoints import add_mtp_weights

    path = add_mtp_weights(make(ckpt_dir, family), num_layers=1, seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    _equals_plain_batched_and_alone(path, {"method": "mtp", "num_speculative_tokens": 3, "acceptance_floor": 0.0,
                                     "disable_by_batch_size": 8},
                                    _prompts(4, seed=12), params)


def test_mtp_on_a_checkpoint_without_mtp_weights_is_refused(bamba, ckpt_dir):
    with pytest.raises(ValueError, match="no multi-token-prediction"):
        LLM(bamba, speculative_config={"method": "mtp"}, **_opts())
    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(make(ckpt_dir, "qwen3_next"), speculative_config={"method": "mtp"}, **_opts())


# ------------------------------------------------------------------------------ the pool and the planner
@pytest.mark.parametrize("kind", ["ngram", "draft_model", "mtp"])
def test_the_planner_counts_what_speculation_adds(ckpt_dir, kind):
    """``hybridserve plan --speculative-config`` lays out the drafter's layers and counts the verification
    slot exactly as the engine does."""
    from hybridserve.planning.plan_config import PlanConfig
    from hybridserve.planning.planner import load_config, plan_cache
    from tests.checkpoints import add_mtp_weights

    target = make(ckpt_dir, "bamba")
    spec = {"ngram": {"method": "ngram"}, "draft_model": {"model": make(ckpt_dir, "mamba2", seed=9)},
            "mtp": {"method": "mtp"}}[kind]
    if kind == "mtp":
        target = add_mtp_weights(make(ckpt_dir, "qwen3_next"), num_layers=1, seed=4)
    engine = LLM(target, speculative_config=spec, **_opts()).engine
    plan = plan_cache(load_config(target), PlanConfig(cache_memory="8MiB", speculative_config=spec),
                      engine.max_model_len)
    layout = engine.cache_layout()
    assert plan.to_dict()["layers"] == layout["layers"]
    assert (plan.layout.page_bytes, plan.layout.slot_bytes) == (layout["page_bytes"], layout["slot_bytes"])
    assert plan.summary()["speculation"] == layout["speculation"]
    assert layout["speculation"]["drafter_cache_layers"] == {"ngram": 0, "draft_model": 3, "mtp": 1}[kind]
    assert plan.max_concurrent_sequences == layout["max_concurrent_sequences"]
    assert layout["speculation"]["verification_slot_bytes"] == layout["slot_bytes"]


def test_verification_slots_give_way_to_requests(bamba):
    """A pool too small for every sequence's verification slot: requests still run without preemption beyond
    what the plain engine needs, and the outputs are the plain ones."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(6, seed=13)
    plain = LLM(bamba, **_opts(cache_memory="160KiB"))
    want = _generate(plain, prompts, params)
    spec = LLM(bamba, speculative_config=ALWAYS, **_opts(cache_memory="160KiB"))
    _assert_same(_generate(spec, prompts, params), want)
    assert spec.engine.scheduler.num_preemptions <= plain.engine.scheduler.num_preemptions
    assert released_everything(spec.engine)


def test_mtp_drafts_are_the_heads_predictions(ckpt_dir):
    """Each step's MTP drafts are the head's own predictions as a plain-PyTorch reference computes them from
    the checkpoint (tests/models/test_mtp_head.py) over the whole sequence: draft 1 from the target's hidden state
    before the pending token and the pending token itself, draft 2 from the head's output and draft 1."""
    from tests.checkpoints import add_mtp_weights
    from tests.models.test_mtp_head import BLOCK, _group, _load, _pool, _reference

    path = add_mtp_weights(make(ckpt_dir, "qwen3_next"), num_layers=1, seed=4)
    spec = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "acceptance_floor": 0.0,
                                     "disable_by_batch_size": 8},
               **_opts())
    engine = spec.engine
    prompt = _prompts(1, seed=14)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    records = []  # (token count, drafts) after each step
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished and seq.spec is not None and seq.spec.mtp_base == seq.num_tokens and seq.spec.mtp_drafts:
            records.append((seq.num_tokens, list(seq.spec.mtp_drafts)))
    tokens = seq.all_token_ids
    assert len(records) >= 5
    # the reference: the target over the whole sequence in one prefill, then the head's reference over it
    _, target, _head = _load(path)
    pool = _pool(target, _head)
    n = len(tokens)
    got = pool.allocate(-(-n // BLOCK), 1 if pool.layout.has_state else 0)
    tables = torch.tensor([got.pages], dtype=torch.int64)
    slots = torch.tensor(got.slots, dtype=torch.int64) if got.slots else None
    positions = torch.arange(n)
    from hybridserve.forward_batch import ForwardBatch

    batch = ForwardBatch(tables[0][positions // BLOCK] * BLOCK + positions % BLOCK, None,
                         _group([(0, n)], 0, tables, slots),
                         pool.layer_caches)
    ids = torch.tensor(tokens)
    with torch.inference_mode():
        hidden = target(ids, positions, batch)  # (n, H)
    checked = 0
    for count, drafts in records:
        rows = _reference(path, ids[1:count], hidden[:count - 1], 0)  # row p predicts the token at p + 2
        logits = target.compute_logits(rows[-1:])[0]
        top2 = logits.topk(2).values
        if float(top2[0] - top2[1]) > 1e-3:  # not a near-tie: the argmax is well defined
            assert drafts[0] == int(logits.argmax())
            checked += 1
        if len(drafts) > 1:  # draft 2: the head on its own output and draft 1, one position on
            chain = _reference(path, torch.cat([ids[1:count], torch.tensor(drafts[:1])]),
                               torch.cat([hidden[:count - 1], rows[-1:]]), 0)
            logits = target.compute_logits(chain[-1:])[0]
            top2 = logits.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:
                assert drafts[1] == int(logits.argmax())
                checked += 1
    assert checked >= len(records)


# ------------------------------------------------------------------------------ decode rules in a verification
def _run_staggered(engine, prompts, params) -> dict[str, list[int]]:
    """Requests arriving one every other step: prompt chunks share steps with verifications."""
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for o in engine.step():
            out[o.request_id] = o.outputs[0].token_ids
        step += 1
    return out


@pytest.mark.parametrize("family", ["zamba2", "falcon_h1", "granitemoehybrid", "bamba"])
def test_bfloat16_verifications_follow_the_decode_rule(ckpt_dir, family):
    """Zamba2, Falcon-H1 and Granite-4.0-H clamp dt in the prefill scan but not in the one-token step, as HF
    does: verifying generated tokens must follow the step's rule (bf16 shows any difference), also when a
    prompt chunk shares the step."""
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = _prompts(5, seed=1)
    kw = _opts(mamba_ssm_cache_dtype="float32")
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=ALWAYS, **kw)
    for p in prompts:
        _assert_same(_generate(spec, [p], params), _generate(plain, [p], params))
    staggered = _run_staggered(spec.engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    want = _run_staggered(plain.engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert staggered == want
    assert spec.engine.speculator.stats.num_drafts > 0


def test_int8_weights_with_speculation(ckpt_dir):
    """Weight quantization and speculation are independent: int8 weights with n-gram drafts and with a draft
    model (quantized too) give the int8 outputs without speculation."""
    path = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = _opts(quantization="int8", mamba_ssm_cache_dtype="float32")
    plain = LLM(path, **kw)
    for config in (ALWAYS, {"model": make(ckpt_dir, "mamba2", dtype=torch.bfloat16, seed=9),
                            "num_speculative_tokens": 3, "acceptance_floor": 0.0, "disable_by_batch_size": 8}):
        spec = LLM(path, speculative_config=config, **kw)
        assert spec.engine.cpu_fast_paths.as_dict()["weights"]["quantization"] == "int8"
        for p in _prompts(3, seed=15):
            _assert_same(_generate(spec, [p], params), _generate(plain, [p], params))
        assert spec.engine.speculator.stats.num_drafts > 0


@pytest.mark.parametrize("conv", ["auto", "int8"])
def test_8_bit_state_with_speculation(ckpt_dir, conv):
    """int8 temporal state (and int8 conv state) under n-gram speculation: the verification slots and the rollback
    copy codes, scales and exponents, and the greedy tokens are those without speculation. Not bit for bit: a
    verification runs its tokens as a chunk, which rounds a stored state once where decode steps round it once a
    token (so does a bf16 state: the exact comparisons above keep float32 state)."""
    path = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = _opts(mamba_ssm_cache_dtype="int8", mamba_cache_dtype=conv)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=ALWAYS, **kw)
    for p in _prompts(5, seed=1):
        got, want = _generate(spec, [p], params), _generate(plain, [p], params)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert spec.engine.speculator.stats.num_drafts > 0
    assert released_everything(spec.engine)
