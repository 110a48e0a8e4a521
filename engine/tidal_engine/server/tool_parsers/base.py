"""What every tool-call parser shares: the parsed call, the parser interface, and JSON helpers.

A parser finds where the tool-call region of a model's output starts (`find_start`) and
reads the calls in it (`calls_in`). The same two methods serve the full answer (`extract`)
and streaming (`streaming.ToolCallStreamer`), so a streamed answer reassembles to the plain one.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text around the calls (all of it when there are none)
    calls: list[ParsedToolCall]


class ToolParser(ABC):
    """One model family's tool-call format (vLLM's --tool-call-parser)."""

    name: str = ""
    # A string that opens the tool-call region; streaming holds back text that may be its start.
    marker: str = ""

    @abstractmethod
    def find_start(self, text: str) -> int | None:
        """Where the tool-call region starts in `text`, or None (no call, so far)."""

    @abstractmethod
    def calls_in(self, region: str, final: bool) -> list[ParsedToolCall] | None:
        """The calls in `region` (the text from `find_start` on). With final=False, only the
        calls already complete; with final=True, all of them, or None when the region is malformed."""

    def strict_format(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any] | None:
        """An xgrammar structural-tag format that holds each call to its function's arguments
        schema (`functions`: name, schema) while the text around it stays free (strict.py);
        None when this format cannot be constrained so."""
        return None

    def extract(self, text: str) -> ExtractedToolCalls:
        start = self.find_start(text)
        if start is None:
            return ExtractedToolCalls(text, [])
        calls = self.calls_in(text[start:], final=True)
        if not calls:  # a parser that finds no call returns plain content
            return ExtractedToolCalls(text, [])
        before = text[:start]
        return ExtractedToolCalls(before if before.strip() else None, calls)

    def content_end(self, text: str) -> int:
        """How much of `text` (in which `find_start` found nothing) is surely content: all but
        a tail that may still grow into the marker."""
        for size in range(min(len(self.marker), len(text)), 0, -1):
            if self.marker.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class AnchoredToolParser(ToolParser):
    """A format whose calls make up the whole answer: they start at its first visible character."""

    openers: tuple[str, ...] = ()

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.openers) else None

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or any(opener.startswith(stripped) for opener in self.openers):
            return 0  # still undecided
        return len(text)


def arguments_json(value: Any) -> str:
    """Arguments as JSON text, whether the model wrote an object or a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    return ParsedToolCall(obj["name"], arguments_json(args))


_DECODER = json.JSONDecoder()


def json_values(text: str, separators: str = ",;") -> tuple[list[Any], str]:
    """The complete JSON values at the start of `text`, separated by whitespace or `separators`,
    and what follows them (an unfinished value, or other text)."""
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values, text[pos:]
        values.append(value)
        pos = end


def calls_from_json_values(body: str, separators: str, final: bool,
                           closing: str = "") -> list[ParsedToolCall] | None:
    """Tool calls from JSON objects joined by `separators` (and ended by `closing` once final).
    None when the text is not such calls; while streaming, the complete calls so far."""
    values, rest = json_values(body, separators=separators)
    calls: list[ParsedToolCall] = []
    for value in values:
        call = call_from_object(value)
        if call is None:
            return None if final else calls
        calls.append(call)
    if final and rest.strip() != closing:
        return None
    return calls
