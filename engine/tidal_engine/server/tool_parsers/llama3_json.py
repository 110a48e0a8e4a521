"""Llama 3.1/3.2 JSON format: an answer that is {"name": ..., "parameters": {...}} (several joined
by ";"), optionally after <|python_tag|>."""

from __future__ import annotations

from tidal_engine.server.tool_parsers.base import AnchoredToolParser, ParsedToolCall, call_from_object, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(AnchoredToolParser):
    name = "llama3_json"
    openers = (PYTHON_TAG, "{")

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        body = region.lstrip().removeprefix(PYTHON_TAG)
        values, rest = json_values(body, separators=";")
        calls: list[ParsedToolCall] = []
        for value in values:
            call = call_from_object(value)
            if call is None:
                return None if final else calls
            calls.append(call)
        if final and rest.strip():
            return None
        return calls
