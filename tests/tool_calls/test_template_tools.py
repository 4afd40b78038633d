"""Which chat templates render tools (the server refuses tools for one that does not), and the shipped
model's template."""

from __future__ import annotations

from hybridserve.default_model import default_model_path
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker, _template_reads
from tests.server.server_utils import CHAT_TEMPLATE
from tests.server.tool_checkpoint import GRANITE_TEMPLATE, HERMES_TEMPLATE


def test_templates_that_read_tools_are_told_apart():
    assert _template_reads(HERMES_TEMPLATE, "tools")
    assert _template_reads(GRANITE_TEMPLATE, "tools")
    assert not _template_reads(CHAT_TEMPLATE, "tools")
    assert _template_reads({"default": CHAT_TEMPLATE, "tool_use": HERMES_TEMPLATE}, "tools")
    assert not _template_reads("{% set tools = [] %}{{ tools }}", "tools")  # set by itself: not the variable


def test_the_shipped_model_template_does_not_render_tools():
    worker = TokenizerWorker(default_model_path(), 256)
    try:
        assert worker.has_chat_template and not worker.chat_template_takes_tools
    finally:
        worker.close()
