"""`strict: true` function tools under tool_choice "auto": text stays free, but once the model
opens a tool call in its parser's format, the call is held to the function's JSON schema until
the call's end marker (an xgrammar structural tag with triggered tags).

A parser says how its calls look (`ToolParser.strict_format`); a format whose opener is a
control token or whose calls are not JSON (mistral, pythonic) cannot be constrained this way, so
strict tools are refused with those parsers.
"""

from __future__ import annotations

import json
from typing import Any

from tidal_engine.server.tool_parsers.base import ToolParser
from tidal_engine.server.tool_parsers.forced import parameters_schema
from tidal_engine.structured import StructuredOutputsParams

# The arguments of a function that is not strict: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace runs inside constrained arguments are bounded, so a weak model cannot pad forever.
MAX_WHITESPACE = 16


def json_call_tag(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    """One call: `begin`, JSON valid against `schema`, `end`."""
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def triggered_calls(trigger: str, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """Free text until `trigger`, then one of `tags`; with parallel false the answer ends after
    the first call."""
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not parallel}


def strict_constraint(parser: ToolParser, functions: list[tuple[str, dict[str, Any] | None, bool]],
                      parallel: bool) -> StructuredOutputsParams:
    """The constraint for (name, parameters, strict) functions: strict ones get their schema,
    the others any object. ValueError when the parser's format cannot be constrained."""
    schemas = [(name, parameters_schema(parameters) if strict else ANY_OBJECT) for name, parameters, strict in functions]
    fmt = parser.strict_format(schemas, parallel)
    if fmt is None:
        raise ValueError(f"strict function tools are not supported with the {parser.name!r} tool-call parser "
                         "(its calls cannot be constrained while text stays free); drop strict, or use "
                         'tool_choice "required" or a named function')
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))
