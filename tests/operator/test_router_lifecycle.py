"""The router's start and stop: not ready (and no 404s) before its watches have listed, and
held requests handed back with a retryable 503 when it shuts down."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn

from tidal_operator.router import Registry, RouterConfig, create_app
from tidal_operator.router.app import DrainingServer

from router_upstreams import CLIENT_KEY, listening_socket, llmservice, run_router_for_test, wait_until

AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def _chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_not_ready_and_no_404_until_every_watch_has_listed() -> None:
    synced = False
    registry = Registry()
    app = create_app(registry, RouterConfig(api_keys=(CLIENT_KEY,)), synced=lambda: synced)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router", headers=AUTH) as client:
        probe = await client.get("/ready", headers={"authorization": ""})  # probes carry no key
        assert probe.status_code == 503 and probe.json() == {"status": "loading"}
        early = await client.post("/v1/chat/completions", json=_chat("m"))
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        assert "still loading" in early.json()["error"]["message"]

        synced = True
        assert (await client.get("/ready", headers={"authorization": ""})).status_code == 200
        late = await client.post("/v1/chat/completions", json=_chat("m"))
        assert late.status_code == 404 and late.json()["error"]["code"] == "model_not_found"


async def test_shutdown_hands_held_requests_back_with_a_retryable_503() -> None:
    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("m")})  # no replica: held
    app = create_app(registry, RouterConfig(api_keys=(CLIENT_KEY,), hold_timeout_s=300))
    sock = listening_socket()
    server = DrainingServer(app.state.proxy, uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
        held = asyncio.create_task(client.post("/v1/chat/completions", json=_chat("m")))
        await wait_until(lambda: app.state.demand.by_service.get(("default", "m")) is not None
                         and app.state.demand.by_service[("default", "m")].held == 1)
        server.should_exit = True  # what SIGTERM does
        answer = await asyncio.wait_for(held, 10)  # long before the 300 s hold timeout
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert "shutting down" in answer.json()["error"]["message"]
    await asyncio.wait_for(serving, 10)
    sock.close()
    assert app.state.metrics.registry.get_sample_value(
        "tidal_router_rejected_requests_total", {"model": "m", "reason": "shutdown"}) == 1


async def test_a_draining_router_is_not_ready_and_holds_nothing_new() -> None:
    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("m")})
    async with run_router_for_test(registry) as router:
        router.app.state.proxy.drain()
        assert (await router.client.get("/ready")).json() == {"status": "draining"}
        r = await router.client.post("/v1/chat/completions", json=_chat("m"))  # no replica: not held at all
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
