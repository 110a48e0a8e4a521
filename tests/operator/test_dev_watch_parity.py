"""Watch semantics of the emulated API server that clients rely on, as kube-apiserver has them:
objects entering and leaving a label selection on a live watch, the 410 Gone (Expired) ERROR
event for a resourceVersion out of the history window, and kopf relisting after one.

The server here keeps a 20-change history, so a few writes push a quiet watch's
resourceVersion out of the window, as minutes of other traffic do on a real cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.request
import uuid
from typing import Any, Callable, Iterator

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from tidal_operator.dev import ApiServerHandle, ApiServerThread

from test_dev_apiserver import GADGET_CRD, cm

HISTORY = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServerHandle]:
    crd_dir = tmp_path_factory.mktemp("crds")
    (crd_dir / "gadget.yaml").write_text(yaml.safe_dump(GADGET_CRD))
    with ApiServerThread(crd_dir=crd_dir, history_size=HISTORY, bookmark_interval_s=3600) as handle:
        yield handle


@pytest.fixture(scope="module")
def core(server: ApiServerHandle) -> k8s.CoreV1Api:
    config = k8s.Configuration()
    config.host = server.url
    return k8s.CoreV1Api(k8s.ApiClient(config))


@pytest.fixture
def ns() -> str:
    return "w-" + uuid.uuid4().hex[:8]


def churn(core: k8s.CoreV1Api, ns: str, writes: int = HISTORY + 5) -> None:
    """Writes to another resource: enough to push every older change out of the history."""
    name = "churn-" + uuid.uuid4().hex[:6]
    core.create_namespaced_config_map(ns, cm(name))
    for i in range(writes):
        core.patch_namespaced_config_map(name, ns, {"data": {"i": str(i)}})


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_live_selector_watch_sees_objects_enter_and_leave(server: ApiServerHandle, core: k8s.CoreV1Api,
                                                            ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("in", {"app": "a"}))
    core.create_namespaced_config_map(ns, cm("out", {"app": "b"}))
    listing = core.list_namespaced_config_map(ns, label_selector="app=a")
    assert [i.metadata.name for i in listing.items] == ["in"]
    assert int(listing.metadata.resource_version) >= int(listing.items[0].metadata.resource_version)

    events: list[dict[str, Any]] = []
    opened = threading.Event()

    def follow() -> None:
        url = (f"{server.url}/api/v1/namespaces/{ns}/configmaps?watch=1&labelSelector=app%3Da"
               f"&resourceVersion={listing.metadata.resource_version}&timeoutSeconds=5")
        with urllib.request.urlopen(url, timeout=10) as response:
            opened.set()
            for line in response:
                events.append(json.loads(line))
                if len(events) == 3:
                    return
    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert opened.wait(10)
    core.patch_namespaced_config_map("in", ns, {"metadata": {"labels": {"app": "b"}}})  # leaves
    core.patch_namespaced_config_map("out", ns, {"metadata": {"labels": {"app": "a"}}})  # enters
    core.patch_namespaced_config_map("out", ns, {"data": {"k": "w"}})  # changes inside
    thread.join(10)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("DELETED", "in"), ("ADDED", "out"), ("MODIFIED", "out")]
    left = events[0]["object"]["metadata"]
    # The previous object, the one that matched, at the resourceVersion of the change.
    assert left["labels"] == {"app": "a"}
    assert left["resourceVersion"] == core.read_namespaced_config_map("in", ns).metadata.resource_version
    assert events[2]["object"]["data"] == {"k": "w"}


def test_a_resource_version_out_of_the_window_gets_an_expired_error_event(server: ApiServerHandle,
                                                                          core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("x"))
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    churn(core, ns)
    url = f"{server.url}/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=5"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200  # as kube-apiserver: the watch opens, then one ERROR event ends it
        events = [json.loads(line) for line in response if line.strip()]
    [event] = events
    assert event["type"] == "ERROR"
    status = event["object"]
    assert (status["kind"], status["status"], status["code"], status["reason"]) == ("Status", "Failure", 410,
                                                                                    "Expired")
    assert "too old resource version" in status["message"]

    # The client's way out: list again (a fresh collection resourceVersion), watch from there.
    fresh = core.list_namespaced_config_map(ns).metadata.resource_version
    core.patch_namespaced_config_map("x", ns, {"data": {"k": "again"}})
    stream = k8s_watch.Watch().stream(core.list_namespaced_config_map, ns, resource_version=fresh, timeout_seconds=1)
    assert [(e["type"], e["object"].metadata.name) for e in stream] == [("MODIFIED", "x")]


def test_kopf_relists_after_410_and_keeps_handling(server: ApiServerHandle, core: k8s.CoreV1Api, ns: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    import kopf

    caplog.set_level(logging.DEBUG, logger="kopf._cogs.clients.watching")
    registry = kopf.OperatorRegistry()
    seen: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=server.url)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 1  # each watch request ends after 1 s and resumes from its version
        settings.persistence.finalizer = "tidal.test/kopf"

    @kopf.on.create("tidal.test", "v1", "gadgets", registry=registry)
    def created(name: str, **_: Any) -> None:
        seen.append(name)

    custom = k8s.CustomObjectsApi(core.api_client)

    def gadget(name: str) -> None:
        custom.create_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", {
            "apiVersion": "tidal.test/v1", "kind": "Gadget", "metadata": {"name": name}, "spec": {}})

    def restarted() -> bool:
        return any("Restarting the watch-stream for gadgets" in r.getMessage() for r in caplog.records)

    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        registry=registry, standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)), daemon=True)
    thread.start()
    try:
        assert ready.wait(20)
        gadget("before")
        wait_for(lambda: seen == ["before"], "kopf to handle the first gadget")
        # Other traffic until kopf's quiet gadget watch resumes from a version out of the window.
        wait_for(lambda: restarted() or churn(core, ns), "kopf to get 410 Gone and restart its watch", 60)
        gadget("after")
        wait_for(lambda: seen == ["before", "after"], "kopf to handle a gadget made after the relist")
    finally:
        stop.set()
        thread.join(10)
        for name in ("before", "after"):
            try:
                custom.patch_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", name,
                                                      {"metadata": {"finalizers": None}})
            except k8s.ApiException:
                pass
