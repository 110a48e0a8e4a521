"""Llama 3.1/3.2 JSON format: an answer that is {"name": ..., "parameters": {...}} (several joined
by ";"), optionally after <|python_tag|>."""

from __future__ import annotations

import json
from typing import Any

from tidal_engine.server.tool_parsers.base import AnchoredToolParser, ParsedToolCall, calls_from_json_values
from tidal_engine.server.tool_parsers.strict import json_call_tag, triggered_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(AnchoredToolParser):
    name = "llama3_json"
    openers = (PYTHON_TAG, "{")

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        body = region.lstrip().removeprefix(PYTHON_TAG)
        return calls_from_json_values(body, ";", final)

    def strict_format(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any] | None:
        # <|python_tag|> is a control token, which a structural tag cannot match: strict calls
        # are written as bare JSON, which this parser reads too.
        tags = [json_call_tag(f'{{"name": {json.dumps(name)}, "parameters": ', schema, "}") for name, schema in functions]
        return triggered_calls('{"name": ', tags, parallel)
