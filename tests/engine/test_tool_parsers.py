"""Tool-call and reasoning parsers on recorded model outputs, whole and streamed piece by piece."""

from __future__ import annotations

import json

import pytest

from tidal_engine.server.chat_output import ChatOutputPlan
from tidal_engine.server.reasoning import get_reasoning_parser
from tidal_engine.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from tidal_engine.server.tool_parsers.forced import RequiredChoiceParser

# Outputs as the model families write them (Qwen2.5 for hermes, Llama 3.1/3.2, Mistral v3 and v11).
RECORDED = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        None,
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        None,
    ),
    "pythonic": ('[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', None),
}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]


def calls_of(extracted: object) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]  # type: ignore[attr-defined]


def stream(plan: ChatOutputPlan, text: str, step: int = 3) -> tuple[str | None, str | None, list[dict[str, object]]]:
    """Feed `text` in pieces of `step` characters; reassemble content, reasoning and calls."""
    streamer = plan.streamer()
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, object]] = {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for i, cut in enumerate(cuts):
        for delta in streamer.update(text[:cut], finished=i == len(cuts) - 1):
            content += [delta.content] if delta.content is not None else []
            reasoning += [delta.reasoning_content] if delta.reasoning_content is not None else []
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"arguments": ""})
                if piece.id is not None:  # the first delta of a call: id, type, name
                    assert "id" not in call and piece.function.name and piece.type == "function"
                    call.update(id=piece.id, name=piece.function.name)
                call["arguments"] += piece.function.arguments or ""  # type: ignore[operator]
    return ("".join(content) or None), ("".join(reasoning) or None), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parser_reads_recorded_output(name: str) -> None:
    text, content = RECORDED[name]
    extracted = get_tool_parser(name).extract(text)
    assert calls_of(extracted) == EXPECTED_CALLS
    assert extracted.content == content
    assert len({c.id for c in extracted.calls}) == 2


@pytest.mark.parametrize("name", sorted(RECORDED))
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_calls_reassemble_to_the_plain_ones(name: str, step: int) -> None:
    text, content = RECORDED[name]
    plan = ChatOutputPlan(tool_parser=get_tool_parser(name))
    streamed_content, _, calls = stream(plan, text, step)
    assert streamed_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == EXPECTED_CALLS  # type: ignore[arg-type]
    message, called = plan.message(text)
    assert called and [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("step", [2, 1000])
def test_parallel_tool_calls_false_keeps_the_first_call(step: int) -> None:
    text, _ = RECORDED["hermes"]
    plan = ChatOutputPlan(tool_parser=get_tool_parser("hermes"), max_calls=1)
    message, called = plan.message(text)
    assert called and [c.function.name for c in message.tool_calls] == ["get_weather"]
    _, _, calls = stream(plan, text, step)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_mistral_v11_format() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    assert calls_of(get_tool_parser("mistral").extract(text)) == EXPECTED_CALLS
    _, _, calls = stream(ChatOutputPlan(tool_parser=get_tool_parser("mistral")), text, 2)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", ["The weather in Paris is mild.", "[1, 2, 3] are numbers", "{not json",
                                  "<tool_call>{broken</tool_call>", "[TOOL_CALLS] nonsense", ""])
def test_no_call_is_plain_content(name: str, text: str) -> None:
    extracted = get_tool_parser(name).extract(text)
    assert extracted.calls == [] and extracted.content == text
    plan = ChatOutputPlan(tool_parser=get_tool_parser(name))
    content, _, calls = stream(plan, text, 2)
    assert calls == [] and (content or "") == text
    assert plan.message(text)[0].content == text


def test_plain_text_streams_before_the_answer_ends() -> None:
    # Content is not held back longer than a possible start of the marker.
    streamer = ChatOutputPlan(tool_parser=get_tool_parser("hermes")).streamer()
    assert [d.content for d in streamer.update("Hello <tool", finished=False)] == ["Hello "]
    assert [d.content for d in streamer.update("Hello <tools are fun", finished=False)] == ["<tools are fun"]


def test_required_choice_parser() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}]'
    assert calls_of(RequiredChoiceParser().extract(text)) == [("get_weather", {"city": "Rome", "unit": "celsius"})]
    cut = text[:-5]  # max_tokens cut it short: plain content, no call
    assert RequiredChoiceParser().extract(cut).calls == []


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),  # enable_thinking false: no think block
    ("qwen3", "<think>still thinking", "still thinking", None),  # cut short inside the reasoning
    ("deepseek_r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),  # the template opened <think>
    ("deepseek_r1", "<think>Let me think.</think>Paris.", "Let me think.", "Paris."),
    ("deepseek_r1", "Thinking without end", "Thinking without end", None),
])
@pytest.mark.parametrize("step", [1, 5])
def test_reasoning_split_plain_and_streamed(parser: str, text: str, reasoning: str | None, content: str | None,
                                            step: int) -> None:
    plan = ChatOutputPlan(reasoning=get_reasoning_parser(parser))
    message, _ = plan.message(text)
    assert (message.reasoning_content, message.content) == (reasoning, content)
    streamed_content, streamed_reasoning, _ = stream(plan, text, step)
    assert (streamed_reasoning, streamed_content) == (reasoning or None, content or None)


def test_tool_calls_are_read_after_the_reasoning() -> None:
    plan = ChatOutputPlan(reasoning=get_reasoning_parser("qwen3"), tool_parser=get_tool_parser("hermes"))
    text = '<think>I need the weather. <tool_call> is how.</think><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    message, called = plan.message(text)
    assert called and message.reasoning_content == "I need the weather. <tool_call> is how."
    assert [c.function.name for c in message.tool_calls] == ["get_time"] and message.content is None
    content, reasoning, calls = stream(plan, text, 3)
    assert reasoning == message.reasoning_content and content is None
    assert [c["name"] for c in calls] == ["get_time"]


def test_named_choice_cut_short_while_thinking_has_no_call() -> None:
    plan = ChatOutputPlan(reasoning=get_reasoning_parser("deepseek_r1"), named_function="get_time")
    message, called = plan.message("still thinking about it")
    assert not called and message.tool_calls == [] and message.reasoning_content == "still thinking about it"
    _, reasoning, calls = stream(plan, "still thinking about it", 4)
    assert calls == [] and reasoning == "still thinking about it"
    text = 'ok</think>{"zone": "UTC"}'
    message, called = plan.message(text)
    assert called and message.tool_calls[0].function.arguments == '{"zone": "UTC"}'
    _, _, calls = stream(plan, text, 3)
    assert calls == [{"arguments": '{"zone": "UTC"}', "id": calls[0]["id"], "name": "get_time"}]
