"""The router's Kubernetes side against the emulated API server (tidal_operator.dev):
the watcher fills the registry (engine keys included), and the annotation lease makes two
router replicas send a single wake_up between them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from tidal_operator import labels as L
from tidal_operator.router import Registry
from tidal_operator.router.metrics import RouterMetrics
from tidal_operator.router.registry import KubernetesWatcher
from tidal_operator.router.waker import WAKE_REQUESTED_BY, KubernetesWakeLease, Waker

from router_upstreams import FakeEngine, llmservice, pod, serve_engines, wait_until

k8s = pytest.importorskip("kubernetes_asyncio.client")
k8s_config = pytest.importorskip("kubernetes_asyncio.config")
dev = pytest.importorskip("tidal_operator.dev")

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture
async def api_client(tmp_path: Path) -> AsyncIterator[Any]:
    async with client_of_a_new_apiserver(tmp_path) as client:
        yield client


@contextlib.asynccontextmanager
async def client_of_a_new_apiserver(tmp_path: Path, **server: Any) -> AsyncIterator[Any]:
    handle = await dev.start_apiserver(crd_dir=CRDS, **server)
    path = dev.write_kubeconfig(tmp_path / "kubeconfig", handle.url)
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    client = k8s.ApiClient(configuration)
    try:
        yield client
    finally:
        await client.close()
        await handle.stop()


async def _create_pod(core: Any, obj: dict[str, Any]) -> None:
    status = obj.pop("status")
    meta = obj["metadata"]
    del meta["resourceVersion"]
    obj["spec"]["containers"][0]["image"] = "test"
    await core.create_namespaced_pod("default", obj)
    await core.patch_namespaced_pod_status(meta["name"], "default", {"status": status},
                                           _content_type="application/merge-patch+json")


async def test_watcher_fills_the_registry_and_follows_changes(api_client: Any) -> None:
    core, custom = k8s.CoreV1Api(api_client), k8s.CustomObjectsApi(api_client)
    # The engine key, as the operator copies it into the router's namespace ("tidal-system").
    from tidal_operator.controller.router_secrets import engine_key_copy

    body = llmservice("m", served_name="smol", adapters=("sql",), secret="m-key")
    created = await custom.create_namespaced_custom_object(L.GROUP, L.VERSION, "default", L.PLURAL, body)
    await core.create_namespaced_secret("tidal-system", engine_key_copy(created, "m-key", "api-key", "engine-key"))
    registry = Registry()
    watcher = KubernetesWatcher(registry, api_client, watch_timeout_s=5, keys_namespace="tidal-system")
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        entry = registry.lookup("smol")
        assert entry is not None and entry.adapters == frozenset({"sql"})
        assert registry.engine_api_key(entry) == "engine-key"
        assert registry.lookup("sql").llmservice == "m"

        # A Pod with the label but not controlled by the LLMService is not one of its replicas.
        await _create_pod(core, pod("stray", "m", 8123, ip="127.0.0.8"))
        replica = pod("m-0", "m", 8123, ip="127.0.0.9")
        replica["metadata"]["ownerReferences"] = [{"apiVersion": L.API_VERSION, "kind": L.KIND, "name": "m",
                                                   "uid": created["metadata"]["uid"], "controller": True}]
        await _create_pod(core, replica)
        await wait_until(lambda: bool(registry.lookup("smol").routable()))
        assert [r.pod_name for r in registry.lookup("smol").replicas] == ["m-0"]
        assert registry.lookup("smol").routable()[0].url == "http://127.0.0.9:8123"

        await core.patch_namespaced_pod("m-0", "default", {"metadata": {"labels": {L.SLEEP_STATE: L.SLEEP_LEVEL_1}}},
                                        _content_type="application/merge-patch+json")
        await wait_until(lambda: bool(registry.lookup("smol").wakeable()))

        await core.delete_namespaced_pod("m-0", "default", grace_period_seconds=0)
        await wait_until(lambda: not registry.lookup("smol").replicas)
        await core.delete_namespaced_pod("stray", "default", grace_period_seconds=0)
        # The copy rotated (the operator patches it when the source changes): the router's watch
        # has the new key, with no 401 from an engine needed to notice.
        await core.patch_namespaced_secret(f"tidal-engine-key-{created['metadata']['uid']}", "tidal-system",
                                           {"data": {"api-key": base64.b64encode(b"rotated").decode()}},
                                           _content_type="application/merge-patch+json")
        await wait_until(lambda: registry.engine_api_key(registry.lookup("smol")) == "rotated")
        # The copy goes (the LLMService lost its auth): so does the key.
        await core.delete_namespaced_secret(f"tidal-engine-key-{created['metadata']['uid']}", "tidal-system")
        await wait_until(lambda: registry.engine_api_key(registry.lookup("smol")) is None)
        await custom.delete_namespaced_custom_object(L.GROUP, L.VERSION, "default", L.PLURAL, "m")
        await wait_until(lambda: registry.lookup("smol") is None)
    finally:
        await watcher.stop()


async def test_a_watch_resuming_from_an_expired_version_relists_and_follows_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """410 Gone: a quiet Pod watch resumes (every watch_timeout_s) from a resourceVersion that
    other traffic pushed out of the server's history (20 changes here, no bookmarks): the
    watcher relists and keeps following."""
    caplog.set_level(logging.INFO, logger="tidal.router.registry")
    async with client_of_a_new_apiserver(tmp_path, history_size=20, bookmark_interval_s=3600) as api_client:
        core, custom = k8s.CoreV1Api(api_client), k8s.CustomObjectsApi(api_client)
        created = await custom.create_namespaced_custom_object(L.GROUP, L.VERSION, "default", L.PLURAL,
                                                               llmservice("m"))
        registry = Registry()
        watcher = KubernetesWatcher(registry, api_client, watch_timeout_s=1)
        await watcher.start()
        try:
            await asyncio.wait_for(watcher.synced.wait(), 10)
            await core.create_namespaced_config_map("default", {"metadata": {"name": "traffic"}, "data": {}})

            def relisted() -> bool:
                return any("pods watch expired (410 Gone); relisting" in r.getMessage() for r in caplog.records)
            deadline = asyncio.get_running_loop().time() + 30
            i = 0
            while not relisted():  # other traffic until the Pod watch's version leaves the window
                assert asyncio.get_running_loop().time() < deadline, "no 410 Gone seen by the Pod watch"
                i += 1
                await core.patch_namespaced_config_map("traffic", "default", {"data": {"i": str(i)}})
                await asyncio.sleep(0.01)

            replica = pod("m-0", "m", 8123, ip="127.0.0.9")
            replica["metadata"]["ownerReferences"] = [{"apiVersion": L.API_VERSION, "kind": L.KIND, "name": "m",
                                                       "uid": created["metadata"]["uid"], "controller": True}]
            await _create_pod(core, replica)
            await wait_until(lambda: bool(registry.lookup("m") and registry.lookup("m").routable()))
        finally:
            await watcher.stop()


async def test_a_bookmark_keeps_a_quiet_watch_resumable(tmp_path: Path) -> None:
    """allowWatchBookmarks, as the router's watches ask: a quiet Pod watch gets BOOKMARKs with
    the server's newest resourceVersion, so after other traffic it resumes from there (no 410),
    where the version of its last Pod event would be gone."""
    from kubernetes_asyncio import watch

    async with client_of_a_new_apiserver(tmp_path, history_size=20, bookmark_interval_s=0.2) as api_client:
        core = k8s.CoreV1Api(api_client)
        listed = (await core.list_namespaced_pod("default")).metadata.resource_version
        await core.create_namespaced_config_map("default", {"metadata": {"name": "traffic"}, "data": {}})
        for i in range(25):  # other traffic: the listed version leaves the 20-change window
            await core.patch_namespaced_config_map("traffic", "default", {"data": {"i": str(i)}})
        newest = (await core.read_namespaced_config_map("traffic", "default")).metadata.resource_version

        async def first_event(since: str) -> dict[str, Any]:
            w = watch.Watch()
            async with w.stream(core.list_namespaced_pod, "default", resource_version=since, timeout_seconds=5,
                                allow_watch_bookmarks=True) as stream:
                async for event in stream:
                    return dict(event)
            raise AssertionError("the watch ended with no event")

        with pytest.raises(k8s.ApiException) as gone:
            await first_event(listed)
        assert gone.value.status == 410
        bookmark = await first_event(newest)  # a fresh start: the first event is a bookmark
        assert bookmark["type"] == "BOOKMARK"
        assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(newest)
        # Resuming from the bookmark's version works; a Pod made now arrives.
        await core.create_namespaced_pod("default", {"metadata": {"name": "p"},
                                                     "spec": {"containers": [{"name": "c", "image": "x"}]}})
        added = await first_event(bookmark["object"]["metadata"]["resourceVersion"])
        assert (added["type"], added["object"].metadata.name) == ("ADDED", "p")


async def test_two_routers_send_one_wake_up_between_them(api_client: Any) -> None:
    core = k8s.CoreV1Api(api_client)
    wake_gate = asyncio.Event()
    engine = FakeEngine("m-0", sleeping=True, wake_gate=wake_gate)
    async with serve_engines(engine):
        await _create_pod(core, pod("m-0", "m", engine.port, sleep_state=L.SLEEP_LEVEL_1))
        current = api_client.sanitize_for_serialization(await core.read_namespaced_pod("m-0", "default"))
        wakers = []
        for holder in ("router-a", "router-b"):  # two router replicas, each with its own view
            registry = Registry()
            registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("m")})
            registry.apply_pod_event({"type": "ADDED", "object": current})
            wakers.append(Waker(registry, httpx.AsyncClient(), RouterMetrics(),
                                lease=KubernetesWakeLease(api_client, holder=holder), poll_interval_s=0.02))
        tasks = [w.ensure_waking(w.registry.lookup("m")) for w in wakers]
        assert all(t is not None for t in tasks)
        await wait_until(lambda: engine.wake_calls == 1)
        annotations = (await core.read_namespaced_pod("m-0", "default")).metadata.annotations
        assert annotations[WAKE_REQUESTED_BY] in ("router-a", "router-b")
        wake_gate.set()
        assert await asyncio.gather(*tasks) == [True, True]
        assert engine.wake_calls == 1
        # The winner marked the Pod awake again and dropped the lease.
        fresh = await core.read_namespaced_pod("m-0", "default")
        assert fresh.metadata.labels[L.SLEEP_STATE] == L.SLEEP_AWAKE
        assert WAKE_REQUESTED_BY not in (fresh.metadata.annotations or {})
        for waker in wakers:
            await waker.http.aclose()


async def test_run_router_serves_what_the_cluster_holds(api_client: Any, tmp_path: Path) -> None:
    from tidal_operator.router import RouterConfig, run_router

    from router_upstreams import closed_port

    custom = k8s.CustomObjectsApi(api_client)
    await custom.create_namespaced_custom_object(L.GROUP, L.VERSION, "default", L.PLURAL, llmservice("m"))
    kubeconfig = dev.write_kubeconfig(tmp_path / "router-kubeconfig", api_client.configuration.host)
    port = closed_port()
    ready = asyncio.Event()
    task = asyncio.create_task(run_router(kubeconfig=str(kubeconfig), host="127.0.0.1", port=port,
                                          config=RouterConfig(api_keys=("k",)), ready=ready, log_level="warning"))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     headers={"authorization": "Bearer k"}) as client:
            assert (await client.get("/health")).status_code == 200

            async def listed() -> list[str]:
                return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

            deadline = asyncio.get_running_loop().time() + 10
            while await listed() != ["m"]:  # the watcher's first list lands asynchronously
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_bookmark_events_do_not_break_the_watch(api_client: Any) -> None:
    # A BOOKMARK carries only metadata.resourceVersion: nothing to apply, no Secret to read.
    registry = Registry()
    watcher = KubernetesWatcher(registry, api_client, watch_timeout_s=5)
    before = registry.lookup("anything")
    await watcher._apply("llmservices", {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}})
    await watcher._apply("pods", {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}})
    assert registry.lookup("anything") == before is None


async def test_the_autoscaler_sees_what_every_router_replica_holds(api_client: Any) -> None:
    # Defect: the operator asked one router URL (the Service: one replica per tick) and missed
    # what the others held. Now each router replica keeps a Lease; the operator sums them.
    from tidal_operator.kube import Kube
    from tidal_operator.router.demand_lease import DemandLeasePublisher
    from tidal_operator.router.waker import DemandBook
    from tidal_operator.scaling.router_demand import LeaseDemandClient

    registry = Registry()
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("m")})
    registry.apply_llmservice_event({"type": "ADDED", "object": llmservice("n")})
    books = [DemandBook(RouterMetrics(), 10), DemandBook(RouterMetrics(), 10)]
    publishers = [DemandLeasePublisher(api_client, "default", f"router-{i}", book, renew_s=30, debounce_s=0)
                  for i, book in enumerate(books)]
    tasks = [asyncio.create_task(p.run()) for p in publishers]
    kube = Kube(api_client)
    reader = LeaseDemandClient(kube.request, "default", ttl_s=0)
    try:
        books[1].hold(registry.lookup("m"))  # held on the second router only
        books[1].hold(registry.lookup("m"))
        books[0].hold(registry.lookup("n"))
        books[1].hold(registry.lookup("n"))

        async def seen() -> tuple[int | None, int | None]:
            return await reader.held("default", "m"), await reader.held("default", "n")

        deadline = asyncio.get_running_loop().time() + 10
        while await seen() != (2, 2):
            assert asyncio.get_running_loop().time() < deadline, await seen()
            await asyncio.sleep(0.02)
        books[1].release(registry.lookup("m"))
        books[1].release(registry.lookup("m"))
        while await seen() != (0, 2):
            assert asyncio.get_running_loop().time() < deadline, await seen()
            await asyncio.sleep(0.02)
    finally:
        for task in tasks:
            task.cancel()
        for p in publishers:
            await p.withdraw()
    assert await reader.held("default", "n") == 0  # withdrawn Leases count for nothing


def test_expired_router_leases_count_for_nothing() -> None:
    from datetime import datetime, timedelta, timezone

    from tidal_operator.router.demand_lease import lease_body
    from tidal_operator.scaling.router_demand import demand_from_leases

    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    held = [{"namespace": "default", "llmservice": "m", "held": 3}]
    fresh = lease_body("tidal-router-demand-a", "a", held, now - timedelta(seconds=5), 15, ("router-a", "uid-a"))
    assert fresh["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "router-a",
                                                     "uid": "uid-a"}]  # garbage-collected with its Pod
    dead = lease_body("tidal-router-demand-b", "b", held, now - timedelta(seconds=16), 15)
    assert demand_from_leases([fresh, dead], now) == {("default", "m"): 3}
