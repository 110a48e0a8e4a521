"""Acceptance: the real `openai` client against `tidal-engine serve smollm2-135m` in a subprocess
(chat, completions, concurrency, disconnects, sleep, tools, reasoning, the Responses API, SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import free_port, wait_for_health, wait_until  # noqa: E402
from tool_chat_template import TIME_TOOL, TOOL_TEMPLATE, WEATHER_TOOL  # noqa: E402

from tidal_engine.server.metrics import metric_value  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def serve_command() -> list[str]:
    script = Path(sys.executable).parent / "tidal-engine"
    base = [str(script)] if script.exists() else [shutil.which("tidal-engine") or "tidal-engine"]
    return base + ["serve", MODEL, "--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
                   "--kv-cache-memory-bytes", "64M", "--enable-sleep-mode", "--shutdown-timeout", "60",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


class Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        env.pop("TIDAL_API_KEY", None)
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tidal-e2e-{self.port}.log", "w+b")
        self.process = subprocess.Popen(serve_command() + ["--port", str(self.port)], env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    live = Server()
    try:
        wait_for_health(live.url, 180, live.process)
    except Exception:
        live.stop()
        raise RuntimeError(f"server failed to start:\n{live.output()[-4000:]}") from None
    yield live
    live.stop()


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_model_listing(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = plain.choices[0].message.content
    assert "Paris" in text
    assert plain.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == plain.choices[0].text and plain.choices[0].text


def test_32_concurrent_chats(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    running: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            running.append(metric_value(server.metrics(), "tidal:num_requests_running", model_name=MODEL) or 0)
            time.sleep(0.05)

    async def one(i: int) -> str:
        response = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Name a number bigger than {i}."}],
            max_tokens=12, temperature=0,
        )
        return response.choices[0].finish_reason

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        reasons = asyncio.run(run_all())
    finally:
        stop.set()
        scraper.join()
    assert len(reasons) == 32 and all(r in ("stop", "length") for r in reasons)
    assert max(running) > 1, running


def test_disconnect_mid_stream_frees_kv(server: Server) -> None:
    def kv() -> float:
        return metric_value(server.metrics(), "tidal:kv_cache_usage_perc", model_name=MODEL) or 0.0

    def aborted() -> float:
        return metric_value(server.metrics(), "tidal:request_success_total", model_name=MODEL,
                            finished_reason="abort") or 0.0

    baseline, aborted_before = kv(), aborted()
    body = {"model": MODEL, "prompt": "Write a long story about the sea.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept referenced: dropping it would close the connection
        received = 0
        while received < 3:
            received += next(lines).startswith("data: ")
        assert kv() > baseline
    assert wait_until(lambda: kv() == baseline, 30)
    assert aborted() == aborted_before + 1


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_keeps_greedy_answer(client: openai.OpenAI, server: Server, level: int) -> None:
    def ask() -> str:
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                              temperature=0).choices[0].message.content

    before = ask()
    assert httpx.post(f"{server.url}/sleep?level={level}", timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
    with pytest.raises(openai.APIStatusError) as refused:
        ask()
    assert refused.value.status_code == 503
    assert refused.value.body["type"] == "engine_sleeping"
    started = time.monotonic()
    assert httpx.post(f"{server.url}/wake_up", timeout=120).status_code == 200
    print(f"wake from level {level}: {time.monotonic() - started:.2f}s")
    assert ask() == before


# ---------------------------------------------------------------------- tools, reasoning, Responses
# SmolLM2 knows no tools: a Hermes-style test template (sent per request as chat_template) and
# the server's hermes parser stand in for Qwen's. With --reasoning-parser, constraints start
# after </think>; SmolLM2 never thinks, so the template closes the reasoning in the prompt
# (Qwen3's enable_thinking false).
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]
TOOL_BODY = {"chat_template": TOOL_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}


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
    kwargs["extra_body"] = {**TOOL_BODY, **kwargs.get("extra_body", {})}
    messages = kwargs.pop("messages", TOOL_QUESTION)
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    streamed = reassemble(list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, stream=True, **kwargs)))
    message = plain.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert streamed == (message.content, getattr(message, "reasoning_content", None), calls,
                        plain.choices[0].finish_reason)
    return plain


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "none"], ids=["required", "named", "none"])
def test_tool_choice_plain_and_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    plain = plain_and_streamed(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=40,
                               parallel_tool_calls=False, extra_body=TOOL_BODY)
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
    first = client.chat.completions.create(model=MODEL, messages=TOOL_QUESTION, tools=TOOLS, temperature=0, max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           extra_body=TOOL_BODY)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    messages = [*TOOL_QUESTION, assistant.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "It is 18 degrees and sunny in Paris."}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30, extra_body=TOOL_BODY)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_auto_with_hermes_and_reasoning(client: openai.OpenAI) -> None:
    # SmolLM2 writes neither on its own: a regex makes it write Qwen's format.
    regex = ('<think>The user wants the weather\\.</think>'
             '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris", "unit": "celsius"\\}\\}</tool_call>')
    plain = plain_and_streamed(client, tools=TOOLS, max_tokens=150,
                               extra_body={"structured_outputs": {"regex": regex}, **TOOL_BODY})
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


def test_sigterm_drains_in_flight_then_exits(server: Server) -> None:
    """Runs last: it stops the module's server."""
    result: dict[str, object] = {}

    def long_request() -> None:
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        result["status"] = response.status_code
        result["body"] = response.json()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_until(
        lambda: (metric_value(server.metrics(), "tidal:num_requests_running", model_name=MODEL) or 0) >= 1, 30
    )
    server.process.send_signal(signal.SIGTERM)
    worker.join(120)
    assert result["status"] == 200
    assert result["body"]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
    assert server.process.wait(60) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=2)
