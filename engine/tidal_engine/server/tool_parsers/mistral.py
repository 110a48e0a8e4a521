"""Mistral format: [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3 tokenizers), or
[TOOL_CALLS]name[ARGS]{...} per call (v11+ tokenizers)."""

from __future__ import annotations

import json

from tidal_engine.server.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    arguments_json,
    calls_from_json_values,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = TOOL_CALLS

    def find_start(self, text: str) -> int | None:
        index = text.find(TOOL_CALLS)
        return None if index < 0 else index

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        body = region[len(TOOL_CALLS):].lstrip()
        if body.startswith("["):
            return calls_from_json_values(body[1:], ",", final, closing="]")
        return self._named(region, final)

    @staticmethod
    def _named(region: str, final: bool) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        pieces = region.split(TOOL_CALLS)[1:]
        for i, piece in enumerate(pieces):
            name, sep, args = piece.partition(ARGS)
            if not sep:
                if final:
                    return None
                break
            try:
                parsed = json.loads(args)
            except ValueError:
                if final or i < len(pieces) - 1:
                    return None
                break  # the last call's arguments are still coming
            calls.append(ParsedToolCall(name.strip(), arguments_json(parsed)))
        return calls
