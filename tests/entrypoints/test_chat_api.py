"""``LLM.chat``: conversations rendered by the chat template, then generated like token-id prompts."""

import pytest

from hybridserve import LLM, SamplingParams

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_progress_bar=False)  # the shipped model, which has a chat template


def test_chat_equals_generate_on_the_rendered_template(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2)
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = llm.generate([{"prompt_token_ids": list(ids)}], params)[0].outputs[0]
    got = llm.chat(CONVERSATION, params)
    assert len(got) == 1 and got[0].prompt_token_ids == list(ids)
    assert got[0].outputs[0].token_ids == want.token_ids and got[0].outputs[0].text == want.text


def test_chat_batch_in_order_with_per_conversation_params(llm):
    second = [{"role": "user", "content": "Say something else."}]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=9)]
    outs = llm.chat([CONVERSATION, second], params)
    assert [len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(outs, params)] == [True, True]
    alone = llm.chat(second, params[1])[0]
    assert outs[1].prompt_token_ids == alone.prompt_token_ids
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_chat_template_override_and_continue_final_message(llm):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer = llm.get_tokenizer()
    out = llm.chat(CONVERSATION, SamplingParams(max_tokens=2), chat_template=template, add_generation_prompt=False)
    rendered = "<system>You are terse.\n<user>Tell me a story.\n"
    assert out[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    partial = CONVERSATION + [{"role": "assistant", "content": "Once upon"}]
    cont = llm.chat(partial, SamplingParams(max_tokens=2), add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(cont[0].prompt_token_ids).rstrip().endswith("Once upon")


def test_chat_bad_input_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="cannot be combined"):
        llm.chat(CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    for bad in ([], "hello", [["not a dict"]], [CONVERSATION, []]):
        with pytest.raises(ValueError, match="messages must be a conversation"):
            llm.chat(bad)
    with pytest.raises(ValueError, match="conversation 1: the chat template could not render"):
        llm.chat([CONVERSATION, CONVERSATION + [{"role": "assistant", "content": "x"}]],
                 chat_template="{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}x")
    assert not llm.engine.has_unfinished_requests()
