"""Llama 3.1/3.2 JSON format: an answer that is {"name": ..., "parameters": {...}} (several joined
by ";"), optionally after <|python_tag|>."""

from __future__ import annotations

from tidal_engine.server.tool_parsers.base import AnchoredToolParser, ParsedToolCall, calls_from_json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(AnchoredToolParser):
    name = "llama3_json"
    openers = (PYTHON_TAG, "{")

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        body = region.lstrip().removeprefix(PYTHON_TAG)
        return calls_from_json_values(body, ";", final)
