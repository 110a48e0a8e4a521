"""The emulated API server, driven by the official Python client, real kubectl and kopf."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from tidal_operator.dev import ApiServerHandle, ApiServerThread, write_kubeconfig

GADGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.tidal.test"},
    "spec": {
        "group": "tidal.test",
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "shortNames": ["gd"],
                  "categories": ["tidal"]},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object",
                                                     "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServerHandle]:
    crd_dir = tmp_path_factory.mktemp("crds")
    (crd_dir / "gadget.yaml").write_text(yaml.safe_dump(GADGET_CRD))
    with ApiServerThread(crd_dir=crd_dir, history_size=300, bookmark_interval_s=0.2) as handle:
        yield handle


@pytest.fixture(scope="module")
def kubeconfig(server: ApiServerHandle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", server.url)


@pytest.fixture(scope="module")
def api(server: ApiServerHandle) -> k8s.ApiClient:
    config = k8s.Configuration()
    config.host = server.url
    return k8s.ApiClient(config)


@pytest.fixture
def core(api: k8s.ApiClient) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(api)


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return "t-" + uuid.uuid4().hex[:8]


@pytest.fixture
def kubectl(kubeconfig: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        result = subprocess.run(["kubectl", *args], input=input, env=env, capture_output=True, text=True, timeout=30)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result
    return run


def cm(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {}, **meta},
            "data": {"k": "v"}}


def raw(server: ApiServerHandle, path: str) -> Any:
    with urllib.request.urlopen(server.url + path, timeout=10) as response:
        return json.loads(response.read())


# --- CRUD through the Python client --------------------------------------------------------------


def test_create_get_list_replace_delete(core: k8s.CoreV1Api, server: ApiServerHandle, ns: str) -> None:
    created = core.create_namespaced_config_map(ns, cm("a"))
    assert created.metadata.uid and created.metadata.resource_version and created.metadata.creation_timestamp
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map(ns, cm("a"))
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "AlreadyExists"

    generated = core.create_namespaced_config_map(ns, {"metadata": {"generateName": "gen-"}})
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9

    listing = raw(server, f"/api/v1/namespaces/{ns}/configmaps")
    assert listing["kind"] == "ConfigMapList" and listing["apiVersion"] == "v1"
    assert int(listing["metadata"]["resourceVersion"]) >= int(created.metadata.resource_version)
    assert {i["metadata"]["name"] for i in listing["items"]} == {"a", generated.metadata.name}

    fresh = core.read_namespaced_config_map("a", ns)
    fresh.data = {"k": "v2"}
    replaced = core.replace_namespaced_config_map("a", ns, fresh)
    assert replaced.data == {"k": "v2"}
    fresh.data = {"k": "stale"}  # still carries the old resourceVersion
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map("a", ns, fresh)
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "Conflict"

    core.delete_namespaced_config_map("a", ns)
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("a", ns)
    assert exc.value.status == 404 and json.loads(exc.value.body)["reason"] == "NotFound"


def test_four_patch_types(server: ApiServerHandle, core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("p", labels={"a": "1"}))
    path = f"/api/v1/namespaces/{ns}/configmaps/p"

    def patch(content_type: str, body: Any) -> dict[str, Any]:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        request = urllib.request.Request(server.url + path, data=data, method="PATCH",
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    merged = patch("application/merge-patch+json", {"metadata": {"labels": {"b": "2", "a": None}}})
    assert merged["metadata"]["labels"] == {"b": "2"}
    rv = merged["metadata"]["resourceVersion"]
    jp = patch("application/json-patch+json", [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                                              {"op": "add", "path": "/data/x", "value": "y"}])
    assert jp["data"] == {"k": "v", "x": "y"}
    with pytest.raises(urllib.error.HTTPError) as exc:  # the same `test` on the now-stale version fails
        patch("application/json-patch+json", [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                                              {"op": "remove", "path": "/data/x"}])
    assert exc.value.code == 422
    sp = patch("application/strategic-merge-patch+json",
               {"metadata": {"finalizers": ["x/y"]}, "data": {"k": None}})
    assert sp["data"] == {"x": "y"} and sp["metadata"]["finalizers"] == ["x/y"]
    applied = patch("application/apply-patch+yaml", "metadata:\n  name: p\n  finalizers: []\ndata:\n  z: w\n")
    assert applied["data"] == {"x": "y", "z": "w"}
    with pytest.raises(urllib.error.HTTPError) as exc:  # a stale resourceVersion in a merge patch is a precondition
        patch("application/merge-patch+json", {"metadata": {"resourceVersion": rv}, "data": {"q": "1"}})
    assert exc.value.code == 409


def test_server_side_apply_of_status_with_one_manager_per_controller(server: ApiServerHandle, ns: str) -> None:
    """Two controllers apply their own conditions of one status (a list keyed by `type`): each
    keeps its own, a field one of them stops sending is removed, another manager's field
    with a different value is a conflict unless forced, and a field someone else changed
    since is not removed."""
    base = f"{server.url}/apis/tidal.test/v1/namespaces/{ns}/gadgets"

    def call(method: str, url: str, body: Any, content_type: str = "application/json") -> dict[str, Any]:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def apply(manager: str, status: dict[str, Any], force: bool = True) -> dict[str, Any]:
        config = {"apiVersion": "tidal.test/v1", "kind": "Gadget", "metadata": {"name": "s"}, "status": status}
        query = f"?fieldManager={manager}" + ("&force=true" if force else "")
        return call("PATCH", f"{base}/s/status{query}", config, "application/apply-patch+yaml")

    def cond(type_: str, status: str) -> dict[str, str]:
        return {"type": type_, "status": status}

    call("POST", base, {"apiVersion": "tidal.test/v1", "kind": "Gadget", "metadata": {"name": "s"}, "spec": {}})
    apply("reconciler", {"phase": "Ready", "endpoint": "http://x", "conditions": [cond("Ready", "True")]})
    both = apply("adapters", {"conditions": [cond("AdaptersReady", "True")]})
    assert [c["type"] for c in both["status"]["conditions"]] == ["Ready", "AdaptersReady"]
    assert {e["manager"] for e in both["metadata"]["managedFields"]} == {"reconciler", "adapters"}

    # The reconciler no longer sends `endpoint` and changes its condition: AdaptersReady stays.
    after = apply("reconciler", {"phase": "Failed", "conditions": [cond("Ready", "False")]})
    assert "endpoint" not in after["status"] and after["status"]["phase"] == "Failed"
    assert {c["type"]: c["status"] for c in after["status"]["conditions"]} == {"Ready": "False",
                                                                              "AdaptersReady": "True"}
    # A condition it stops sending goes whole.
    gone = apply("reconciler", {"phase": "Failed", "conditions": [cond("Ready", "False"), cond("Extra", "True")]})
    assert [c["type"] for c in gone["status"]["conditions"]] == ["Ready", "AdaptersReady", "Extra"]
    after = apply("reconciler", {"phase": "Failed", "conditions": [cond("Ready", "False")]})
    assert after["status"]["conditions"] == [cond("Ready", "False"), cond("AdaptersReady", "True")]
    # The same apply again writes nothing.
    again = apply("reconciler", {"phase": "Failed", "conditions": [cond("Ready", "False")]})
    assert again["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"]

    # Another manager's field with another value: a conflict, unless forced.
    with pytest.raises(urllib.error.HTTPError) as exc:
        apply("adapters", {"phase": "Ready", "conditions": [cond("AdaptersReady", "True")]}, force=False)
    assert exc.value.code == 409 and "reconciler" in json.loads(exc.value.read())["message"]
    apply("adapters", {"phase": "Ready", "conditions": [cond("AdaptersReady", "True")]})
    dropped = apply("reconciler", {"conditions": [cond("Ready", "False")]})
    assert dropped["status"]["phase"] == "Ready"  # the adapters manager owns it now

    # A merge patch takes the field it changes away from its applier.
    call("PATCH", f"{base}/s/status", {"status": {"note": "mine"}}, "application/merge-patch+json")
    apply("reconciler", {"note": "applied", "conditions": [cond("Ready", "False")]})
    call("PATCH", f"{base}/s/status", {"status": {"note": "edited"}}, "application/merge-patch+json")
    kept = apply("reconciler", {"conditions": [cond("Ready", "False")]})
    assert kept["status"]["note"] == "edited"


def test_strategic_merge_of_named_lists(core: k8s.CoreV1Api, ns: str) -> None:
    pod = {"metadata": {"name": "sm"}, "spec": {"containers": [
        {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
        {"name": "b", "image": "y"}]}}
    core.create_namespaced_pod(ns, pod)
    patched = core.patch_namespaced_pod("sm", ns, {"spec": {"containers": [
        {"name": "a", "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]}]}})
    containers = patched.spec.containers
    assert [c.name for c in containers] == ["a", "b"] and containers[0].image == "x"
    assert [(e.name, e.value) for e in containers[0].env] == [("A", "1"), ("B", "3"), ("C", "4")]


def test_generation_and_status_subresource(api: k8s.ApiClient, ns: str) -> None:
    custom = k8s.CustomObjectsApi(api)
    body = {"apiVersion": "tidal.test/v1", "kind": "Gadget", "metadata": {"name": "g"}, "spec": {"size": 1},
            "status": {"phase": "ignored on create"}}
    created = custom.create_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", body)
    assert created["metadata"]["generation"] == 1 and "status" not in created

    labelled = custom.patch_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", "g",
                                                     {"metadata": {"labels": {"x": "y"}}, "status": {"phase": "no"}})
    assert labelled["metadata"]["generation"] == 1 and "status" not in labelled
    status = custom.patch_namespaced_custom_object_status("tidal.test", "v1", ns, "gadgets", "g",
                                                          {"status": {"phase": "Ready"}, "spec": {"size": 99}})
    assert status["status"] == {"phase": "Ready"} and status["spec"] == {"size": 1}
    assert status["metadata"]["generation"] == 1
    resized = custom.patch_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", "g", {"spec": {"size": 2}})
    assert resized["metadata"]["generation"] == 2 and resized["status"] == {"phase": "Ready"}
    same = custom.patch_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", "g", {"spec": {"size": 2}})
    assert same["metadata"]["resourceVersion"] == resized["metadata"]["resourceVersion"]  # no-op write


def test_finalizers_hold_deletion(core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("f", finalizers=["tidal.test/hold"]))
    core.delete_namespaced_config_map("f", ns)
    held = core.read_namespaced_config_map("f", ns)
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("f", ns, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["tidal.test/hold"]}})
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("f", ns)
    assert exc.value.status == 404


def test_owner_reference_garbage_collection(core: k8s.CoreV1Api, ns: str) -> None:
    owner = core.create_namespaced_config_map(ns, cm("owner"))

    def ref(obj: Any) -> list[dict[str, Any]]:
        return [{"apiVersion": "v1", "kind": "ConfigMap", "name": obj.metadata.name, "uid": obj.metadata.uid}]

    child = core.create_namespaced_config_map(ns, cm("child", ownerReferences=ref(owner)))
    core.create_namespaced_config_map(ns, cm("grandchild", ownerReferences=ref(child)))
    other = core.create_namespaced_config_map(ns, cm("other"))
    core.create_namespaced_config_map(ns, cm("shared", ownerReferences=ref(owner) + ref(other)))
    core.delete_namespaced_config_map("owner", ns)
    names = {i.metadata.name for i in core.list_namespaced_config_map(ns).items}
    assert names == {"other", "shared"}  # a dependent with a live owner stays, as in Kubernetes

    # Orphan: the dependents stay, without their reference to the deleted owner.
    core.create_namespaced_config_map(ns, cm("kept", ownerReferences=ref(other)))
    core.delete_namespaced_config_map("other", ns, propagation_policy="Orphan")
    kept, shared = (core.read_namespaced_config_map(n, ns) for n in ("kept", "shared"))
    assert kept.metadata.owner_references is None
    assert "other" not in [r.name for r in shared.metadata.owner_references or []]


def test_pod_deletion_is_graceful_only_when_scheduled(core: k8s.CoreV1Api, ns: str) -> None:
    spec = {"containers": [{"name": "c", "image": "x"}]}
    core.create_namespaced_pod(ns, {"metadata": {"name": "unscheduled"}, "spec": spec})
    core.delete_namespaced_pod("unscheduled", ns)
    with pytest.raises(ApiException):
        core.read_namespaced_pod("unscheduled", ns)
    core.create_namespaced_pod(ns, {"metadata": {"name": "bound"}, "spec": {**spec, "nodeName": "tidal-dev"}})
    core.delete_namespaced_pod("bound", ns)
    pending = core.read_namespaced_pod("bound", ns)
    assert pending.metadata.deletion_timestamp and pending.metadata.deletion_grace_period_seconds == 30
    core.delete_namespaced_pod("bound", ns, grace_period_seconds=0)  # what the kubelet does
    with pytest.raises(ApiException):
        core.read_namespaced_pod("bound", ns)


def test_errors_are_status_objects(server: ApiServerHandle) -> None:
    request = urllib.request.Request(server.url + "/api/v1/namespaces/default/configmaps", method="PUT", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(request, timeout=5)
    status = json.loads(exc.value.read())
    assert exc.value.code == 405 and status["kind"] == "Status" and status["reason"] == "MethodNotAllowed"


# --- watches and selectors -----------------------------------------------------------------------


def test_watch_from_resource_version(core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("before"))
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.create_namespaced_config_map(ns, cm("after"))
    core.patch_namespaced_config_map("after", ns, {"data": {"k": "changed"}})
    core.delete_namespaced_config_map("before", ns)
    events = [(e["type"], e["object"].metadata.name) for e in k8s_watch.Watch().stream(
        core.list_namespaced_config_map, ns, resource_version=rv, timeout_seconds=1)]
    assert events == [("ADDED", "after"), ("MODIFIED", "after"), ("DELETED", "before")]

    # Without a resourceVersion a watch starts with the current state as ADDED events.
    stream = k8s_watch.Watch().stream(core.list_namespaced_config_map, ns, timeout_seconds=1)
    assert [(e["type"], e["object"].metadata.name) for e in stream] == [("ADDED", "after")]


def test_watch_too_old_resource_version_is_gone(core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("churn"))
    old_rv = core.read_namespaced_config_map("churn", ns).metadata.resource_version
    for i in range(320):  # beyond the server's 300-change history window
        core.patch_namespaced_config_map("churn", ns, {"data": {"i": str(i)}})
    with pytest.raises(ApiException) as exc:
        for _ in k8s_watch.Watch().stream(core.list_namespaced_config_map, ns, resource_version=old_rv,
                                          timeout_seconds=2):
            pass
    assert exc.value.status == 410


def test_bookmarks_and_timeout(server: ApiServerHandle, core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("bm"))
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    began = time.monotonic()
    url = f"{server.url}/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={rv}" \
          f"&allowWatchBookmarks=true&timeoutSeconds=1"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        events = [json.loads(line) for line in response if line.strip()]
    assert 0.9 < time.monotonic() - began < 3
    assert events and all(e["type"] == "BOOKMARK" for e in events)
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) >= int(rv)


def test_label_and_field_selectors(core: k8s.CoreV1Api, ns: str) -> None:
    core.create_namespaced_config_map(ns, cm("a", {"app": "a", "tier": "web"}))
    core.create_namespaced_config_map(ns, cm("b", {"app": "b"}))
    core.create_namespaced_config_map(ns, cm("c", {}))

    def names(**kwargs: str) -> set[str]:
        return {i.metadata.name for i in core.list_namespaced_config_map(ns, **kwargs).items}

    assert names(label_selector="app=a") == {"a"}
    assert names(label_selector="app==b") == {"b"}
    assert names(label_selector="app!=a") == {"b", "c"}
    assert names(label_selector="app in (a, b)") == {"a", "b"}
    assert names(label_selector="app notin (a)") == {"b", "c"}
    assert names(label_selector="tier") == {"a"}
    assert names(label_selector="!tier") == {"b", "c"}
    assert names(label_selector="app in (a,b),!tier") == {"b"}
    assert names(field_selector="metadata.name=c") == {"c"}
    assert names(field_selector="metadata.name!=c,metadata.namespace=" + ns) == {"a", "b"}

    core.create_namespaced_event(ns, {"metadata": {"name": "ev1"}, "involvedObject": {"kind": "ConfigMap", "name": "a"},
                                      "reason": "Test", "message": "hello", "type": "Normal"})
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=a,involvedObject.kind=ConfigMap")
    assert [e.metadata.name for e in events.items] == ["ev1"]

    core.create_namespaced_pod(ns, {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(field_selector="status.phase=Pending").items
            if p.metadata.namespace == ns] == ["p"]

    # A watch with a selector sees objects leave (DELETED) and enter (ADDED) the selection.
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.patch_namespaced_config_map("a", ns, {"metadata": {"labels": {"app": "z"}}})
    core.patch_namespaced_config_map("c", ns, {"metadata": {"labels": {"app": "a"}}})
    stream = list(k8s_watch.Watch().stream(
        core.list_namespaced_config_map, ns, label_selector="app=a", resource_version=rv, timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in stream] == [("DELETED", "a"), ("ADDED", "c")]
    # As kube-apiserver: the object that left is sent as it was (still matching the selector),
    # stamped with the resourceVersion of the change that moved it out.
    left = stream[0]["object"].metadata
    assert left.labels["app"] == "a"
    assert left.resource_version == core.read_namespaced_config_map("a", ns).metadata.resource_version


def test_cluster_wide_watch_and_namespaces(core: k8s.CoreV1Api, ns: str) -> None:
    assert {"default", "kube-system"} <= {n.metadata.name for n in core.list_namespace().items}
    core.create_namespace({"metadata": {"name": ns}})
    assert core.read_namespace(ns).status.phase == "Active"
    rv = core.list_config_map_for_all_namespaces().metadata.resource_version
    core.create_namespaced_config_map(ns, cm("x"))
    core.create_namespaced_config_map("default", cm("x-" + ns))
    events = [(e["object"].metadata.namespace, e["object"].metadata.name) for e in k8s_watch.Watch().stream(
        core.list_config_map_for_all_namespaces, resource_version=rv, timeout_seconds=1)]
    assert events == [(ns, "x"), ("default", "x-" + ns)]
    core.delete_namespaced_config_map("x-" + ns, "default")


# --- kubectl -------------------------------------------------------------------------------------


@needs_kubectl
def test_kubectl_discovery_and_crud(kubectl: Callable[..., Any], ns: str) -> None:
    assert "v1.32.0-tidal-dev" in kubectl("version").stdout
    resources = kubectl("api-resources").stdout
    assert "configmaps" in resources and "gadgets" in resources and "customresourcedefinitions" in resources
    manifest = f"""
