"""Pythonic format (Llama 3.2 and 4, ToolACE): [get_weather(city="Paris"), add(a=1, b=2)]."""

from __future__ import annotations

import ast
import json

from tidal_engine.server.tool_parsers.base import AnchoredToolParser, ParsedToolCall

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(AnchoredToolParser):
    name = "pythonic"
    openers = (PYTHON_START, "[")

    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        source = region.replace(PYTHON_START, "").replace(PYTHON_END, "").strip()
        try:
            tree = ast.parse(source, mode="eval")
        except SyntaxError:
            return None if final else []  # the list is not closed yet
        if not isinstance(tree.body, ast.List):
            return None if final else []
        calls: list[ParsedToolCall] = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None if final else []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None if final else []
            calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
