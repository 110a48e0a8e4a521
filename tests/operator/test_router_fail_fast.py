"""Requests that no wait can serve are answered at once, with the reason: an LLMService whose
status says it cannot become Ready, and a LoRA adapter that failed on every replica."""

from __future__ import annotations

import asyncio
from typing import Any

from tidal_operator.router import Registry

from router_upstreams import FakeEngine, llmservice, pod, run_router_for_test, serve_engines, wait_until


def _registry(*objects: dict[str, Any]) -> Registry:
    registry = Registry()
    for obj in objects:
        kind = "pod" if obj["kind"] == "Pod" else "llmservice"
        getattr(registry, f"apply_{kind}_event")({"type": "ADDED", "object": obj})
    return registry


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _invalid(name: str, *, generation: int, seen: int) -> dict[str, Any]:
    obj = llmservice(name)
    obj["metadata"]["generation"] = generation
    obj["status"] = {"conditions": [
        {"type": "Ready", "status": "False", "reason": "InvalidSpec", "observedGeneration": seen,
         "message": "fix the spec: spec.model.uri: unsupported scheme 'ftp'"}]}
    return obj


async def test_a_model_that_cannot_become_ready_is_a_503_naming_the_llmservice_and_reason() -> None:
    async with run_router_for_test(_registry(_invalid("m", generation=3, seen=3)), hold_timeout_s=300) as router:
        r = await router.client.post("/v1/chat/completions", json=_chat("m"))
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "model_not_servable"
        assert "LLMService default/m" in error["message"] and "InvalidSpec" in error["message"]
        assert "unsupported scheme 'ftp'" in error["message"]
        assert router.app.state.demand.by_service == {}  # never held
        assert router.metric("tidal_router_rejected_requests_total", model="m", reason="not_servable") == 1


async def test_a_condition_from_an_older_generation_does_not_fail_the_fixed_spec() -> None:
    # The spec was fixed (generation 4) and the operator has not looked yet: hold, don't fail.
    async with run_router_for_test(_registry(_invalid("m", generation=4, seen=3)), hold_timeout_s=300) as router:
        held = asyncio.create_task(router.client.post("/v1/chat/completions", json=_chat("m")))
        await wait_until(lambda: router.held() == 1)
        held.cancel()


async def test_an_adapter_failed_on_every_replica_is_not_listed_and_fails_fast() -> None:
    async with serve_engines(FakeEngine("m-0")) as (engine,):
        svc = llmservice("m", adapters=("sql", "chat"))
        svc["status"] = {"adapters": [
            {"name": "sql", "loadedReplicas": 0, "errors": ["m-0: adapter_config.json not found"],
             "replicas": [{"pod": "m-0", "state": "Failed", "message": "adapter_config.json not found"}]},
            {"name": "chat", "loadedReplicas": 1, "errors": [], "replicas": [{"pod": "m-0", "state": "Loaded"}]}]}
        registry = _registry(svc, pod("m-0", "m", engine.port, adapters='["chat"]'))
        async with run_router_for_test(registry, hold_timeout_s=300) as router:
            models = (await router.client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m", "chat"]
            r = await router.client.post("/v1/chat/completions", json=_chat("sql"))
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert "'sql'" in message and "failed to load on every replica" in message
            assert "adapter_config.json not found" in message
            assert engine.requests == []
            ok = await router.client.post("/v1/chat/completions", json=_chat("chat"))
            assert ok.status_code == 200