apiVersion: v1
kind: ConfigMap
metadata: {{name: kc, namespace: {ns}}}
data: {{a: "1"}}
---
apiVersion: v1
kind: Pod
metadata: {{name: kp, namespace: {ns}, labels: {{app: kp}}}}
spec:
  containers:
  - name: c
    image: busybox
    env: [{{name: A, value: "1"}}, {{name: B, value: "2"}}]
"""
    assert "created" in kubectl("apply", "-f", "-", input=manifest).stdout
    # Re-apply with an env var dropped: kubectl's strategic patch deletes it by name.
    assert "configured" in kubectl("apply", "-f", "-", input=manifest.replace(', {name: B, value: "2"}', "")).stdout
    pod = json.loads(kubectl("get", "pod", "kp", "-n", ns, "-o", "json").stdout)
    assert pod["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    assert "kp" in kubectl("get", "pods", "-n", ns, "-l", "app=kp").stdout

    kubectl("patch", "cm", "kc", "-n", ns, "--type", "merge", "-p", '{"data":{"b":"2"}}')
    kubectl("patch", "cm", "kc", "-n", ns, "--type", "json", "-p", '[{"op":"add","path":"/data/c","value":"3"}]')
    kubectl("patch", "cm", "kc", "-n", ns, "-p", '{"data":{"a":null}}')  # strategic is kubectl's default
    got = json.loads(kubectl("get", "cm", "kc", "-n", ns, "-o", "json").stdout)
    assert got["data"] == {"b": "2", "c": "3"}
    got["data"] = {"replaced": "yes"}
    kubectl("replace", "-f", "-", input=json.dumps(got))
    assert kubectl("get", "cm", "kc", "-n", ns, "-o", "jsonpath={.data.replaced}").stdout == "yes"
    assert "serverside-applied" in kubectl("apply", "--server-side", "-f", "-", input=manifest).stdout

    kubectl("delete", "cm", "kc", "-n", ns)
    kubectl("delete", "pod", "kp", "-n", ns, "--wait=true", "--timeout=10s")
    assert kubectl("get", "cm,pods", "-n", ns, "-o", "name").stdout.strip() == ""


@needs_kubectl
def test_kubectl_crd_flow(kubectl: Callable[..., Any], tmp_path: Path, ns: str) -> None:
    crd = {**GADGET_CRD, "metadata": {"name": "doohickeys.tidal.test"}, "spec": {
        **GADGET_CRD["spec"], "scope": "Cluster",
        "names": {"plural": "doohickeys", "singular": "doohickey", "kind": "Doohickey", "shortNames": ["dh"]}}}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    kubectl("apply", "-f", str(tmp_path / "crd.yaml"))
    assert "condition met" in kubectl("wait", "--for=condition=established", "crd/doohickeys.tidal.test",
                                      "--timeout=10s").stdout
    kubectl("apply", "-f", "-", input="apiVersion: tidal.test/v1\nkind: Doohickey\nmetadata: {name: d1}\nspec: {n: 1}\n")
    assert "d1" in kubectl("get", "dh").stdout
    kubectl("apply", "-f", "-", input=f"apiVersion: tidal.test/v1\nkind: Gadget\nmetadata: {{name: g1, namespace: {ns}}}\n")
    assert "g1" in kubectl("get", "gd", "-n", ns).stdout
    assert "g1" in kubectl("get", "tidal", "-n", ns).stdout  # categories
    kubectl("delete", "crd", "doohickeys.tidal.test")
    assert kubectl("get", "dh", check=False).returncode != 0


@needs_kubectl
def test_kubectl_scale_through_the_scale_subresource(kubectl: Callable[..., Any], tmp_path: Path, ns: str) -> None:
    version = {**GADGET_CRD["spec"]["versions"][0], "subresources": {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}}
    crd = {**GADGET_CRD, "metadata": {"name": "scalables.tidal.test"}, "spec": {
        **GADGET_CRD["spec"], "versions": [version],
        "names": {"plural": "scalables", "singular": "scalable", "kind": "Scalable"}}}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    kubectl("apply", "-f", str(tmp_path / "crd.yaml"))
    kubectl("apply", "-n", ns, "-f", "-",
            input="apiVersion: tidal.test/v1\nkind: Scalable\nmetadata: {name: s1}\nspec: {replicas: 1}\n")
    assert "scaled" in kubectl("scale", "-n", ns, "scalable/s1", "--replicas=3").stdout
    replicas = kubectl("get", "-n", ns, "scalable", "s1", "-o", "jsonpath={.spec.replicas}").stdout
    assert replicas == "3"
    assert kubectl("scale", "-n", ns, "scalable/s1", "--replicas=-1", check=False).returncode != 0
    kubectl("delete", "crd", "scalables.tidal.test")


@needs_kubectl
def test_kubectl_logs_follow(kubeconfig: Path, core: k8s.CoreV1Api, server: ApiServerHandle, tmp_path: Path,
                             ns: str) -> None:
    """`kubectl logs -f` streams until the Pod finishes. This server has no kubelet: the test
    writes the log file where the local kubelet would, and finishes the Pod itself."""
    core.create_namespaced_pod(ns, {"metadata": {"name": "talker"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    previous, server.server.log_dir = server.server.log_dir, tmp_path
    path = tmp_path / ns / "talker" / "c.log"
    path.parent.mkdir(parents=True)
    path.write_text("first\n")
    follower = subprocess.Popen(["kubectl", "logs", "-f", "-n", ns, "talker"], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    try:
        assert follower.stdout is not None and follower.stdout.readline() == "first\n"
        with path.open("a") as f:
            f.write("second\n")
        assert follower.stdout.readline() == "second\n"
        core.patch_namespaced_pod_status("talker", ns, {"status": {"phase": "Succeeded"}})
        assert follower.wait(timeout=10) == 0
    finally:
        follower.kill()
        server.server.log_dir = previous


@needs_kubectl
def test_kubectl_imperative_creates_send_protobuf_and_work(kubectl: Callable[..., Any], core: k8s.CoreV1Api,
                                                           ns: str) -> None:
    kubectl("create", "namespace", ns + "-x")
    assert core.read_namespace(ns + "-x").status.phase == "Active"
    kubectl("create", "secret", "generic", "key", "-n", ns, "--from-literal=api-key=s3cret", "--from-literal=b=2")
    secret = core.read_namespaced_secret("key", ns)
    assert base64.b64decode(secret.data["api-key"]) == b"s3cret" and secret.type == "Opaque"
    kubectl("create", "configmap", "conf", "-n", ns, "--from-literal=a=1")
    assert core.read_namespaced_config_map("conf", ns).data == {"a": "1"}


@needs_kubectl
def test_kubectl_get_watch(kubectl: Callable[..., Any], kubeconfig: Path, core: k8s.CoreV1Api, ns: str) -> None:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen(["kubectl", "get", "cm", "-n", ns, "-w", "--no-headers", "-o", "name"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # let kubectl list and open its watch; a late watch still sees it via ADDED
        core.create_namespaced_config_map(ns, cm("watched"))
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "configmap/watched"
    finally:
        proc.terminate()
        proc.wait(5)


# --- kopf ----------------------------------------------------------------------------------------


def test_kopf_operator_reconciles(server: ApiServerHandle, core: k8s.CoreV1Api, api: k8s.ApiClient, ns: str) -> None:
    import kopf

    registry = kopf.OperatorRegistry()
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=server.url)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 30

    @kopf.on.create("tidal.test", "v1", "gadgets", registry=registry)
    def created(body: Any, patch: kopf.Patch, name: str, namespace: str, **_: Any) -> None:
        owned = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"}, "data": {"a": "b"}}
        kopf.adopt(owned, owner=body)
        core.create_namespaced_config_map(namespace, owned)
        patch.status["phase"] = "Created"
        kopf.info(body, reason="Configured", message="owned ConfigMap created")  # kopf POSTs a core/v1 Event

    @kopf.on.delete("tidal.test", "v1", "gadgets", registry=registry)
    def removed(name: str, **_: Any) -> None:
        deleted.append(name)

    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        registry=registry, standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)), daemon=True)
    thread.start()
    try:
        assert ready.wait(20)
        custom = k8s.CustomObjectsApi(api)
        custom.create_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", {
            "apiVersion": "tidal.test/v1", "kind": "Gadget", "metadata": {"name": "k"}, "spec": {"size": 1}})

        def wait_for(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 20
            while not check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.05)

        def gadget() -> dict[str, Any] | None:
            try:
                return custom.get_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", "k")
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        wait_for(lambda: (gadget() or {}).get("status", {}).get("phase") == "Created", "status.phase")
        assert gadget()["metadata"]["finalizers"]  # type: ignore[index]  # kopf's, for on.delete
        owned = core.read_namespaced_config_map("k-config", ns)
        assert owned.metadata.owner_references[0].uid == gadget()["metadata"]["uid"]  # type: ignore[index]
        wait_for(lambda: any(e.reason == "Configured" for e in core.list_namespaced_event(
            ns, field_selector="involvedObject.name=k").items),
                 "kopf's events")

        custom.delete_namespaced_custom_object("tidal.test", "v1", ns, "gadgets", "k")
        wait_for(lambda: gadget() is None, "the gadget to go")
        assert deleted == ["k"]
        assert [c.metadata.name for c in core.list_namespaced_config_map(ns).items] == []
    finally:
        stop.set()
        thread.join(10)
