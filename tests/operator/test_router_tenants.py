"""Namespace-scoped client keys: a tenant's key opens its own namespace's models only; the
router-wide key still opens everything."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tidal_operator.router import Registry, RouterConfig, create_app
from tidal_operator.router.auth import TENANT_KEYS_SECRET, ApiKeys, refresh_tenant_keys_once

from router_upstreams import FakeEngine, llmservice, pod, serve, serve_engines

import httpx


def _registry(*objects: dict[str, Any]) -> Registry:
    registry = Registry()
    for obj in objects:
        kind = "pod" if obj["kind"] == "Pod" else "llmservice"
        getattr(registry, f"apply_{kind}_event")({"type": "ADDED", "object": obj})
    return registry


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_namespace_key_opens_only_that_namespaces_models() -> None:
    async with serve_engines(FakeEngine("a-0"), FakeEngine("b-0")) as (ea, eb):
        registry = _registry(llmservice("alpha", namespace="team-a"), pod("a-0", "alpha", ea.port, namespace="team-a"),
                             llmservice("beta", namespace="team-b"), pod("b-0", "beta", eb.port, namespace="team-b"))
        keys = ApiKeys(["admin"])
        keys.set_namespace("team-a", ["key-a"])
        app = create_app(registry, RouterConfig(), api_keys=keys)
        async with serve(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                def auth(key: str) -> dict[str, str]:
                    return {"authorization": f"Bearer {key}"}

                models = (await client.get("/v1/models", headers=auth("key-a"))).json()
                assert [m["id"] for m in models["data"]] == ["alpha"]
                ok = await client.post("/v1/chat/completions", json=_chat("alpha"), headers=auth("key-a"))
                assert ok.status_code == 200 and ok.json()["replica"] == "a-0"
                other = await client.post("/v1/chat/completions", json=_chat("beta"), headers=auth("key-a"))
                assert other.status_code == 404 and "beta" not in other.json()["error"]["message"].split(": ", 1)[1]
                assert eb.requests == []
                assert (await client.get("/metrics", headers=auth("key-a"))).status_code == 403
                assert (await client.get("/v1/models", headers=auth("key-b"))).status_code == 401
                # The router-wide key (platform admins) opens every namespace.
                everything = (await client.get("/v1/models", headers=auth("admin"))).json()
                assert [m["id"] for m in everything["data"]] == ["alpha", "beta"]
                r = await client.post("/v1/chat/completions", json=_chat("beta"), headers=auth("admin"))
                assert r.status_code == 200


async def test_tenant_keys_are_read_from_each_namespaces_secret(tmp_path: Path) -> None:
    k8s = pytest.importorskip("kubernetes_asyncio.client")
    k8s_config = pytest.importorskip("kubernetes_asyncio.config")
    from tidal_operator import dev

    handle = await dev.start_apiserver(crd_dir=Path(__file__).resolve().parents[2] / "crds")
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=str(dev.write_kubeconfig(tmp_path / "kc", handle.url)),
                                      client_configuration=configuration)
    api = k8s.ApiClient(configuration)
    try:
        core = k8s.CoreV1Api(api)
        await core.create_namespaced_secret("team-a", {"metadata": {"name": TENANT_KEYS_SECRET}, "data": {
            "alice": base64.b64encode(b"key-a").decode()}})
        registry = _registry(llmservice("alpha", namespace="team-a"), llmservice("beta", namespace="team-b"))
        keys = ApiKeys(["admin"])
        keys.set_namespace("team-b", ["stale"])  # its Secret is gone: its keys go too
        await refresh_tenant_keys_once(core, registry, keys)
        assert keys.namespaces(b"Bearer key-a") == {"team-a"}
        assert keys.namespaces(b"Bearer stale") == frozenset()
    finally:
        await api.close()
        await handle.stop()
