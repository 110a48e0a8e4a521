"""Wake on demand and scale from zero: held requests, one wake_up, bounded queue, timeouts."""

from __future__ import annotations

import asyncio
from typing import Any

from tidal_operator import labels as L
from tidal_operator.router import Registry
from tidal_operator.router.registry import SecretRef

from router_upstreams import FakeEngine, llmservice, pod, run_router_for_test, serve_engines, wait_until


def _registry(*objects: dict[str, Any]) -> Registry:
    registry = Registry()
    for obj in objects:
        if obj["kind"] == "Pod":
            registry.apply_pod_event({"type": "ADDED", "object": obj})
        else:
            registry.apply_llmservice_event({"type": "ADDED", "object": obj})
    return registry


def _chat(model: str, text: str = "hi") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def test_concurrent_requests_to_a_sleeping_model_cause_one_wake_and_all_succeed() -> None:
    wake_gate = asyncio.Event()
    engine = FakeEngine("m-0", api_key="engine-key", sleeping=True, wake_gate=wake_gate)
    async with serve_engines(engine):
        registry = _registry(llmservice("m", secret="m-key"), pod("m-0", "m", engine.port, sleep_state=L.SLEEP_LEVEL_1))
        registry.set_secret(SecretRef("default", "m-key"), "engine-key")
        async with run_router_for_test(registry) as router:
            tasks = [asyncio.create_task(router.client.post("/v1/chat/completions", json=_chat("m", str(i))))
                     for i in range(10)]
            await wait_until(lambda: router.held() == 10 and engine.wake_calls == 1)
            metrics = (await router.client.get("/metrics")).text
            assert 'tidal_router_held_requests{llmservice="m",model="m",namespace="default"} 10.0' in metrics
            demand = (await router.client.get("/debug/demand")).json()["demand"]
            assert demand[0]["held"] == 10 and demand[0]["llmservice"] == "m"
            assert not engine.requests  # nothing reached the engine while it slept
            wake_gate.set()
            responses = await asyncio.gather(*tasks)
            assert [r.status_code for r in responses] == [200] * 10
            assert engine.wake_calls == 1
            assert len(engine.requests) == 10
            assert router.held() == 0
            assert router.metric("tidal_router_wakeups_total", namespace="default", llmservice="m", result="sent") == 1
            # wake_up and is_sleeping carried the engine's key.
            assert set(engine.auth_headers) == {"Bearer engine-key"}


async def test_wake_picks_a_level_1_sleeper_and_routes_to_it() -> None:
    deep, light = FakeEngine("m-0", sleeping=True), FakeEngine("m-1", sleeping=True)
    async with serve_engines(deep, light):
        registry = _registry(llmservice("m"), pod("m-0", "m", deep.port, sleep_state=L.SLEEP_LEVEL_2),
                             pod("m-1", "m", light.port, sleep_state=L.SLEEP_LEVEL_1))
        async with run_router_for_test(registry) as router:
            r = await router.client.post("/v1/chat/completions", json=_chat("m"))
            assert r.status_code == 200 and r.json()["replica"] == "m-1"
            assert (deep.wake_calls, light.wake_calls) == (0, 1)


async def test_full_queue_is_503_and_the_held_requests_still_succeed() -> None:
    wake_gate = asyncio.Event()
    engine = FakeEngine("m-0", sleeping=True, wake_gate=wake_gate)
    async with serve_engines(engine):
        registry = _registry(llmservice("m"), pod("m-0", "m", engine.port, sleep_state=L.SLEEP_LEVEL_1))
        async with run_router_for_test(registry, max_held_per_model=2, retry_after_s=3) as router:
            held = [asyncio.create_task(router.client.post("/v1/chat/completions", json=_chat("m"))) for _ in range(2)]
            await wait_until(lambda: router.held() == 2)
            refused = await router.client.post("/v1/chat/completions", json=_chat("m"))
            assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
            assert "queue is full" in refused.json()["error"]["message"]
            assert router.metric("tidal_router_rejected_requests_total", model="m", reason="queue_full") == 1
            wake_gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def test_hold_timeout_is_503_with_retry_after() -> None:
    registry = _registry(llmservice("m"))  # scaled to zero, and nothing will scale it up
    async with run_router_for_test(registry, hold_timeout_s=0.2, retry_after_s=4) as router:
        r = await router.client.post("/v1/chat/completions", json=_chat("m"))
        assert r.status_code == 503 and r.headers["retry-after"] == "4"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert router.metric("tidal_router_rejected_requests_total", model="m", reason="timeout") == 1
        assert router.held() == 0


async def test_scale_from_zero_records_demand_and_serves_when_a_replica_appears() -> None:
    engine = FakeEngine("m-0")
    async with serve_engines(engine):
        registry = _registry(llmservice("m"))
        async with run_router_for_test(registry) as router:
            request = asyncio.create_task(router.client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
            await wait_until(lambda: router.held() == 1)
            demand = (await router.client.get("/debug/demand")).json()["demand"]
            assert demand == [{"namespace": "default", "llmservice": "m", "held": 1, "totalHeld": 1, "models": ["m"],
                               "heldSince": demand[0]["heldSince"], "lastRequestAt": demand[0]["lastRequestAt"]}]
            # The autoscaler would create the Pod; here the test does. Not Ready yet: still held.
            registry.apply_pod_event({"type": "ADDED", "object": pod("m-0", "m", engine.port, ready=False)})
            await asyncio.sleep(0)
            assert not request.done()
            registry.apply_pod_event({"type": "MODIFIED", "object": pod("m-0", "m", engine.port, resource_version="2")})
            r = await request
            assert r.status_code == 200 and r.json()["replica"] == "m-0"
            assert router.held() == 0


async def test_engine_that_answers_sleeping_is_woken_although_its_label_says_awake() -> None:
    engine = FakeEngine("m-0", sleeping=True)
    async with serve_engines(engine):
        registry = _registry(llmservice("m"), pod("m-0", "m", engine.port))  # label lags: "awake"
        async with run_router_for_test(registry) as router:
            r = await router.client.post("/v1/chat/completions", json=_chat("m"))
            assert r.status_code == 200
            assert engine.wake_calls == 1 and len(engine.requests) == 2  # refused once, then served


async def test_client_leaving_while_held_releases_its_place() -> None:
    registry = _registry(llmservice("m"))
    async with run_router_for_test(registry) as router:
        request = asyncio.create_task(router.client.post("/v1/chat/completions", json=_chat("m")))
        await wait_until(lambda: router.held() == 1)
        request.cancel()
        await wait_until(lambda: router.held() == 0)
