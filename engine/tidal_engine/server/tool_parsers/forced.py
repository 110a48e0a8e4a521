"""`tool_choice` "required" and a named function: the output is constrained with xgrammar to
the tools' JSON schemas, so it always parses, even from a tiny model.

"required": a JSON list of {"name": <one of the tools>, "parameters": <its schema>} (one item
when parallel_tool_calls is false). A named function: its arguments object alone.
"""

from __future__ import annotations

from typing import Any

from tidal_engine.server.tool_parsers.base import ParsedToolCall, ToolParser, call_from_object, json_values
from tidal_engine.structured import StructuredOutputsParams

# A function without `parameters` takes an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else NO_PARAMETERS


def required_schema(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters_schema(parameters)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def required_constraint(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=required_schema(functions, parallel))


def named_constraint(parameters: dict[str, Any] | None) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=parameters_schema(parameters))


class RequiredChoiceParser(ToolParser):
    """Reads the constrained "required" list."""

    name = "required"
    marker = "["

    def find_start(self, text: str) -> int | None:
        index = text.find("[")
        return None if index < 0 else index

    def content_end(self, text: str) -> int:
        return 0  # the grammar allows nothing but the list

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        values, rest = json_values(region[1:], separators=",")
        calls: list[ParsedToolCall] = []
        for value in values:
            call = call_from_object(value, argument_keys=("parameters",))
            if call is None:
                return None if final else calls
            calls.append(call)
        if final and rest.strip() != "]":
            return None  # cut short (max_tokens): the text is returned as content
        return calls
