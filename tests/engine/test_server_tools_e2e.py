"""Acceptance: the real `openai` client against `tidal-engine serve smollm2-135m` with tools,
reasoning and the Responses API (SmolLM2 knows no tools: a Hermes-style test template and
the hermes parser stand in for Qwen's)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import free_port, wait_for_health  # noqa: E402
from tool_chat_template import TIME_TOOL, TOOL_TEMPLATE, WEATHER_TOOL  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# With --reasoning-parser, constraints start after </think>; SmolLM2 never thinks, so the
# template closes the reasoning in the prompt (Qwen3's enable_thinking false).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tools-e2e")
    template = folder / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    script = Path(sys.executable).parent / "tidal-engine"
    base = [str(script)] if script.exists() else [shutil.which("tidal-engine") or "tidal-engine"]
    port = free_port()
    log = open(folder / "server.log", "w+b")
    command = base + ["serve", MODEL, "--port", str(port), "--dtype", "float32", "--device", "cpu",
                      "--max-model-len", "1024", "--kv-cache-memory-bytes", "64M", "--chat-template", str(template),
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                      "--generation-config", "vllm"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("TIDAL_API_KEY", None)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, 180, process)
        yield url
    except Exception:
        log.seek(0)
        raise RuntimeError(f"server failed:\n{log.read().decode(errors='replace')[-4000:]}") from None
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture()
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def reassemble(chunks: list[Any]) -> tuple[str | None, str | None, list[tuple[str, str]], str | None]:
    """(content, reasoning_content, [(name, arguments)], finish_reason) from streamed chunks."""
    content, reasoning, finish = "", "", None
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, reasoning or None, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


def plain_and_streamed(client: openai.OpenAI, **kwargs: Any) -> Any:
    plain = client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", QUESTION), temperature=0,
                                           **kwargs)
    streamed = reassemble(list(client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", QUESTION), temperature=0, stream=True, **kwargs)))
    message = plain.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert streamed == (message.content, getattr(message, "reasoning_content", None), calls,
                        plain.choices[0].finish_reason)
    return plain


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "none"], ids=["required", "named", "none"])
def test_tool_choice_plain_and_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    plain = plain_and_streamed(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=40,
                               parallel_tool_calls=False, extra_body=NO_THINKING)
    message = plain.choices[0].message
    if tool_choice == "none":
        assert message.content and not message.tool_calls
        return
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Rome", "Oslo") and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    assert plain.choices[0].finish_reason == ("tool_calls" if tool_choice == "required" else "stop")


def test_agent_loop(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           extra_body=NO_THINKING)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    messages = [*QUESTION, assistant.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "It is 18 degrees and sunny in Paris."}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_auto_with_hermes_and_reasoning(client: openai.OpenAI) -> None:
    # SmolLM2 writes neither on its own: a regex makes it write Qwen's format.
    regex = ('<think>The user wants the weather\\.</think>'
             '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris", "unit": "celsius"\\}\\}</tool_call>')
    plain = plain_and_streamed(client, tools=TOOLS, max_tokens=150,
                               extra_body={"structured_outputs": {"regex": regex}, **NO_THINKING})
    message = plain.choices[0].message
    assert message.reasoning_content == "The user wants the weather.", message
    assert message.tool_calls, message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert plain.choices[0].finish_reason == "tool_calls"


def test_responses_create_and_stream(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="What is the capital of France?",
                                      instructions="Answer in one word.", max_output_tokens=12, temperature=0,
                                      store=False)
    assert "Paris" in created.output_text
    with client.responses.stream(model=MODEL, input="What is the capital of France?",
                                 instructions="Answer in one word.", max_output_tokens=12, temperature=0,
                                 store=False) as stream:
        events = list(stream)
    final = events[-1].response
    assert final.output_text == created.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == created.output_text
