"""Tools and reasoning on ``/v1/chat/completions``: the request's tool definitions checked (a bad one is a 400
naming the field), the messages and tools as the chat template takes them, the grammar that enforces
``tool_choice`` required or named (and starts after the reasoning), and the reply read back into reasoning,
content and tool calls. See docs/server.md, "Tools and reasoning"."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.tool_protocol import FunctionCall, NamedToolChoice, ToolCall
from hybridserve.options import DEFAULT_MAX_GRAMMAR_BYTES, GRAMMAR_LIMIT_FLAGS
from hybridserve.reasoning import ThinkTagReasoningParser
from hybridserve.structured_output.params import StructuredOutputsParams
from hybridserve.structured_output.tool_grammar import reply_grammar
from hybridserve.tool_parsers import TagRenderer, ToolCallDraft, ToolCallParser, ToolSpec

#: OpenAI's limit on a function name: letters, digits, underscores and dashes, at most 64
MAX_FUNCTION_NAME_CHARS = 64
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def tool_choice_of(request: Any) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (OpenAI's default: auto with tools, none without)."""
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return "named" if isinstance(choice, NamedToolChoice) else choice


def check_tools(request: Any, parser: ToolCallParser | None, template_takes_tools: bool,
                max_schema_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> list[ToolSpec]:
    """The request's tools, checked: 400s naming the field for a bad definition (a parameters schema longer than
    ``max_schema_bytes``, the grammar limit, included), a ``tool_choice`` that does not fit them, tools without
    ``--tool-call-parser`` or with a chat template that does not render them. Empty when no tools are in play
    (none given, or ``tool_choice`` "none")."""
    tools = request.tools or []
    choice = tool_choice_of(request)
    if request.tool_choice is not None and choice != "none" and not tools:
        raise APIError(400, f"tool_choice={_shown(request.tool_choice)} needs tools: the request has none",
                       param="tool_choice")
    specs = [_tool_spec(i, tool, max_schema_bytes) for i, tool in enumerate(tools)]
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise APIError(400, f"tools[{i}].function.name={spec.name!r} is a duplicate of tools[{seen[spec.name]}]: "
                                "tool names must be unique", param=f"tools[{i}].function.name")
        seen[spec.name] = i
    if choice == "named" and request.tool_choice.function.name not in seen:
        raise APIError(400, f"tool_choice.function.name={request.tool_choice.function.name!r} is not one of the "
                            f"tools: {', '.join(seen) or 'none'}", param="tool_choice")
    if choice == "none" or not specs:
        return []
    if parser is None:
        raise APIError(400, "tools need a tool-call parser, and this server runs without one: start it with "
                            "--tool-call-parser (hermes or granite)", param="tools")
    if not template_takes_tools:
        raise APIError(400, "this model's chat template does not render tools (it never reads the `tools` "
                            "variable), so the model would not see them: use a checkpoint whose chat template "
                            "supports tools", param="tools")
    return specs


def _shown(choice: Any) -> str:
    return json.dumps(choice.model_dump()) if isinstance(choice, NamedToolChoice) else repr(choice)


def _tool_spec(i: int, tool: Any, max_schema_bytes: int) -> ToolSpec:
    if tool.type != "function":
        raise APIError(400, f"tools[{i}].type={tool.type!r} is not supported: the only tool type is 'function'",
                       param=f"tools[{i}].type")
    fn = tool.function
    if fn is None:
        raise APIError(400, f"tools[{i}].function is required", param=f"tools[{i}].function")
    if not fn.name:
        raise APIError(400, f"tools[{i}].function.name is required (a non-empty string)",
                       param=f"tools[{i}].function.name")
    if len(fn.name) > MAX_FUNCTION_NAME_CHARS or not set(fn.name) <= _NAME_CHARS:
        raise APIError(400, f"tools[{i}].function.name={fn.name[:80]!r} is not valid: at most "
                            f"{MAX_FUNCTION_NAME_CHARS} letters, digits, underscores and dashes",
                       param=f"tools[{i}].function.name")
    parameters = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    size = len(json.dumps(parameters, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > max_schema_bytes:
        raise APIError(400, f"tools[{i}].function.parameters is {size} bytes, over the limit of {max_schema_bytes} "
                            f"bytes (max_grammar_bytes, set by {GRAMMAR_LIMIT_FLAGS['max_grammar_bytes']})",
                       param=f"tools[{i}].function.parameters")
    problem = schema_problem(parameters)
    if problem:
        raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON schema: {problem}",
                       param=f"tools[{i}].function.parameters")
    return ToolSpec(fn.name, parameters)


def schema_problem(schema: dict) -> str | None:
    """What the grammar engine finds wrong with a JSON schema (None if nothing)."""
    from hybridserve.structured_output.backend import llguidance_module, short_error

    llg = llguidance_module()
    error = llg.LLMatcher.validate_grammar("start: %json" + json.dumps(schema))
    return short_error(error).split("\n")[0] if error else None


#: the chat template's own arguments, which chat_template_kwargs may not set
RESERVED_TEMPLATE_ARGS = ("messages", "conversation", "tools", "add_generation_prompt", "tokenize", "chat_template",
                          "continue_final_message", "return_dict", "documents")


def template_kwargs(request: Any) -> dict[str, Any]:
    """The request's ``chat_template_kwargs``; a 400 naming one that sets the template's own arguments."""
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_ARGS:
            raise APIError(400, f"chat_template_kwargs.{key} is not allowed: it is set by the server (from the "
                                f"request's messages and tools); reserved: {', '.join(RESERVED_TEMPLATE_ARGS)}",
                           param="chat_template_kwargs")
    return dict(kwargs)


def template_tools(request: Any, specs: list[ToolSpec]) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's definitions as dicts), or None when none are in play."""
    if not specs:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def template_messages(request: Any) -> list[dict]:
    """The messages as chat templates read them: role and text content, an assistant's ``tool_calls`` with
    their arguments decoded (templates write them as JSON), a tool result's ``tool_call_id``."""
    out = []
    for i, m in enumerate(request.messages):
        try:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
        except ValueError as exc:
            raise APIError(400, f"messages[{i}]: {exc}", param="messages") from None
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(400, f"messages[{i}] has role 'tool' but no tool_call_id: a tool result names the call "
                                "it answers", param=f"messages[{i}].tool_call_id")
        if m.tool_calls:
            message["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(m.tool_calls)]
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def _template_call(i: int, j: int, call: ToolCall) -> dict:
    where = f"messages[{i}].tool_calls[{j}].function"
    if not call.function.name:
        raise APIError(400, f"{where}.name is required", param=f"{where}.name")
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        raise APIError(400, f"{where}.arguments is not valid JSON: it must be a JSON object's text",
                       param=f"{where}.arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def output_constraint(request: Any, specs: list[ToolSpec], response_format: StructuredOutputsParams | None,
                      parser: ToolCallParser | None, reasoning: ThinkTagReasoningParser | None,
                      reasoning_state: str, added_tokens: dict[str, int]) -> StructuredOutputsParams | None:
    """The request's output constraint: the tool-call grammar for ``tool_choice`` required or named, else its
    response_format (or other structured output field); with a reasoning parser, either starts after the
    reasoning. None if unconstrained."""
    choice = tool_choice_of(request)
    forced = choice in ("required", "named") and specs
    if forced and response_format is not None:
        raise APIError(400, f"tool_choice={_shown(request.tool_choice)} and a structured output field "
                            "(response_format, structured_outputs, guided_*) cannot be used together: a forced "
                            "tool call is already constrained", param="tool_choice")
    tag = TagRenderer(added_tokens)
    prefix = reasoning.grammar_prefix(reasoning_state, tag) if reasoning is not None else None
    if forced:
        assert parser is not None  # check_tools refused tools without a parser
        chosen = [s for s in specs if s.name == request.tool_choice.function.name] if choice == "named" else specs
        return StructuredOutputsParams(grammar=reply_grammar(
            "tool_calls", parser.grammar(chosen, request.parallel_tool_calls and choice == "required", tag),
            prefix))
    if response_format is None or prefix is None:
        return response_format
    return StructuredOutputsParams(grammar=reply_grammar(*_reply_rule(response_format), prefix))


def _reply_rule(spec: StructuredOutputsParams) -> tuple[str, str]:
    """A structured output constraint as a Lark rule ``reply`` (to follow the reasoning)."""
    kind, text = spec.key()
    if kind == "json":
        schema = json.loads(text)
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        return "reply", f"reply: %json{json.dumps(schema)}\n"
    if kind == "json_object":
        return "reply", 'reply: %json{"type": "object", "x-guidance": {"whitespace_flexible": false}}\n'
    if kind == "choice":
        return "reply", "reply: " + " | ".join(json.dumps(c) for c in json.loads(text)) + "\n"
    raise APIError(400, f"structured output of kind {kind!r} cannot follow a reasoning block (--reasoning-parser): "
                        "use response_format (json_schema or json_object) or a choice", param=kind)


@dataclass
class ReadReply:
    """A reply read back: its reasoning, its content and its tool calls (each with arguments as JSON text)."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCallDraft]


@dataclass
class ReplyReader:
    """How one request's output text is read: split into reasoning (``reasoning``, None: no parser) and reply,
    the reply into content and calls (``parser``, None: tools not in play)."""

    parser: ToolCallParser | None = None
    reasoning: ThinkTagReasoningParser | None = None
    reasoning_state: str = "after"
    #: special tokens' texts removed before reading (set by :meth:`keep_special_tags`)
    strip: tuple[str, ...] = ()

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags the parsers read."""
        tags = self.parser.tags if self.parser is not None else ()
        if self.reasoning is not None:
            tags += (self.reasoning.start_tag, self.reasoning.end_tag)
        return tags

    def keep_special_tags(self, special_texts: set[str]) -> bool:
        """Whether some tag is a special token, which the detokenizer would drop: then the output must be decoded
        with special tokens (``skip_special_tokens=False``), and the other special tokens' texts (EOS, ...) are
        removed here before reading."""
        if not any(tag in special_texts for tag in self.tags):
            return False
        self.strip = tuple(sorted(special_texts - set(self.tags), key=len, reverse=True))
        return True

    def read(self, text: str, final: bool) -> ReadReply:
        """Read ``text`` (the output so far; ``final``: all of it)."""
        for special in self.strip:
            text = text.replace(special, "")
        reasoning = None
        reply = text
        if self.reasoning is not None:
            split = self.reasoning.split(text, self.reasoning_state, final)
            reasoning, reply = split.reasoning, split.content
            if not split.ended:
                return ReadReply(reasoning, "", [])
        if self.parser is None:
            return ReadReply(reasoning, reply, [])
        parsed = self.parser.parse(reply, final)
        return ReadReply(reasoning, parsed.content, parsed.calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reply_tool_calls(calls: list[ToolCallDraft]) -> list[ToolCall]:
    """The complete calls of a final reply in OpenAI's shape."""
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
