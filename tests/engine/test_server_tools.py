"""Tool calling and reasoning over HTTP against the tiny in-process server: tool_choice none,
required, named and auto (hermes), plain and streamed, and a two-turn agent loop.

The tiny model is random, so "required" and named choices show the xgrammar enforcement:
whatever it samples, the calls parse against the schemas. Auto and reasoning outputs are
forced into the model family's format with a regex constraint.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import LiveServer, live_server  # noqa: E402
from tool_chat_template import TIME_TOOL, TOOL_TEMPLATE, WEATHER_TOOL  # noqa: E402

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ENUMS = {"get_weather": ({"city", "unit"}, {"city": {"Paris", "Rome", "Oslo"}, "unit": {"celsius", "fahrenheit"}}),
         "get_time": ({"zone"}, {"zone": {"UTC", "CET"}})}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
                     chat_template=TOOL_TEMPLATE) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def ask(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": MSG, "tools": TOOLS, "max_tokens": 60,
                                                         "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def ask_streamed(client: httpx.Client, **body: Any) -> tuple[dict[str, Any], str | None]:
    """The streamed answer reassembled into a message, and the finish reason."""
    response = client.post("/v1/chat/completions", json={"messages": MSG, "tools": TOOLS, "max_tokens": 60,
                                                         "temperature": 0, "stream": True, **body})
    assert response.status_code == 200, response.text
    message: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": []}
    finish = None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        (choice,) = json.loads(line[len("data: "):])["choices"]
        delta = choice["delta"]
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                message[key] = (message[key] or "") + delta[key]
        for piece in delta.get("tool_calls", []):
            if "id" in piece:  # a new call: index, id, type and name come first, arguments ""
                assert piece["index"] == len(message["tool_calls"]) and piece["type"] == "function"
                assert piece["function"]["arguments"] == ""
                message["tool_calls"].append({"id": piece["id"], "type": "function",
                                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            else:
                assert set(piece["function"]) == {"arguments"}
            message["tool_calls"][piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return message, finish


def check_call(call: dict[str, Any]) -> None:
    """The call is valid against its function's schema (enforced by the grammar)."""
    keys, enums = ENUMS[call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == keys
    for key, allowed in enums.items():
        assert arguments[key] in allowed
    assert call["id"].startswith("call_") and call["type"] == "function"


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
    return {"content": message["content"], "reasoning_content": message.get("reasoning_content"), "calls": calls}


def test_tool_choice_required_is_enforced_plain_and_streamed(client: httpx.Client) -> None:
    for parallel in (False, True):
        data = ask(client, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200)
        (choice,) = data["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            check_call(call)
        assert choice["message"]["content"] is None
        streamed, finish = ask_streamed(client, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200)
        assert finish == "tool_calls" and without_ids(streamed) == without_ids(choice["message"])


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_is_enforced_plain_and_streamed(client: httpx.Client, name: str) -> None:
    choice_field = {"type": "function", "function": {"name": name}}
    (choice,) = ask(client, tool_choice=choice_field)["choices"]
    assert choice["finish_reason"] == "stop"  # OpenAI's answer for a named choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == name
    check_call(call)
    streamed, finish = ask_streamed(client, tool_choice=choice_field)
    assert finish == "stop" and without_ids(streamed) == without_ids(choice["message"])


def test_tool_choice_none_answers_in_text(client: httpx.Client) -> None:
    (choice,) = ask(client, tool_choice="none", max_tokens=8)["choices"]
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    streamed, finish = ask_streamed(client, tool_choice="none", max_tokens=8)
    assert finish == "length" and without_ids(streamed) == without_ids(choice["message"])


HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


def test_auto_reads_hermes_calls_plain_and_streamed(client: httpx.Client) -> None:
    # The regex makes the random model write what Qwen2.5 writes when it calls a tool.
    forced = {"structured_outputs": {"regex": "Checking\\. " + HERMES_CALL}}
    (choice,) = ask(client, tool_choice="auto", **forced)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    check_call(call)
    streamed, finish = ask_streamed(client, tool_choice="auto", **forced)
    assert finish == "tool_calls" and without_ids(streamed) == without_ids(choice["message"])
    # tools without tool_choice mean "auto" too; an answer without a call is plain content.
    plain = ask(client, structured_outputs={"regex": "It is sunny\\."})["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny.", "tool_calls": [],
                                "reasoning_content": None}
    assert plain["finish_reason"] == "stop"


def test_reasoning_split_plain_and_streamed(client: httpx.Client) -> None:
    forced = {"structured_outputs": {"regex": "<think>Paris is in France\\.</think>Sunny\\."}, "tools": None}
    (choice,) = ask(client, **forced)["choices"]
    assert choice["message"]["reasoning_content"] == "Paris is in France."
    assert choice["message"]["content"] == "Sunny."
    streamed, _ = ask_streamed(client, **forced)
    assert without_ids(streamed) == without_ids(choice["message"])


def test_reasoning_then_tool_call(client: httpx.Client) -> None:
    forced = {"structured_outputs": {"regex": "<think>I need the time\\.</think>" + HERMES_CALL}}
    (choice,) = ask(client, **forced)["choices"]
    assert choice["message"]["reasoning_content"] == "I need the time." and choice["message"]["content"] is None
    check_call(choice["message"]["tool_calls"][0])


def test_two_turn_agent_loop_renders_tool_results(client: httpx.Client) -> None:
    first = ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})["choices"][0]
    assistant = first["message"]
    call = assistant["tool_calls"][0]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees and sunny"}
    messages = [*MSG, assistant, result]  # the assistant turn goes back unchanged
    second = ask(client, messages=messages, tool_choice="none", max_tokens=5)["choices"][0]
    assert second["message"]["content"] and second["message"]["tool_calls"] == []
    # The template saw the call and its result.
    tokens = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    prompt = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    arguments = json.loads(call["function"]["arguments"])
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert json.dumps({"name": "get_weather", "arguments": arguments}) in prompt
    assert 'get_time["zone"]' in prompt  # the tools are in the system turn


def test_tool_choice_with_response_format_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
