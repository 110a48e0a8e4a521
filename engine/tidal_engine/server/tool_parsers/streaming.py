"""Tool calls in streamed answers, as OpenAI sends them: per call, a first delta with its index,
id, type and name (arguments ""), then the arguments. Text before the calls streams as content.

Both streamers take the whole text so far on every update and return what is new, so the
deltas reassemble to exactly what the non-streamed answer holds.
"""

from __future__ import annotations

from tidal_engine.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from tidal_engine.server.tool_parsers.base import ToolParser, new_call_id


class ToolCallStreamer:
    """Streams a parser's calls as each one completes."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.start: int | None = None
        self.sent_content = 0
        self.num_calls = 0

    def update(self, text: str, finished: bool) -> list[DeltaMessage]:
        deltas: list[DeltaMessage] = []
        if self.start is None:
            self.start = self.parser.find_start(text)
        if self.start is None:
            end = len(text) if finished else self.parser.content_end(text)
            return self._content(text, end)
        deltas += self._content(text, self.start)
        calls = self.parser.calls_in(text[self.start:], final=finished)
        if calls is not None:
            calls = calls[: self.max_calls]
        if finished and not calls and self.num_calls == 0:
            return deltas + self._content(text, len(text))  # no call after all: plain content
        for index in range(self.num_calls, len(calls or [])):
            call = calls[index]  # type: ignore[index]
            deltas.append(_opening(index, call.id, call.name))
            deltas.append(_arguments(index, call.arguments))
        self.num_calls = max(self.num_calls, len(calls or []))
        return deltas

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _content(self, text: str, end: int) -> list[DeltaMessage]:
        if end <= self.sent_content:
            return []
        piece = text[self.sent_content:end]
        self.sent_content = end
        return [DeltaMessage(content=piece)]


class NamedCallStreamer:
    """A named tool_choice: the whole (constrained) output is the arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self.sent = 0
        self.opened = False

    def update(self, text: str, finished: bool) -> list[DeltaMessage]:
        deltas: list[DeltaMessage] = []
        if not text:
            return deltas  # the call opens with its first argument text, as the plain answer has one only then
        if not self.opened:
            deltas.append(_opening(0, self.id, self.name))
            self.opened = True
        if len(text) > self.sent:
            deltas.append(_arguments(0, text[self.sent:]))
            self.sent = len(text)
        return deltas

    @property
    def called(self) -> bool:
        return self.opened


def _opening(index: int, call_id: str, name: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, type="function",
                                                  function=DeltaFunctionCall(name=name, arguments=""))])


def _arguments(index: int, fragment: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))])
