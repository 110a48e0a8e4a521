"""Tool-call parsers behind a registry (vLLM's --tool-call-parser names)."""

from __future__ import annotations

from tidal_engine.server.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser
from tidal_engine.server.tool_parsers.hermes import HermesToolParser
from tidal_engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal_engine.server.tool_parsers.mistral import MistralToolParser
from tidal_engine.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}") from None


__all__ = ["ExtractedToolCalls", "ParsedToolCall", "TOOL_PARSERS", "ToolParser", "get_tool_parser"]
