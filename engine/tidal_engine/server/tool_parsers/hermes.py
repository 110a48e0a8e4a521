"""Hermes format (Qwen2.5, Qwen3, Hermes 2/3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

from __future__ import annotations

import json
import re
from typing import Any

from tidal_engine.server.tool_parsers.base import ParsedToolCall, ToolParser, call_from_object
from tidal_engine.server.tool_parsers.strict import json_call_tag, triggered_calls

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def find_start(self, text: str) -> int | None:
        index = text.find(self.marker)
        return None if index < 0 else index

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        bodies = [m.group(1) for m in _BLOCK.finditer(region)]
        if final:
            tail = region[region.rfind("</tool_call>") + len("</tool_call>"):] if bodies else region
            if self.marker in tail:  # the answer ended inside a block (max_tokens, or EOS)
                bodies.append(tail[tail.index(self.marker) + len(self.marker):])
        calls: list[ParsedToolCall] = []
        for body in bodies:
            try:
                call = call_from_object(json.loads(body.strip()))
            except ValueError:
                call = None
            if call is None:
                if final:
                    return None
                break
            calls.append(call)
        return calls

    def strict_format(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any] | None:
        tags = [json_call_tag(f'{self.marker}\n{{"name": {json.dumps(name)}, "arguments": ', schema, "}\n</tool_call>")
                for name, schema in functions]
        return triggered_calls(self.marker, tags, parallel)
