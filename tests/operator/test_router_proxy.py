"""The router against real upstream HTTP servers (the test upstreams in router_upstreams.py):
routing, balancing, streaming, failures and auth."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import pytest

from tidal_operator.router import Registry, RouterConfig, create_app
from tidal_operator.router.registry import SecretRef

from router_upstreams import (
    CLIENT_KEY, FakeEngine, closed_port, serve_crashing, llmservice, pod, run_router_for_test, serve_engines, wait_until,
)


def _registry(*objects: dict[str, Any]) -> Registry:
    registry = Registry()
    for obj in objects:
        if obj["kind"] == "Pod":
            registry.apply_pod_event({"type": "ADDED", "object": obj})
        else:
            registry.apply_llmservice_event({"type": "ADDED", "object": obj})
    return registry


def _chat(model: str, text: str = "hi", system: str = "You are helpful.", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            **extra}


async def test_routes_by_model_and_adapter_with_the_engine_key() -> None:
    async with serve_engines(FakeEngine("alpha-0", api_key="engine-a"), FakeEngine("beta-0"),
                             FakeEngine("beta-1")) as (a0, b0, b1):
        registry = _registry(llmservice("alpha", secret="alpha-key"), llmservice("b", served_name="beta", adapters=("sql",)),
                             pod("alpha-0", "alpha", a0.port), pod("b-0", "b", b0.port, adapters="sql"),
                             pod("b-1", "b", b1.port, adapters=""))
        registry.set_secret(SecretRef("default", "alpha-key"), "engine-a")
        async with run_router_for_test(registry) as router:
            r = await router.client.post("/v1/chat/completions", json=_chat("alpha"))
            assert r.status_code == 200 and r.json()["replica"] == "alpha-0"
            assert r.headers["x-tidal-replica"] == "alpha-0"
            # The engine got its own key, never the client's.
            assert a0.auth_headers == ["Bearer engine-a"]
            for _ in range(4):
                r = await router.client.post("/v1/completions", json={"model": "sql", "prompt": "select"})
                assert r.status_code == 200 and r.json()["replica"] == "beta-0" and r.json()["model"] == "sql"
            answered = Counter()
            for _ in range(4):
                r = await router.client.post("/v1/embeddings", json={"model": "beta", "input": "x"})
                answered[r.json()["replica"]] += 1
            assert answered == {"beta-0": 2, "beta-1": 2}
            models = (await router.client.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [(m["id"], m["parent"]) for m in models["data"]] == [("alpha", None), ("beta", None), ("sql", "beta")]
            assert b0.auth_headers[0] is None  # no key configured for beta: none sent


async def test_unknown_model_is_404_listing_models_and_bad_bodies_are_400() -> None:
    registry = _registry(llmservice("alpha", adapters=("sql",)), llmservice("beta"))
    async with run_router_for_test(registry) as router:
        r = await router.client.post("/v1/chat/completions", json=_chat("gamma"))
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "alpha, beta, sql" in error["message"]
        r = await router.client.post("/v1/chat/completions", content=b"{not json",
                                     headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await router.client.post("/v1/completions", json={"prompt": "no model"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await router.client.post("/v1/completions", json=["a list"])
        assert r.status_code == 400
        assert router.metric("tidal_router_requests_total", model="gamma", endpoint="/v1/chat/completions",
                             status="404") == 1


async def test_upstream_4xx_passes_through_unchanged() -> None:
    async with serve_engines(FakeEngine("m-0")) as (e0,):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port))
        async with run_router_for_test(registry) as router:
            r = await router.client.post("/v1/chat/completions", json=_chat("m", force_status=422))
            assert r.status_code == 422
            assert r.json()["error"] == {"message": "forced 422", "type": "invalid_request_error",
                                         "param": "force_status", "code": 422}


async def test_least_load_spreads_concurrent_requests() -> None:
    gate = asyncio.Event()
    async with serve_engines(FakeEngine("m-0", answer_gate=gate), FakeEngine("m-1", answer_gate=gate)) as engines:
        registry = _registry(llmservice("m"), *(pod(e.name, "m", e.port) for e in engines))
        async with run_router_for_test(registry) as router:
            tasks = [asyncio.create_task(router.client.post("/v1/chat/completions", json=_chat("m", str(i))))
                     for i in range(10)]
            await wait_until(lambda: sum(len(e.requests) for e in engines) == 10)
            # All 10 are outstanding at once, so least-load must have split them evenly.
            assert [len(e.requests) for e in engines] == [5, 5]
            assert [e.max_in_flight for e in engines] == [5, 5]
            gate.set()
            responses = await asyncio.gather(*tasks)
            assert all(r.status_code == 200 for r in responses)
            assert router.app.state.proxy.loads.outstanding == {}


async def test_prefix_hash_sticks_to_one_replica_with_bounded_load() -> None:
    engines = [FakeEngine(f"m-{i}") for i in range(3)]
    async with serve_engines(*engines):
        registry = _registry(llmservice("m", strategy="prefixHash"), *(pod(e.name, "m", e.port) for e in engines))
        async with run_router_for_test(registry) as router:
            system = "You are a meticulous assistant for the accounting team. " * 8  # longer than the hashed prefix
            sticky = set()
            for i in range(20):
                r = await router.client.post("/v1/chat/completions", json=_chat("m", f"question {i}", system=system))
                sticky.add(r.json()["replica"])
            assert len(sticky) == 1
            others = Counter()
            for i in range(30):
                r = await router.client.post("/v1/chat/completions", json=_chat("m", "q", system=f"persona {i}"))
                others[r.json()["replica"]] += 1
            assert len(others) == 3, others

            # Bounded load: 8 concurrent requests with the shared prefix overflow the
            # preferred replica at ceil(avg * 1.25) instead of piling onto it.
            gate = asyncio.Event()
            for e in engines:
                e.answer_gate, e.requests = gate, []
            tasks = [asyncio.create_task(router.client.post("/v1/chat/completions",
                                                            json=_chat("m", f"burst {i}", system=system)))
                     for i in range(8)]
            await wait_until(lambda: sum(len(e.requests) for e in engines) == 8)
            counts = {e.name: len(e.requests) for e in engines}
            preferred = sticky.pop()
            assert max(counts.values()) <= 4 and counts[preferred] == max(counts.values()), counts
            assert sum(1 for c in counts.values() if c) >= 2
            gate.set()
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


async def test_engine_reported_load_steers_requests_away_from_a_busy_replica() -> None:
    # Both replicas are idle as far as this router knows, but m-0's engine reports a long
    # queue (another router's requests): every request goes to m-1 once its report is read.
    async with serve_engines(FakeEngine("m-0", api_key="k", load=(8, 12, 0.6)),
                             FakeEngine("m-1", api_key="k", load=(0, 0, 0.0))) as (e0, e1):
        registry = _registry(llmservice("m", secret="m-key"), pod("m-0", "m", e0.port), pod("m-1", "m", e1.port))
        registry.set_secret(SecretRef("default", "m-key"), "k")
        async with run_router_for_test(registry, engine_load_interval_s=0.05) as router:
            loads = router.app.state.proxy.loads
            await wait_until(lambda: len(loads.engines) == 2)  # scraped with the engine key
            replicas = Counter()
            for _ in range(6):
                r = await router.client.post("/v1/chat/completions", json=_chat("m"))
                replicas[r.json()["replica"]] += 1
            assert replicas == {"m-1": 6}
            assert router.metric("tidal_router_replica_requests_total", model="m", namespace="default",
                                 pod="m-1") == 6


async def test_streaming_passes_chunks_through_as_they_come() -> None:
    gate = asyncio.Event()
    async with serve_engines(FakeEngine("m-0", stream_gate=gate)) as (e0,):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port))
        async with run_router_for_test(registry) as router:
            async with router.client.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                lines = r.aiter_lines()
                first = await asyncio.wait_for(anext(lines), 10)
                # Chunk 1 arrived while the upstream still waits on the gate: nothing buffered.
                assert not gate.is_set()
                assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "chunk-1"
                gate.set()
                rest = [line async for line in lines if line]
            assert json.loads(rest[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == "chunk-2"
            assert rest[-1] == "data: [DONE]"


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    never = asyncio.Event()
    async with serve_engines(FakeEngine("m-0", stream_gate=never)) as (e0,):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port))
        async with run_router_for_test(registry) as router:
            async with router.client.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) as r:
                await asyncio.wait_for(anext(r.aiter_lines()), 10)
            # Leaving the block closed our connection mid-stream; the upstream must notice.
            await asyncio.wait_for(e0.stream_cancelled.wait(), 10)
            await wait_until(lambda: router.app.state.proxy.loads.outstanding == {})
            assert router.metric("tidal_router_requests_total", model="m", endpoint="/v1/chat/completions",
                                 status="200") == 1


async def test_connection_refused_is_retried_on_another_replica_and_cooled_down() -> None:
    async with serve_engines(FakeEngine("b-live")) as (live,):
        registry = _registry(llmservice("m"), pod("a-dead", "m", closed_port()), pod("b-live", "m", live.port))
        async with run_router_for_test(registry) as router:
            for _ in range(4):
                r = await router.client.post("/v1/chat/completions", json=_chat("m"))
                assert r.status_code == 200 and r.json()["replica"] == "b-live"
            # Round-robin tie-breaking sends some request to the dead replica first; after
            # that failure it cools down and is not tried again.
            assert router.metric("tidal_router_upstream_errors_total", model="m", kind="connect") == 1
            assert router.metric("tidal_router_retries_total", model="m") == 1
            assert len(live.requests) == 4


async def test_an_engine_503_before_any_byte_is_retried_on_another_replica() -> None:
    # A plain 503 (draining, overloaded) means the engine refused without starting: re-sent.
    async with serve_engines(FakeEngine("m-0", draining=True), FakeEngine("m-1")) as (e0, e1):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port), pod("m-1", "m", e1.port))
        async with run_router_for_test(registry) as router:
            for i in range(4):
                r = await router.client.post("/v1/chat/completions", json=_chat("m", str(i)))
                assert r.status_code == 200 and r.json()["replica"] == "m-1"
            assert len(e0.requests) == 1  # tried once, then cooled down
            assert router.metric("tidal_router_upstream_errors_total", model="m", kind="unavailable") == 1
            assert router.metric("tidal_router_retries_total", model="m") == 1


async def test_a_request_that_reached_an_engine_is_never_replayed() -> None:
    # Both replicas drop the connection after reading the request (as if it crashed them):
    # the first one's failure is answered with a 502, and the second never sees the request.
    async with serve_crashing() as first, serve_crashing() as second:
        registry = _registry(llmservice("m"), pod("m-0", "m", first.port), pod("m-1", "m", second.port))
        async with run_router_for_test(registry, max_retries=2) as router:
            for stream in (False, True):
                r = await router.client.post("/v1/chat/completions", json=_chat("m", stream=stream))
                assert r.status_code == 502
                error = r.json()["error"]
                assert error["type"] == "upstream_error" and "not re-sent" in error["message"]
            assert first.received + second.received == 2
            assert router.metric("tidal_router_retries_total", model="m") == 0
            assert router.metric("tidal_router_upstream_errors_total", model="m", kind="reset") == 2


async def test_failure_mid_stream_ends_with_an_error_event() -> None:
    async with serve_engines(FakeEngine("m-0", fail_midstream=True)) as (e0,):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port))
        async with run_router_for_test(registry) as router:
            async with router.client.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) as r:
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line]
            assert "chunk-1" in events[0]
            error = json.loads(events[1].removeprefix("data: "))["error"]
            assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
            assert events[-1] == "data: [DONE]"
            assert router.metric("tidal_router_upstream_errors_total", model="m", kind="midstream") == 1


async def test_all_replicas_down_is_503_with_retry_after() -> None:
    registry = _registry(llmservice("m"), pod("m-0", "m", closed_port()), pod("m-1", "m", closed_port()))
    async with run_router_for_test(registry, max_retries=2, retry_after_s=7) as router:
        r = await router.client.post("/v1/chat/completions", json=_chat("m"))
        assert r.status_code == 503
        assert r.headers["retry-after"] == "7"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert router.metric("tidal_router_upstream_errors_total", model="m", kind="connect") == 2


async def test_auth_on_every_path_but_health() -> None:
    registry = _registry(llmservice("m"))
    async with run_router_for_test(registry) as router:
        async with httpx.AsyncClient(base_url=router.url) as anonymous:
            assert (await anonymous.get("/health")).status_code == 200
            for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/debug/demand"),
                                 ("GET", "/debug/replicas"), ("POST", "/v1/chat/completions"),
                                 ("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/nope")]:
                missing = await anonymous.request(method, path, json=_chat("m"))
                assert missing.status_code == 401, path
                assert missing.json()["error"]["type"] == "authentication_error"
                assert "Missing" in missing.json()["error"]["message"]
                wrong = await anonymous.request(method, path, json=_chat("m"),
                                                headers={"authorization": "Bearer nope"})
                assert wrong.status_code == 401 and "Invalid" in wrong.json()["error"]["message"]
            ok = await anonymous.get("/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"})
            assert ok.status_code == 200
            metrics = await anonymous.get("/metrics", headers={"authorization": f"Bearer {CLIENT_KEY}"})
            assert metrics.status_code == 200 and "tidal_router_requests_total" in metrics.text


def test_the_app_refuses_to_start_without_keys_unless_told() -> None:
    with pytest.raises(ValueError):
        create_app(Registry(), RouterConfig())
    create_app(Registry(), RouterConfig(allow_unauthenticated=True))


async def test_metrics_follow_prometheus_conventions_and_time_each_request() -> None:
    # Issue 21's observability list, as a scraper sees /metrics: per-model and per-replica
    # request counts, held requests, wakes, retries and a latency histogram in seconds.
    from prometheus_client.parser import text_string_to_metric_families

    async with serve_engines(FakeEngine("m-0")) as (e0,):
        registry = _registry(llmservice("m"), pod("m-0", "m", e0.port))
        async with run_router_for_test(registry) as router:
            assert (await router.client.post("/v1/chat/completions", json=_chat("m"))).status_code == 200
            scraped = await router.client.get("/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
    assert {name: families[name].type for name in (
        "tidal_router_requests", "tidal_router_replica_requests", "tidal_router_retries", "tidal_router_wakeups",
        "tidal_router_held_requests", "tidal_router_request_duration_seconds")} == {
        "tidal_router_requests": "counter", "tidal_router_replica_requests": "counter",
        "tidal_router_retries": "counter", "tidal_router_wakeups": "counter",
        "tidal_router_held_requests": "gauge", "tidal_router_request_duration_seconds": "histogram"}
    for family in families.values():
        assert family.name.startswith("tidal_router_") and family.documentation, family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (family.name + "_total", family.name + "_created"), sample.name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    endpoint = (("endpoint", "/v1/chat/completions"), ("model", "m"))
    assert samples[("tidal_router_request_duration_seconds_count", endpoint)] == 1
    assert samples[("tidal_router_request_duration_seconds_bucket", (endpoint[0], ("le", "+Inf"), endpoint[1]))] == 1
    assert 0 < samples[("tidal_router_request_duration_seconds_sum", endpoint)] < 30
    assert samples[("tidal_router_requests_total", (*endpoint, ("status", "200")))] == 1
    assert samples[("tidal_router_replica_requests_total", (("model", "m"), ("namespace", "default"),
                                                            ("pod", "m-0")))] == 1
