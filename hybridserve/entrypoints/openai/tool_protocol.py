"""The request and response fields of tool calling and reasoning on ``/v1/chat/completions`` (OpenAI's shapes;
see docs/server.md, "Tools and reasoning"). Mixed into the chat classes of ``protocol.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    """A request part: an undeclared field is refused (a 400 naming it), never dropped."""

    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    """``tools[i].function``: its name, what it does, its parameters' JSON schema, and OpenAI's ``strict``
    (accepted either way: with ``tool_choice`` required or named the arguments always match the schema)."""

    name: str | None = None  # required: checked with a message naming the field (chat_tools.check_tools)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: str = "function"
    function: FunctionDefinition | None = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    type: str = "function"
    function: NamedFunction


class FunctionCall(_Strict):
    name: str | None = None
    arguments: str | None = None  # a JSON object's text


class ToolCall(_Strict):
    """A call in a reply, or in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolRequestFields(BaseModel):
    """What a chat request adds for tools (``tool_choice`` defaults to "auto" with tools, "none" without)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    #: extra variables for the chat template (vLLM's field), e.g. ``{"enable_thinking": true}``
    chat_template_kwargs: dict[str, Any] | None = None


class ToolMessageFields(BaseModel):
    """What a history message adds: an assistant's ``tool_calls``, a tool result's ``tool_call_id``, and an
    assistant's earlier ``reasoning_content`` (accepted; the chat template decides whether it is shown)."""

    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ToolResponseFields(BaseModel):
    """What a reply message adds: its reasoning (``--reasoning-parser``) and its calls."""

    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One streamed piece of a call: its ``index``; ``id``, ``type`` and ``name`` come first, alone, then its
    arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ToolDeltaFields(BaseModel):
    """What a streamed delta adds (absent from the JSON when unset: see protocol.DeltaMessage)."""

    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
