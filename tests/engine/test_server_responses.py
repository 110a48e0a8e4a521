"""POST /v1/responses with the `openai` client (responses.create and responses.stream) against
the tiny in-process server: text, instructions, items, function tools and their calls,
text.format JSON schema, reasoning, limits, and the stateless refusals."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import LiveServer, live_server  # noqa: E402
from tool_chat_template import TIME_TOOL, TOOL_TEMPLATE, WEATHER_TOOL  # noqa: E402

# The Responses API's function tools are flat: {"type", "name", "parameters", ...}.
TOOLS: list[Any] = [{"type": "function", **tool["function"]} for tool in (WEATHER_TOOL, TIME_TOOL)]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(reasoning_parser="qwen3", chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True,
                     tool_call_parser="hermes") as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def summary(response: Any) -> dict[str, Any]:
    """What must agree between a created and a streamed response (ids aside)."""
    items = []
    for item in response.output:
        if item.type == "message":
            items.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "function_call":
            items.append(("function_call", item.name, item.arguments))
        else:
            items.append(("reasoning", "".join(part.text for part in item.content or [])))
    return {"status": response.status, "items": items, "output_tokens": response.usage.output_tokens}


def create_and_stream(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, Any, list[str]]:
    kwargs.setdefault("model", "tiny")
    created = client.responses.create(store=False, temperature=0, **kwargs)
    with client.responses.stream(store=False, temperature=0, **kwargs) as stream:
        events = list(stream)
        # The SDK finalises on response.completed; a response cut short ends with response.incomplete.
        streamed = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert summary(streamed) == summary(created)
    return created, streamed, kinds


def test_text_input_with_instructions(client: openai.OpenAI) -> None:
    created, streamed, kinds = create_and_stream(client, model="tiny", input="Say hello.",
                                                 instructions="Be brief.", max_output_tokens=6)
    assert created.object == "response" and created.status == "incomplete"
    assert created.incomplete_details.reason == "max_output_tokens"
    assert created.output_text and created.usage.output_tokens == 6
    assert created.instructions == "Be brief." and created.max_output_tokens == 6
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"} <= set(kinds)


def test_items_input_and_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    created, _, kinds = create_and_stream(
        client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Is water wet?"}]}],
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        max_output_tokens=30)
    assert created.status == "completed" and kinds[-1] == "response.completed"
    assert json.loads(created.output_text)["answer"] in ("yes", "no")


def test_function_tools_call_and_result(client: openai.OpenAI) -> None:
    created, _, kinds = create_and_stream(client, input="Weather in Rome?", tools=TOOLS,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60)
    (call,) = [item for item in created.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    assert call.call_id.startswith("call_") and "response.function_call_arguments.delta" in kinds
    # Second turn: the earlier output items go back as they are, followed by the result.
    follow_up = [{"role": "user", "content": "Weather in Rome?"}, *created.output,
                 {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}]
    answer = client.responses.create(input=follow_up, tools=TOOLS, tool_choice="none", max_output_tokens=5,
                                     temperature=0, store=False)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    required = client.responses.create(input="Time?", tools=TOOLS, tool_choice="required", max_output_tokens=100,
                                       temperature=0, parallel_tool_calls=False, store=False)
    assert [i.type for i in required.output] == ["function_call"]


def test_text_format_integer(server: LiveServer) -> None:
    with server.client() as c:
        body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                  "schema": {"type": "integer", "minimum": 0, "maximum": 9}}}}
        data = c.post("/v1/responses", json=body).json()
    assert [i["type"] for i in data["output"]] == ["message"] and data["output"][0]["content"][0]["text"].isdigit()
    assert data["text"]["format"]["type"] == "json_schema" and data["store"] is False


def test_reasoning_and_calls_become_items_plain_and_streamed() -> None:
    # The item and event shapes for a qwen3 answer that thinks, says something, then calls a tool.
    from tidal_engine.server.chat_output import ChatOutputPlan
    from tidal_engine.server.reasoning import get_reasoning_parser
    from tidal_engine.server.responses import _EventWriter, _ItemStream, output_items
    from tidal_engine.server.tool_parsers import get_tool_parser

    plan = ChatOutputPlan(reasoning=get_reasoning_parser("qwen3"), tool_parser=get_tool_parser("hermes"))
    text = '<think>Need the time.</think>Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    message, _ = plan.message(text)
    plain = output_items(message)
    assert [i["type"] for i in plain] == ["reasoning", "message", "function_call"]
    assert plain[0]["content"] == [{"type": "reasoning_text", "text": "Need the time."}]
    items = _ItemStream(_EventWriter())
    streamer = plan.streamer()
    events: list[dict[str, Any]] = []
    for cut in range(1, len(text) + 1):
        for delta in streamer.update(text[:cut], cut == len(text)):
            events += [json.loads(e.split("data: ", 1)[1]) for e in items.add(delta)]
    events += [json.loads(e.split("data: ", 1)[1]) for e in items.close()]
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items.done]
    assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in plain]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and "response.reasoning_text.delta" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, None),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_refusals(server: LiveServer, body: dict[str, Any], param: str | None) -> None:
    with server.client() as c:
        response = c.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
    if param == "previous_response_id":
        assert "stores no responses" in error["message"]
