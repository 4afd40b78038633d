"""A streamed chat reply read as it grows: reasoning, content and tool calls as OpenAI's deltas (a call's
``index``, ``id``, ``type`` and ``name`` first, then its arguments in pieces). The text is re-read whole at each
step (``chat_tools.ReplyReader``), and only what is new is sent, so the pieces add up to the final reply."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.entrypoints.openai.chat_tools import ReplyReader, new_call_id
from hybridserve.entrypoints.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall


@dataclass
class ReplyDelta:
    """What is new since the last step (empty strings and list: nothing)."""

    reasoning: str
    content: str
    tool_calls: list[DeltaToolCall]

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


class ReplyStream:
    """What one streamed choice has sent so far; :meth:`advance` gives the next delta."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0
        self.calls: list[_SentCall] = []

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return bool(self.calls)

    def advance(self, new_text: str, final: bool) -> ReplyDelta:
        """Add ``new_text`` (the next piece of the output text) and return what can be sent now."""
        self.text += new_text
        read = self.reader.read(self.text, final)
        reasoning = read.reasoning or ""
        content = read.content or ""
        delta = ReplyDelta(reasoning[self.reasoning_sent:], content[self.content_sent:], [])
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        for index, call in enumerate(read.calls):
            if call.name is None:
                break  # a call's name comes first; the ones after it wait for it
            if index == len(self.calls):
                self.calls.append(_SentCall(new_call_id()))
                delta.tool_calls.append(DeltaToolCall(index=index, id=self.calls[index].id, type="function",
                                                      function=DeltaFunctionCall(name=call.name, arguments="")))
            sent = self.calls[index]
            piece = call.arguments[sent.arguments_sent:]
            if piece:
                sent.arguments_sent = len(call.arguments)
                delta.tool_calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))
        return delta
