"""Namespace-scoped client keys: a tenant's key opens its own namespace's models only; the
router-wide key still opens everything."""

from __future__ import annotations

import base64
from typing import Any

from tidal_operator.router import Registry, RouterConfig, create_app
from tidal_operator.router.auth import ApiKeys
from tidal_operator.router.registry import NAMESPACE_ANNOTATION, ROUTER_SECRET

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


def test_namespace_keys_come_from_the_operators_copies_and_go_with_them() -> None:
    from tidal_operator.router.registry import KeyCopies

    def copy(namespace: str, **values: str) -> dict[str, Any]:
        return {"metadata": {"name": f"tidal-client-keys-{namespace}", "labels": {ROUTER_SECRET: "client-keys"},
                             "annotations": {NAMESPACE_ANNOTATION: namespace}},
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}}

    keys = ApiKeys(["admin"])
    copies = KeyCopies(Registry(), keys.set_namespace)
    copies.replace([copy("team-a", alice="key-a"), copy("team-b", bob="key-b")])
    assert keys.namespaces(b"Bearer key-a") == {"team-a"} and keys.namespaces(b"Bearer key-b") == {"team-b"}
    copies.event("MODIFIED", copy("team-a", alice="key-a2"))  # rotated
    assert keys.namespaces(b"Bearer key-a") == frozenset() and keys.namespaces(b"Bearer key-a2") == {"team-a"}
    copies.event("DELETED", copy("team-b"))
    assert keys.namespaces(b"Bearer key-b") == frozenset()
