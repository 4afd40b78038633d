"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``); standard library only, so
``hybridserve.sampling_params`` can import it without the grammar engine."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

#: the constraint fields, exactly one of which a request sets
FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or a JSON string), ``json_object=True`` (any JSON
    object), ``regex`` (the whole output matches it), ``choice`` (the output is one of these strings),
    ``grammar`` (a Lark or GBNF/EBNF grammar, as llguidance reads it). Checked when made (and again by the
    engine): anything else raises ValueError naming the field. The grammar itself is compiled by the engine
    (or, for the server, before the request reaches it), within the engine's grammar limits."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    #: the grammar compiled for this constraint (``structured_output.compiler.CompiledGrammar``), attached by the
    #: first compile so the engine and later requests sharing these params do not compile it again
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless exactly one field is set, to a value of its type."""
        chosen = [name for name in FIELDS if self._is_set(name)]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(FIELDS)}; got {got}")
        name = chosen[0]
        value = getattr(self, name)
        if name == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object (a dict or its JSON text), "
                                 f"got {type(parsed).__name__}")
        elif name == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be True or None, got {value!r}")
        elif name == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r:.200}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.200}")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    @property
    def kind(self) -> str:
        """The field that is set: one of ``FIELDS``."""
        return next(name for name in FIELDS if self._is_set(name))

    def key(self) -> tuple[str, str]:
        """``(kind, text)``: equal for equal constraints (what compiled grammars are cached under)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else _json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            text = _json.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text
