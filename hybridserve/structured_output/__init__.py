"""Structured output: generation constrained by a JSON schema, a regex, a list of choices or a grammar
(see docs/structured_output.md)."""

from hybridserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
