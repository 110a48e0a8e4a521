"""The HTTP API end to end, in process: a tiny random Llama behind the real LLMEngine,
AsyncLLMEngine and uvicorn (in a thread), driven over real HTTP."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import LiveServer, live_server, make_engine, wait_until  # noqa: E402

from tidal_engine.server.metrics import metric_value  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module", params=[False, True], ids=["sync-steps", "async-scheduling"])
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    # The whole API in both step modes (async scheduling is the CUDA default).
    with live_server(engine={"async_scheduling": request.param}) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def sse_events(text: str) -> list[Any]:
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_text(events: list[Any], chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            piece = (choice["delta"].get("content") or "") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def metrics(client: httpx.Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


# ---------------------------------------------------------------------- basics


def test_models_version_ping_health(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 256
    assert client.get("/version").json()["version"]
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


@pytest.mark.parametrize(
    "prompt, num_prompts",
    [("Hello there", 1), (["one", "two three"], 2), ([19556, 905], 1), ([[19556], [905, 19556]], 2)],
)
def test_completion_prompt_shapes(client: httpx.Client, prompt: Any, num_prompts: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "text_completion"
    assert sorted(c["index"] for c in data["choices"]) == list(range(2 * num_prompts))
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 4 * 2 * num_prompts
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]


def test_completion_echo_stop_and_logprobs(client: httpx.Client) -> None:
    base = {"prompt": "The sea is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**base, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "The sea is" + plain
    # Stop on a piece of the greedy answer: the text ends right before it.
    stop = plain.strip()[-3:]
    stopped = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stop not in stopped["text"] and plain.startswith(stopped["text"])
    with_lp = client.post("/v1/completions", json={**base, "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert len(with_lp["tokens"]) == len(with_lp["token_logprobs"]) == len(with_lp["top_logprobs"]) == 8
    assert all(len(top) <= 3 for top in with_lp["top_logprobs"])
    assert "".join(with_lp["tokens"]) == plain


def test_seed_makes_sampling_reproducible(client: httpx.Client) -> None:
    body = {"prompt": "Once", "max_tokens": 6, "temperature": 1.0, "seed": 1234}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert first == second


def test_chat_system_parts_and_max_completion_tokens(client: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ],
        "max_completion_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    data = client.post("/v1/chat/completions", json=body).json()
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5
    # The rendered template counts the same prompt tokens as /tokenize with messages.
    tokens = client.post("/tokenize", json={"messages": body["messages"]}).json()
    assert tokens["count"] == data["usage"]["prompt_tokens"]


def test_chat_logprobs_and_n(client: httpx.Client) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.8, "seed": 7}
    data = client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["logprobs"]["content"]) > 0
        assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)


def test_streamed_equals_non_streamed_greedy(client: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 20}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    first = events[0]["choices"][0]
    assert first["delta"]["role"] == "assistant"
    assert stream_text(events, chat=True)[0] == plain
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")

    completion = {"prompt": "Tell me", "max_tokens": 15, "temperature": 0}
    plain_c = client.post("/v1/completions", json=completion).json()["choices"][0]["text"]
    events_c = sse_events(client.post("/v1/completions", json={**completion, "stream": True}).text)
    assert stream_text(events_c, chat=False)[0] == plain_c


def test_stream_usage_chunk(client: httpx.Client) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "max_tokens": 6}
    events = sse_events(client.post("/v1/chat/completions", json=body).text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    body_c = {"prompt": ["a", "b"], "max_tokens": 3, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    events_c = sse_events(client.post("/v1/completions", json=body_c).text)
    assert events_c[-2]["usage"]["completion_tokens"] == 6
    assert set(stream_text(events_c, chat=False)) == {0, 1}


def test_cache_salt_isolates_prefix_cache(client: httpx.Client) -> None:
    prompt = "A long shared prefix that spans more than one KV block of sixteen tokens, clearly. " * 2
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json={**body, "cache_salt": "tenant-a"})
    same = client.post("/v1/completions", json={**body, "cache_salt": "tenant-a"}).json()
    other = client.post("/v1/completions", json={**body, "cache_salt": "tenant-b"}).json()
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_tokenize_detokenize_round_trip(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 256
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_invocations_dispatches_by_shape(client: httpx.Client) -> None:
    chat = client.post("/invocations", json=CHAT).json()
    assert chat["object"] == "chat.completion"
    completion = client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    neither = client.post("/invocations", json={"input": "Hi"})
    assert neither.status_code == 400


def test_metrics_names_and_counts(client: httpx.Client) -> None:
    before = metrics(client)
    done_before = metric_value(before, "tidal:request_success_total", model_name="tiny", finished_reason="length")
    e2e_before = metric_value(before, "tidal:e2e_request_latency_seconds_count", model_name="tiny")
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    after = metrics(client)
    assert metric_value(after, "tidal:request_success_total", model_name="tiny",
                        finished_reason="length") == (done_before or 0) + 1
    assert metric_value(after, "tidal:e2e_request_latency_seconds_count", model_name="tiny") == (e2e_before or 0) + 1
    for name in (
        "tidal:num_requests_running", "tidal:num_requests_waiting", "tidal:kv_cache_usage_perc",
        "tidal:prefix_cache_queries_total", "tidal:prefix_cache_hits_total", "tidal:prompt_tokens_total",
        "tidal:generation_tokens_total", "tidal:num_preemptions_total",
        "tidal:time_to_first_token_seconds_count", "tidal:inter_token_latency_seconds_count",
        "tidal:request_queue_time_seconds_count", "tidal:request_prompt_tokens_count",
        "tidal:request_generation_tokens_count",
    ):
        assert metric_value(after, name, model_name="tiny") is not None, name
    assert metric_value(after, "tidal:engine_sleep_state", model_name="tiny", sleep_state="awake") == 1


def test_32_concurrent_chats_batch_together(server: LiveServer) -> None:
    seen_running: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        with server.client() as c:
            while not stop.is_set():
                value = metric_value(c.get("/metrics").text, "tidal:num_requests_running", model_name="tiny")
                seen_running.append(value or 0)
                time.sleep(0.005)

    def chat(i: int) -> int:
        with server.client() as c:
            body = {**CHAT, "messages": [{"role": "user", "content": f"Count to {i}."}],
                    "max_tokens": 24, "ignore_eos": True}
            return c.post("/v1/chat/completions", json=body).status_code

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(chat, range(32)))
    finally:
        stop.set()
        scraper.join()
    assert statuses == [200] * 32
    with server.client() as c:
        peak = metric_value(c.get("/metrics").text, "tidal:num_requests_running_peak", model_name="tiny")
    assert peak is not None and peak > 1
    assert max(seen_running) > 1, f"never saw more than one running request in {len(seen_running)} scrapes"


# ---------------------------------------------------------------------- disconnects


def _slow_steps(live: LiveServer, delay_s: float) -> None:
    """Make every engine step take at least `delay_s`, so a request is still running when we drop it."""
    raw = live.raw_engine()
    step = raw.step

    def slow_step() -> Any:
        time.sleep(delay_s)
        return step()

    raw.step = slow_step


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_kv(stream: bool) -> None:
    with live_server() as live:
        _slow_steps(live, 0.02)
        raw = live.raw_engine()
        baseline = raw.get_stats().kv_cache_usage
        body = {"prompt": "Keep talking " * 20, "max_tokens": 200, "ignore_eos": True, "stream": stream}
        with live.client() as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.iter_lines()
                    while not next(lines).startswith("data: "):
                        pass
                    assert raw.get_stats().kv_cache_usage > baseline
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body, timeout=0.5)
        assert wait_until(lambda: live.engine.num_in_flight == 0, 10)
        assert wait_until(lambda: raw.get_stats().kv_cache_usage == baseline, 10)
        assert not raw.has_unfinished_requests()
        with live.client() as c:
            text = c.get("/metrics").text
        assert metric_value(text, "tidal:request_success_total", model_name="tiny", finished_reason="abort") == 1


# ---------------------------------------------------------------------- sleep and wake


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_cycle(level: int) -> None:
    with live_server() as live, live.client() as c:
        raw = live.raw_engine()
        greedy = {**CHAT, "max_tokens": 16, "ignore_eos": True}
        before = c.post("/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]
        awake_memory = raw.memory_usage()
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}

        assert c.post(f"/sleep?level={level}").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep_memory = raw.memory_usage()
        assert asleep_memory["kv_cache_bytes"] == 0 < awake_memory["kv_cache_bytes"]
        # The model holds no weights at either level; level 1 keeps them in the host store.
        assert asleep_memory["weights_bytes"] == 0 < awake_memory["weights_bytes"]
        expected_store = awake_memory["weights_bytes"] if level == 1 else 0
        assert asleep_memory["offloaded_weights_bytes"] == expected_store
        state = "weights_offloaded" if level == 1 else "discard_all"
        assert metric_value(c.get("/metrics").text, "tidal:engine_sleep_state", sleep_state=state) == 1

        refused = c.post("/v1/chat/completions", json=greedy)
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "engine_sleeping"
        assert int(refused.headers["retry-after"]) > 0
        assert c.get("/health").status_code == 200  # asleep is alive

        assert c.post(f"/sleep?level={level}").status_code == 200  # idempotent
        assert c.post("/wake_up").json() == {"is_sleeping": False}
        assert c.post("/wake_up").json() == {"is_sleeping": False}  # idempotent
        assert raw.memory_usage() == awake_memory
        after = c.post("/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]
        assert after == before


def test_wake_up_by_tags() -> None:
    with live_server() as live, live.client() as c:
        assert c.post("/sleep?level=1").status_code == 200
        assert c.post("/wake_up?tags=weights").json() == {"is_sleeping": True}  # KV still freed
        assert live.raw_engine().memory_usage()["kv_cache_bytes"] == 0
        assert c.post("/wake_up?tags=kv_cache").json() == {"is_sleeping": False}
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_concurrent_sleep_and_wake_calls_are_serialised() -> None:
    with live_server() as live:
        def call(path: str) -> int:
            with live.client() as c:
                return c.post(path).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(call, ["/sleep?level=1", "/sleep?level=2"] * 4))
        assert statuses == [200] * 8
        level = live.engine.snapshot.sleep_level
        assert level in (1, 2) and live.raw_engine().sleep_level == level
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(call, ["/wake_up"] * 8))
        assert statuses == [200] * 8
        assert not live.raw_engine().is_sleeping()
        with live.client() as c:
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("mode, expected_reason", [("wait", "length"), ("abort", "abort")])
def test_sleep_modes_with_request_in_flight(mode: str, expected_reason: str) -> None:
    with live_server() as live:
        _slow_steps(live, 0.01)
        result: dict[str, Any] = {}

        def long_request() -> None:
            with live.client() as c:
                body = {"prompt": "Go on", "max_tokens": 60, "ignore_eos": True}
                result["response"] = c.post("/v1/completions", json=body).json()

        worker = threading.Thread(target=long_request)
        worker.start()
        assert wait_until(lambda: live.engine.num_in_flight == 1, 10)
        with live.client() as c:
            assert c.post(f"/sleep?level=1&mode={mode}").status_code == 200
            worker.join(30)
            choice = result["response"]["choices"][0]
            assert choice["finish_reason"] == expected_reason
            if mode == "wait":
                assert result["response"]["usage"]["completion_tokens"] == 60
            assert c.get("/is_sleeping").json()["is_sleeping"] is True
            c.post("/wake_up")


def test_sleep_needs_sleep_mode() -> None:
    with live_server(engine={"enable_sleep_mode": False}) as live, live.client() as c:
        response = c.post("/sleep?level=1")
        assert response.status_code == 400
        assert "enable-sleep-mode" in response.json()["error"]["message"]


def test_reset_prefix_cache(client: httpx.Client) -> None:
    response = client.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"reset": True}


# ---------------------------------------------------------------------- a dead engine loop


def test_health_503_once_the_loop_died() -> None:
    engine = make_engine()

    def broken_step() -> Any:
        raise RuntimeError("simulated device failure")

    engine.engine.step = broken_step  # type: ignore[method-assign]
    with LiveServer(engine) as live, live.client() as c:
        failed = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert failed.status_code == 503
        assert wait_until(lambda: c.get("/health").status_code == 503, 5)
        assert c.get("/health").json()["error"]["type"] == "engine_unavailable"
        again = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert again.status_code == 503
