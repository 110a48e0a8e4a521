"""Reasoning parsers (vLLM's --reasoning-parser): split <think>…</think> off the answer into
`reasoning_content`.

A parser maps the whole text so far to (reasoning, content). While streaming it holds back
a tail that may still grow into a tag, so the split only ever grows: the streamed deltas
reassemble to the non-streamed answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

THINK_START, THINK_END = "<think>", "</think>"


def _tail_overlap(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser(ABC):
    name = ""

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`; with final=False only what can no longer change."""

    @staticmethod
    def _thinking(body: str, final: bool) -> tuple[str | None, str | None]:
        """`body` starts inside the reasoning: up to </think> is reasoning, the rest content."""
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end], body[end + len(THINK_END):]
        keep = len(body) if final else len(body) - _tail_overlap(body, THINK_END)
        return body[:keep], None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens <think>, so the answer starts inside the reasoning
    (a leading <think> the model writes itself is dropped)."""

    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if not final and THINK_START.startswith(text) and text != THINK_START:
            return "", None  # may still become the opening tag
        return self._thinking(text.removeprefix(THINK_START), final)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens <think> itself; an answer without it (enable_thinking false) is all content."""

    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return self._thinking(stripped[len(THINK_START):], final)
        if not final and THINK_START.startswith(stripped):
            return None, ""  # undecided yet
        return None, text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None
