"""Namespace-scoped client keys: a tenant's key opens its own namespace's models only; the
router-wide key still opens everything."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

from tidal_operator.router import Registry, RouterConfig, create_app
from tidal_operator.router.auth import ApiKeys
from tidal_operator.router.registry import NAMESPACE_ANNOTATION, ROUTER_SECRET

from router_upstreams import FakeEngine, llmservice, pod, serve, serve_engines, wait_until

import httpx
import pytest


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


async def test_labelled_secrets_grant_their_own_namespace_and_rotation_and_removal_follow(tmp_path: Path) -> None:
    # The whole chain against the emulated API server: tenant Secrets found by label in their
    # namespaces → the operator's copies in the router's namespace → the router's watch of
    # those copies only → the keys the router accepts, each scoped to its source namespace.
    k8s = pytest.importorskip("kubernetes_asyncio.client")
    k8s_config = pytest.importorskip("kubernetes_asyncio.config")
    from tidal_operator.controller.router_secrets import CLIENT_KEYS_LABEL, sync_router_secrets
    from tidal_operator.dev import start_apiserver, write_kubeconfig
    from tidal_operator.kube import Kube
    from tidal_operator.router.registry import KubernetesWatcher

    handle = await start_apiserver(crd_dir=Path(__file__).resolve().parents[2] / "crds")
    config_path = write_kubeconfig(tmp_path / "kubeconfig", handle.url)
    kube = await Kube.connect(str(config_path))
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=str(config_path), client_configuration=configuration)
    api_client = k8s.ApiClient(configuration)
    keys = ApiKeys(["admin"])
    watcher = KubernetesWatcher(Registry(), api_client, watch_timeout_s=5, keys_namespace="tidal-system",
                                client_keys=keys.set_namespace)

    def secret(name: str, labels: dict[str, str] | None = None, **values: str) -> dict[str, Any]:
        # team-b's Secret claims team-a in an annotation: the copy takes the real namespace.
        return {"metadata": {"name": name, "labels": labels or {},
                             "annotations": {NAMESPACE_ANNOTATION: "team-a"}},
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}}

    def opens(key: str) -> frozenset[str]:
        return keys.namespaces(f"Bearer {key}".encode())

    async def secrets(method: str, namespace: str, name: str = "", body: Any = None) -> None:
        await kube.request(method, f"/api/v1/namespaces/{namespace}/secrets" + (f"/{name}" if name else ""),
                           body=body, content_type="application/merge-patch+json" if method == "PATCH" else
                           "application/json")

    label = {CLIENT_KEYS_LABEL: "true"}
    try:
        await secrets("POST", "team-a", body=secret("apps", label, one="key-a1", two="key-a2"))
        await secrets("POST", "team-a", body=secret("ci", label, bot="key-a3"))  # several Secrets per namespace
        await secrets("POST", "team-b", body=secret("apps", label, one="key-b"))
        await secrets("POST", "team-b", body=secret("unlabelled", None, x="key-x"))
        await secrets("POST", "team-b", body=secret("off", {CLIENT_KEYS_LABEL: "false"}, x="key-off"))
        await sync_router_secrets(kube, "tidal-system", None)
        await watcher.start()
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await wait_until(lambda: bool(opens("key-b")))
        assert opens("key-a1") == opens("key-a2") == opens("key-a3") == {"team-a"}
        assert opens("key-b") == {"team-b"}  # not team-a, whatever its annotations claim
        assert opens("key-x") == opens("key-off") == frozenset()

        # Rotated: the new value opens team-a, the old one nothing. Deleted: revoked.
        await secrets("PATCH", "team-a", "apps", {"data": {"one": base64.b64encode(b"key-a9").decode()}})
        await secrets("DELETE", "team-a", "ci")
        await sync_router_secrets(kube, "tidal-system", None)
        await wait_until(lambda: opens("key-a9") == {"team-a"} and not opens("key-a3"))
        assert opens("key-a1") == frozenset() and opens("key-a2") == {"team-a"}
        # The label taken off: revoked too. A namespaced operator copies only its namespace's.
        await secrets("PATCH", "team-b", "apps", {"metadata": {"labels": {CLIENT_KEYS_LABEL: None}}})
        await sync_router_secrets(kube, "tidal-system", "team-a")
        await wait_until(lambda: not opens("key-b"))
        assert opens("key-a9") == {"team-a"}
    finally:
        await watcher.stop()
        await api_client.close()
        await kube.close()
        await handle.stop()
