"""A grammar whose output is an optional reasoning block, then a constrained reply (a tool call in a parser's
format, or JSON): the Lark text (llguidance's syntax) that a request's ``StructuredOutputsParams.grammar`` carries,
so it is compiled, limited and cached like any grammar."""

from __future__ import annotations


def reply_grammar(rule: str, definitions: str, prefix: tuple[str, str] | None) -> str:
    """The grammar ``start: <prefix expression> <rule>`` with ``definitions`` (which define ``rule``) and those
    of the prefix (``(expression, definitions)``, from a reasoning parser; None: the reply starts at once)."""
    head = f"{prefix[0]} {rule}" if prefix is not None else rule
    extra = prefix[1] if prefix is not None else ""
    return f"%llguidance {{}}\nstart: {head}\n{definitions}{extra}"
