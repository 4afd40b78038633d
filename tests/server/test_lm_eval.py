"""lm-evaluation-harness against ``hybridserve serve``, checked against lm-eval's own ``hf`` backend.

Two tiny local tasks (YAML + jsonl written to a tmp dir, nothing downloaded): a ``multiple_choice``
one (loglikelihood requests: completions with ``echo``, ``logprobs`` and one token) and a
``generate_until`` one (greedy). The server (``local-completions``, token-id requests, tokenizer =
the checkpoint's) and HF transformers in float32 on the CPU (``hf``) must give the same per-sample
loglikelihoods, the same accuracy and the same greedy generations.

Tolerance: both sides compute float32 log-softmaxes of one float32 checkpoint, only with different
kernels (ours vs HF's reference Mamba2 scan and attention), which differ by a few 1e-6 per token
logprob here (|logprob| <= ~20); a continuation has at most ~12 tokens, so its summed loglikelihood
stays well under 1e-4 apart, while a real bug (an off-by-one position, a missing token, another
model's logits) moves it by ~1 or more.
"""

from __future__ import annotations

import json

import pytest

from tests.server.server_utils import ServerProcess, make_checkpoint

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api,hf]==0.4.13')")

MODEL = "tiny-bamba"
ABS_TOL = 1e-4

MC_DOCS = [
    {"question": "The quick brown", "choices": [" fox", " dog", " cat"], "label": 0},
    {"question": "Hello world! How are", "choices": [" you today?", " we", " they?"], "label": 0},
    {"question": "Once upon a time there was", "choices": [" a small model", " Paris", " the lazy dog."], "label": 1},
    {"question": "user: what is the capital of France? assistant:", "choices": [" Paris", " London"], "label": 0},
    {"question": "", "choices": ["The quick", "Hello"], "label": 1},  # empty context: lm-eval prepends EOS
    {"question": "jumps over", "choices": [" the lazy dog.", " the fox"], "label": 0},
]
GEN_DOCS = [{"prompt": "The quick brown fox"}, {"prompt": "Hello world! How"}, {"prompt": "Once upon a time"},
            {"prompt": "capital of"}]

MC_YAML = """task: hs_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_YAML = """task: hs_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: ""
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def greedy_docs(ckpt: str) -> list[dict]:
    """Multiple-choice docs whose right choice is the model's own greedy next token (found with HF), so that
    lm-eval's ``is_greedy`` is True for it; only contexts where context + choice tokenizes as the two apart."""
    import torch
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_model

    tok = AutoTokenizer.from_pretrained(ckpt)
    docs = []
    for context in ("The quick brown fox", "Hello world!", "Once upon a time", "what is the capital", "small"):
        ids = tok.encode(context)
        with torch.no_grad():
            greedy = int(hf_model(ckpt)(torch.tensor([ids])).logits[0, -1].argmax())
        choice = tok.decode([greedy])
        if choice.strip() and tok.encode(context + choice) == ids + [greedy]:
            docs.append({"question": context, "choices": [" the", choice], "label": 1})
    return docs


def write_tasks(root, ckpt: str) -> str:
    """The two tasks' YAMLs and jsonl datasets in ``root / "tasks"`` (the folder to include)."""
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs, yaml in (("mc", MC_DOCS + greedy_docs(ckpt), MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return str(tasks)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    ckpt = make_checkpoint(str(root / "ckpt"))
    server = ServerProcess(ckpt, str(root / "server.log"), "--served-model-name", MODEL, "--max-model-len", "256",
                           "--cache-memory", "32MiB")
    with pytest.MonkeyPatch.context() as env:  # no hub: datasets and huggingface_hub read these at import
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        try:
            server.wait_healthy()
            yield ckpt, server, write_tasks(root, ckpt)
        finally:
            server.stop()


def _evaluate(model: str, model_args: dict, tasks_dir: str, task: str, chat: bool = False,
              batch_size: int = 1) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=batch_size,
                                   task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                   log_samples=True, bootstrap_iters=0, random_seed=0, apply_chat_template=chat)


def _server_args(ckpt: str, server: ServerProcess) -> dict:
    return {"model": MODEL, "base_url": server.url + "/v1/completions", "tokenizer": ckpt,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}


def _hf_args(ckpt: str) -> dict:
    return {"pretrained": ckpt, "dtype": "float32", "device": "cpu"}


def _by_doc(result: dict, task: str) -> dict[int, list]:
    return {s["doc_id"]: s["resps"] for s in result["samples"][task]}


def test_multiple_choice_matches_hf_backend(setup):
    ckpt, server, tasks = setup
    ours = _evaluate("local-completions", _server_args(ckpt, server), tasks, "hs_tiny_mc", batch_size=4)  # 4 prompts
    ref = _evaluate("hf", _hf_args(ckpt), tasks, "hs_tiny_mc")
    got, want = _by_doc(ours, "hs_tiny_mc"), _by_doc(ref, "hs_tiny_mc")
    assert sorted(got) == sorted(want) and len(want) > len(MC_DOCS)
    for doc_id, resps in want.items():
        assert len(got[doc_id]) == len(resps) >= 2
        for (ll_got, greedy_got), (ll_want, greedy_want) in zip((r[0] for r in got[doc_id]),
                                                                (r[0] for r in resps)):
            assert ll_got < 0 and abs(ll_got - ll_want) < ABS_TOL, (doc_id, ll_got, ll_want)
            assert greedy_got == greedy_want, doc_id
    assert any(r[0][1] for resps in want.values() for r in resps), "no greedy choice: is_greedy went untested"
    acc = ours["results"]["hs_tiny_mc"]["acc,none"]
    assert acc == ref["results"]["hs_tiny_mc"]["acc,none"]


def test_generate_until_matches_hf_backend(setup):
    ckpt, server, tasks = setup
    ours = _by_doc(_evaluate("local-completions", _server_args(ckpt, server), tasks, "hs_tiny_gen"), "hs_tiny_gen")
    ref = _by_doc(_evaluate("hf", _hf_args(ckpt), tasks, "hs_tiny_gen"), "hs_tiny_gen")
    assert sorted(ours) == sorted(ref) == list(range(len(GEN_DOCS)))
    assert any(ref[d][0][0] for d in ref), "the reference generated nothing: the comparison would be empty"
    for doc_id in ref:
        assert ours[doc_id][0][0] == ref[doc_id][0][0], doc_id


def test_chat_generate_until_matches_hf_backend(setup):
    """``local-chat-completions``: the server renders the chat template as lm-eval's hf backend does."""
    ckpt, server, tasks = setup
    args = {"model": MODEL, "base_url": server.url + "/v1/chat/completions", "num_concurrent": 1, "max_retries": 1}
    ours = _by_doc(_evaluate("local-chat-completions", args, tasks, "hs_tiny_gen", chat=True), "hs_tiny_gen")
    ref = _by_doc(_evaluate("hf", _hf_args(ckpt), tasks, "hs_tiny_gen", chat=True), "hs_tiny_gen")
    assert sorted(ours) == sorted(ref) == list(range(len(GEN_DOCS)))
    assert any(ref[d][0][0] for d in ref), "the reference generated nothing: the comparison would be empty"
    for doc_id in ref:
        assert ours[doc_id][0][0] == ref[doc_id][0][0], doc_id
