"""From a chat choice's generated text to the OpenAI message: reasoning split off first, then
tool calls read from what follows it. The same plan streams deltas for one choice."""

from __future__ import annotations

from dataclasses import dataclass

from tidal_engine.server.protocol import ChatResponseMessage, DeltaMessage, ResponseFunctionCall, ResponseToolCall
from tidal_engine.server.reasoning import ReasoningParser
from tidal_engine.server.tool_parsers import ParsedToolCall, ToolParser
from tidal_engine.server.tool_parsers.streaming import NamedCallStreamer, ToolCallStreamer


@dataclass
class ChatOutputPlan:
    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None  # "auto" and "required": reads calls out of the text
    named_function: str | None = None  # a named tool_choice: the text is that function's arguments
    max_calls: int | None = None  # parallel_tool_calls false: the first call only

    def message(self, text: str) -> tuple[ChatResponseMessage, bool]:
        """The message, and whether it calls tools."""
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        calls: list[ParsedToolCall] = []
        if self.named_function is not None:
            # No text after the reasoning (cut short while thinking): no call either.
            calls = [ParsedToolCall(self.named_function, content)] if content else []
            content = None
        elif self.tool_parser is not None and content:
            extracted = self.tool_parser.extract(content)
            content, calls = extracted.content, extracted.calls[: self.max_calls]
        tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        return ChatResponseMessage(content=content, tool_calls=tool_calls, reasoning_content=reasoning), bool(calls)

    def streamer(self) -> "ChoiceStreamer":
        return ChoiceStreamer(self)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI answers "tool_calls" when the model chose to call; a named choice stays "stop".
        if called and reason == "stop" and self.named_function is None:
            return "tool_calls"
        return reason


class ChoiceStreamer:
    """One choice's deltas: takes the whole text so far, returns what is new."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.sent_reasoning = 0
        self.sent_content = 0
        self.tools: ToolCallStreamer | NamedCallStreamer | None = None
        if plan.named_function is not None:
            self.tools = NamedCallStreamer(plan.named_function)
        elif plan.tool_parser is not None:
            self.tools = ToolCallStreamer(plan.tool_parser, plan.max_calls)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def update(self, text: str, finished: bool) -> list[DeltaMessage]:
        reasoning, content = self.plan.reasoning.split(text, finished) if self.plan.reasoning else (None, text)
        deltas: list[DeltaMessage] = []
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            deltas.append(DeltaMessage(reasoning_content=reasoning[self.sent_reasoning:]))
            self.sent_reasoning = len(reasoning)
        if content is None:
            return deltas
        if self.tools is not None:
            return deltas + self.tools.update(content, finished)
        if len(content) > self.sent_content:
            deltas.append(DeltaMessage(content=content[self.sent_content:]))
            self.sent_content = len(content)
        return deltas
