"""Tiny checkpoints whose chat templates render tools, written in the style of the published Qwen (JSON in
``<tool_call>`` tags) and Granite 3.x (``<|tool_call|>[...]``) templates, with the tags as added tokens."""

from __future__ import annotations

from tokenizers import AddedToken

from tests.checkpoints import bamba_config, build
from tests.server.server_utils import train_tokenizer

TAGS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>", "<|tool_call|>",
        "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]

#: Qwen style: the tools as JSON lines in the system turn, calls as <tool_call>{json}</tool_call>, tool results as
#: user turns; ``enable_thinking=True`` opens <think> at the end of the prompt
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}Functions you may call:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Each call: <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""

#: Granite 3.x style: an available_tools turn, calls as <|tool_call|>[{json}, ...], tool results as tool_response
GRANITE_TEMPLATE = """\
{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>
{{ tools | tojson }}<|end_of_text|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ m.content }}<|end_of_text|>
{% elif m.role == 'assistant' and m.tool_calls %}<|start_of_role|>assistant<|end_of_role|><|tool_call|>[
{%- for call in m.tool_calls %}{"name": {{ call.function.name | tojson }}, "arguments": \
{{ call.function.arguments | tojson }}}{{ ', ' if not loop.last }}{% endfor %}]<|end_of_text|>
{% else %}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}<|end_of_text|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"""


def tool_tokenizer(template: str, special: bool = False):
    """The test tokenizer with the tags added and ``template``: as Qwen's (added, not special tokens), or as
    special tokens (which decoding skips by default) with ``special``."""
    tokenizer = train_tokenizer(template)
    tokens = [AddedToken(t, special=special, normalized=False) for t in TAGS]
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    else:
        tokenizer.add_tokens(tokens)
    return tokenizer


def make_tool_checkpoint(path: str, template: str = HERMES_TEMPLATE, special: bool = False) -> str:
    """One tiny Bamba checkpoint whose chat template renders tools (its tags special tokens with ``special``)."""
    tokenizer = tool_tokenizer(template, special)
    build(bamba_config(vocab_size=len(tokenizer)), path)
    tokenizer.save_pretrained(path)
    return path
