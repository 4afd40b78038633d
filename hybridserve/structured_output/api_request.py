"""An OpenAI-API request's structured output fields as :class:`StructuredOutputsParams`: OpenAI's
``response_format``, vLLM's ``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. Works on the request's attributes (no pydantic or server import)."""

from __future__ import annotations

from typing import Any

from hybridserve.structured_output.params import FIELDS, StructuredOutputsParams

#: vLLM's older request fields -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class StructuredOutputRequestError(ValueError):
    """A bad structured output field of a request; ``param`` names it (for the 400 response)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The request's constraint, its fields checked (its grammar is compiled later, off the event loop: see
    ``compiler.py``), or None if it has none; StructuredOutputRequestError naming the field otherwise (also when
    it sets more than one such field)."""
    given = _given_fields(request)
    if not given:
        return None
    if len(given) > 1:
        raise StructuredOutputRequestError(given[1], f"only one of response_format (json_object / json_schema), "
                                                     f"structured_outputs, {', '.join(GUIDED_FIELDS)} may be set; "
                                                     f"got {' and '.join(given)}")
    param = given[0]
    try:
        if param == "response_format":
            params = _from_response_format(request.response_format)
        elif param == "structured_outputs":
            params = _from_object(request.structured_outputs)
        else:
            params = StructuredOutputsParams(**{GUIDED_FIELDS[param]: getattr(request, param)})
    except StructuredOutputRequestError:
        raise
    except ValueError as exc:
        raise StructuredOutputRequestError(param, in_api_terms(str(exc), param)) from None
    return params


def requested_field(request: Any) -> str:
    """The structured output field the request set (``response_format``, ``structured_outputs``, ``guided_*``)."""
    given = _given_fields(request)
    return given[0] if given else "structured_outputs"


def in_api_terms(message: str, param: str) -> str:
    """``message`` about ``structured_outputs.<field>`` reworded for the request field the client set."""
    if param == "structured_outputs":
        return message
    where = "response_format.json_schema.schema" if param == "response_format" else param
    for name in FIELDS:
        prefix = f"structured_outputs.{name}"
        if message.startswith(prefix):
            return where + message[len(prefix):]
    return f"{param}: {message}"


def _given_fields(request: Any) -> list[str]:
    given = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and _get(fmt, "type") != "text":
        given.append("response_format")
    if getattr(request, "structured_outputs", None):
        given.append("structured_outputs")
    given += [name for name in GUIDED_FIELDS if getattr(request, name, None) is not None]
    return given


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _from_response_format(fmt: Any) -> StructuredOutputsParams:
    kind = _get(fmt, "type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise StructuredOutputRequestError("response_format", f"response_format.type={kind!r} is not valid: it "
                                                              f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    spec = _get(fmt, "json_schema")
    schema = None if spec is None else (spec.get("schema") if isinstance(spec, dict) else spec.schema_)
    if schema is None:
        raise StructuredOutputRequestError("response_format", "response_format.json_schema.schema is required "
                                                              "with type 'json_schema'")
    return StructuredOutputsParams(json=schema)


def _from_object(obj: Any) -> StructuredOutputsParams:
    if not isinstance(obj, dict):
        raise StructuredOutputRequestError("structured_outputs", "structured_outputs must be an object with one of "
                                                                 f"{', '.join(FIELDS)}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise StructuredOutputRequestError("structured_outputs", f"structured_outputs.{unknown[0]} is not supported "
                                                                 f"(supported: {', '.join(FIELDS)})")
    return StructuredOutputsParams(**obj)
