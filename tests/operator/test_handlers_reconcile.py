"""The operator's reconcile pass (controller/llmservice.py) against the in-process emulated API
server, without kopf or a kubelet: Pod readiness is written by the test. Plus the small pure
helpers of controller/."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from tidal_operator import labels as L
from tidal_operator.api.types import OperatorConfig
from tidal_operator.controller import env as E
from tidal_operator.controller import llmservice as H
from tidal_operator.controller.ownership import owned_by, owner_name, replica_index
from tidal_operator.controller.peering import PeeringGate
from tidal_operator.controller.reconciler import Reconciler
from tidal_operator.reconcile.manifests import pod_manifest
from tidal_operator.secret_refs import referenced_secrets, secret_value
from tidal_operator.dev import start_apiserver, write_kubeconfig
from tidal_operator.kube import Kube

CRDS = Path(__file__).resolve().parents[2] / "crds"
CONFIG = OperatorConfig()
NS = "default"


def body(name: str = "m", **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m"}, "replicas": 1, **spec}
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": name, "namespace": NS}, "spec": s}


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[Kube]:
    handle = await start_apiserver(crd_dir=CRDS)
    client = await Kube.connect(str(write_kubeconfig(tmp_path / "kubeconfig", handle.url)))
    try:
        yield client
    finally:
        await client.close()
        await handle.stop()


async def create(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    return await kube.request("POST", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}", body=obj)


async def pods(kube: Kube, name: str = "m") -> list[dict[str, Any]]:
    return await kube.list_pods(NS, L.selector_string(name))


async def set_ready(kube: Kube, pod: str, ready: bool = True) -> None:
    value = "True" if ready else "False"
    await kube.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{pod}/status", content_type="application/merge-patch+json",
                       body={"status": {"phase": "Running", "podIP": "127.0.0.9",
                                        "conditions": [{"type": "Ready", "status": value}]}})


async def run(kube: Kube, name: str = "m") -> H.Outcome | None:
    return await H.reconcile(kube, CONFIG, NS, name)


async def events(kube: Kube, reason: str) -> list[dict[str, Any]]:
    listing = await kube.request("GET", f"/api/v1/namespaces/{NS}/events")
    return [e for e in listing["items"] if e["reason"] == reason]


async def test_creates_service_and_pod_then_reports_ready(kube: Kube) -> None:
    await create(kube, body())
    outcome = await run(kube)
    assert outcome is not None and outcome.valid and len(outcome.created) == 1 and not outcome.converged
    (pod,) = await pods(kube)
    assert pod["metadata"]["ownerReferences"][0]["kind"] == L.KIND
    assert (await kube.get_service(NS, "m"))["spec"]["clusterIP"] == "None"
    llm = await kube.get_llmservice(NS, "m")
    assert llm["status"]["phase"] == "Pending" and llm["status"]["observedGeneration"] == 1

    await set_ready(kube, pod["metadata"]["name"])
    outcome = await run(kube)
    assert outcome is not None and outcome.converged and not outcome.created
    status = (await kube.get_llmservice(NS, "m"))["status"]
    assert status["phase"] == "Ready" and status["replicasText"] == "1/1"
    assert await events(kube, "CreatedPod") and await events(kube, "CreatedService")


async def test_second_pass_is_a_no_op(kube: Kube) -> None:
    await create(kube, body(replicas=2))
    await run(kube)
    for p in await pods(kube):
        await set_ready(kube, p["metadata"]["name"])
    await run(kube)
    before = await kube.get_llmservice(NS, "m")
    outcome = await run(kube)
    assert outcome is not None and outcome.converged and not (outcome.created or outcome.deleted or outcome.repaired)
    after = await kube.get_llmservice(NS, "m")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # no status write


async def test_restart_mid_plan_creates_only_the_missing_pods(kube: Kube) -> None:
    """What an operator killed after its first create leaves behind: one of three Pods. The
    next pass (a restarted operator) creates exactly the other two."""
    llm = await create(kube, body(replicas=3))
    first = pod_manifest(llm, 0, CONFIG)
    assert await kube.create_pod(NS, first)
    outcome = await run(kube)
    assert outcome is not None and len(outcome.created) == 2
    names = sorted(p["metadata"]["name"] for p in await pods(kube))
    assert len(names) == 3 and first["metadata"]["name"] in names
    # A create retried by a second operator gets AlreadyExists and is not an error.
    assert await kube.create_pod(NS, first) is False


async def test_invalid_spec_no_pods_condition_and_one_event(kube: Kube) -> None:
    # A problem the CRD's schema and CEL rules can't see (the API server refuses those).
    await create(kube, body(podTemplate={"labels": {"tidal.dev/llmservice": "other"}}))
    outcome = await run(kube)
    assert outcome is not None and not outcome.valid
    assert await pods(kube) == []
    status = (await kube.get_llmservice(NS, "m"))["status"]
    validated = next(c for c in status["conditions"] if c["type"] == "Validated")
    assert validated["status"] == "False" and "spec.podTemplate.labels" in validated["message"]
    await run(kube)  # the same problem again: no second Event
    assert len(await events(kube, "InvalidSpec")) == 1

    await kube.request("PATCH", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m",
                       content_type="application/merge-patch+json",
                       body={"spec": {"podTemplate": {"labels": {"tidal.dev/llmservice": None}}}})
    outcome = await run(kube)
    assert outcome is not None and outcome.valid and len(outcome.created) == 1
    assert await events(kube, "Validated")


async def test_missing_secret_is_a_problem_until_it_exists(kube: Kube) -> None:
    await create(kube, body(auth={"apiKeySecretRef": {"name": "k"}}))
    assert (await run(kube)).valid is False  # type: ignore[union-attr]
    await kube.request("POST", f"/api/v1/namespaces/{NS}/secrets",
                       body={"metadata": {"name": "k"}, "stringData": {"api-key": "x"}})
    assert (await run(kube)).valid is True  # type: ignore[union-attr]


async def test_rolling_update_keeps_a_ready_pod_until_the_new_one_is_ready(kube: Kube) -> None:
    await create(kube, body())
    await run(kube)
    (old,) = await pods(kube)
    await set_ready(kube, old["metadata"]["name"])
    await run(kube)
    await kube.request("PATCH", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m",
                       content_type="application/merge-patch+json", body={"spec": {"model": {"maxModelLen": 1024}}})
    outcome = await run(kube)
    assert outcome is not None and len(outcome.created) == 1 and not outcome.deleted  # surge: old one stays
    new = outcome.created[0]
    assert (await run(kube)).deleted == ()  # type: ignore[union-attr]  # new not Ready yet
    await set_ready(kube, new)
    outcome = await run(kube)
    assert outcome is not None and outcome.deleted == (old["metadata"]["name"],)


async def test_a_crash_looping_new_pod_is_a_visible_stuck_rollout_and_the_old_pod_serves(kube: Kube) -> None:
    """quantization.weights: awq on a plain checkpoint: the engine exits with its reason, the new
    Pod crash-loops; the Warning Event carries the engine's reason."""
    await create(kube, body())
    await run(kube)
    (old,) = await pods(kube)
    await set_ready(kube, old["metadata"]["name"])
    await run(kube)
    await kube.request("PATCH", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m",
                       content_type="application/merge-patch+json", body={"spec": {"quantization": {"weights": "awq"}}})
    (new,) = (await run(kube)).created  # type: ignore[union-attr]
    engine_said = "ValueError: --quantization awq needs a awq checkpoint, but the model's config.json has none"
    await kube.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{new}/status", content_type="application/merge-patch+json",
                       body={"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                                        "containerStatuses": [{"name": "engine", "ready": False, "started": False,
                                                               "restartCount": 4, "state": {"waiting": {
                                                                   "reason": "CrashLoopBackOff",
                                                                   "message": "back-off 1m20s restarting"}},
                                                               "lastState": {"terminated": {
                                                                   "exitCode": 1, "reason": "Error",
                                                                   "message": f"loading\n{engine_said}\n"}}}]}})
    outcome = await run(kube)
    assert outcome is not None and outcome.deleted == ()
    assert old["metadata"]["name"] in {p["metadata"]["name"] for p in await pods(kube)}  # still serving
    conditions = {c["type"]: c for c in (await kube.get_llmservice(NS, "m"))["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert (conditions["Progressing"]["status"], conditions["Progressing"]["reason"]) == ("False", "RolloutStuck")
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("True", "CrashLoopBackOff")
    assert engine_said in conditions["Degraded"]["message"]
    (warning,) = await events(kube, "CrashLoopBackOff")
    assert warning["type"] == "Warning" and new in warning["message"] and engine_said in warning["message"]


async def test_a_pod_whose_selector_label_was_edited_is_found_by_owner_and_repaired(kube: Kube) -> None:
    await create(kube, body())
    await run(kube)
    (pod,) = await pods(kube)
    name = pod["metadata"]["name"]
    await set_ready(kube, name)
    await kube.patch_pod(NS, name, {"metadata": {"labels": {L.LLMSERVICE: "someone-else"}}})
    assert await pods(kube) == []  # invisible to the label selector now
    outcome = await run(kube)
    assert outcome is not None and outcome.created == () and outcome.repaired == (name,)
    assert [p["metadata"]["name"] for p in await pods(kube)] == [name]
    assert (await kube.get_llmservice(NS, "m"))["status"]["phase"] == "Ready"


async def test_an_orphan_pod_with_the_planned_name_is_adopted(kube: Kube) -> None:
    llm = await create(kube, body())
    orphan = pod_manifest(llm, 0, CONFIG)
    orphan["metadata"]["ownerReferences"] = []  # e.g. left by `kubectl delete --cascade=orphan`
    assert await kube.create_pod(NS, orphan)
    outcome = await run(kube)
    assert outcome is not None and outcome.adopted == (orphan["metadata"]["name"],) and outcome.created == ()
    (pod,) = await pods(kube)
    assert owned_by(pod, llm["metadata"]["uid"])
    assert await events(kube, "AdoptedPod")


async def test_a_pod_of_that_name_controlled_by_something_else_is_left_alone(kube: Kube) -> None:
    llm = await create(kube, body())
    foreign = pod_manifest(llm, 0, CONFIG)
    foreign["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                                               "uid": "other-uid", "controller": True}]
    assert await kube.create_pod(NS, foreign)
    outcome = await run(kube)
    assert outcome is not None and outcome.adopted == () and outcome.created == ()
    pod = await kube.get_pod(NS, foreign["metadata"]["name"])
    assert pod is not None and pod["metadata"]["ownerReferences"][0]["uid"] == "other-uid"
    (warning,) = await events(kube, "PodNameConflict")
    assert "ReplicaSet rs" in warning["message"]


async def test_a_users_service_of_that_name_is_never_patched_and_is_reported(kube: Kube) -> None:
    users = {"metadata": {"name": "m", "namespace": NS},
             "spec": {"selector": {"app": "mine"}, "ports": [{"name": "web", "port": 80}]}}
    await kube.request("POST", f"/api/v1/namespaces/{NS}/services", body=users)
    await create(kube, body())
    outcome = await run(kube)
    assert outcome is not None and outcome.valid and len(outcome.created) == 1  # the Pods still come up
    service = await kube.get_service(NS, "m")
    assert service["spec"]["selector"] == {"app": "mine"} and service["spec"]["ports"][0]["port"] == 80
    status = (await kube.get_llmservice(NS, "m"))["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ServiceConflict")
    assert "endpoint" not in status
    (warning,) = await events(kube, "ServiceConflict")
    assert warning["type"] == "Warning" and "Service m exists" in warning["message"]


async def test_a_disruption_budget_is_owned_kept_in_line_and_garbage_collected(kube: Kube) -> None:
    await create(kube, body(replicas=2))
    await run(kube)
    pdb = await kube.get_pdb(NS, "m")
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == L.selector_labels("m")
    await kube.request("PATCH", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m",
                       content_type="application/merge-patch+json", body={"spec": {"disruption": {"maxUnavailable": 0}}})
    await run(kube)
    assert (await kube.get_pdb(NS, "m"))["spec"]["maxUnavailable"] == 0  # type: ignore[index]
    await kube.request("DELETE", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m")
    assert await kube.get_pdb(NS, "m") is None  # the garbage collector follows the ownerReference


KEDA_CRD = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "scaledobjects.keda.sh"},
            "spec": {"group": "keda.sh", "scope": "Namespaced",
                     "names": {"plural": "scaledobjects", "singular": "scaledobject", "kind": "ScaledObject"},
                     "versions": [{"name": "v1alpha1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


async def external_condition(kube: Kube) -> dict[str, Any] | None:
    conditions = (await kube.get_llmservice(NS, "m"))["status"]["conditions"]
    return next((c for c in conditions if c["type"] == "ExternalAutoscaler"), None)


async def test_modes_hpa_and_keda_create_and_own_their_autoscaler(kube: Kube) -> None:
    autoscaling = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3, "metric": "requestsWaiting", "target": 2}
    llm = await create(kube, body(replicas=1, autoscaling=autoscaling))
    await run(kube)
    hpa = await kube.get_hpa(NS, "m")
    assert hpa is not None and owned_by(hpa, llm["metadata"]["uid"]) and hpa["spec"]["maxReplicas"] == 3
    assert (await external_condition(kube))["reason"] == "HorizontalPodAutoscalerReady"  # type: ignore[index]

    # keda without KEDA installed: said in a condition; the HPA of the old mode goes.
    patch = {"spec": {"autoscaling": {"mode": "keda"}}}
    path = f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m"
    await kube.request("PATCH", path, content_type="application/merge-patch+json", body=patch)
    await run(kube)
    assert await kube.get_hpa(NS, "m") is None
    condition = await external_condition(kube)
    assert condition is not None and (condition["status"], condition["reason"]) == ("False", "KEDANotInstalled")

    # KEDA installed: the ScaledObject is created and owned.
    await kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=KEDA_CRD)
    await run(kube)
    scaled = await kube.get_scaled_object(NS, "m")
    assert scaled is not None and owned_by(scaled, llm["metadata"]["uid"])
    assert (await external_condition(kube))["status"] == "True"  # type: ignore[index]

    # Back to fixed replicas: the ScaledObject goes, and so does the condition.
    await kube.request("PATCH", path, content_type="application/merge-patch+json", body={"spec": {"autoscaling": None}})
    await run(kube)
    assert await kube.get_scaled_object(NS, "m") is None and await external_condition(kube) is None


async def test_label_drift_is_restored_and_container_drift_replaced(kube: Kube) -> None:
    await create(kube, body())
    await run(kube)
    (pod,) = await pods(kube)
    name = pod["metadata"]["name"]
    await set_ready(kube, name)
    await kube.patch_pod(NS, name, {"metadata": {"labels": {L.APP_COMPONENT: "x", L.REPLICA_INDEX: None},
                                                 "annotations": {"mine": "kept"}}})
    outcome = await run(kube)
    assert outcome is not None and outcome.repaired == (name,)
    (pod,) = await pods(kube)
    assert pod["metadata"]["labels"][L.APP_COMPONENT] == "engine" and pod["metadata"]["labels"][L.REPLICA_INDEX] == "0"
    assert pod["metadata"]["annotations"]["mine"] == "kept"

    await kube.patch_pod(NS, name, {"spec": {"containers": [{"name": "engine", "image": "evil:1"}]}})
    outcome = await run(kube)
    assert outcome is not None and len(outcome.created) == 1  # a replacement, rolled in with surge


async def test_gone_or_deleting_llmservice_is_left_to_the_garbage_collector(kube: Kube) -> None:
    assert await run(kube, "absent") is None


async def test_reconciler_coalesces_concurrent_triggers(kube: Kube) -> None:
    await create(kube, body())
    reconciler = Reconciler(kube, CONFIG)
    outcomes = await asyncio.gather(*(reconciler.run(NS, "m") for _ in range(5)))
    ran = [o for o in outcomes if o is not None]
    assert 1 <= len(ran) <= 2  # the running pass, plus at most one queued behind it
    assert len(await pods(kube)) == 1
    assert ("default", "m") in reconciler.unsettled  # not Ready yet: the resync revisits it


# --- pure helpers -------------------------------------------------------------------------------

def test_referenced_secrets_reads_invalid_specs_leniently() -> None:
    spec = {"auth": {"apiKeySecretRef": {"name": "a"}}, "model": {"uri": "x", "hfTokenSecretRef": {"name": "h"}}}
    assert referenced_secrets(spec) == ["a", "h"]
    assert referenced_secrets({"auth": "nonsense", "model": None}) == []


def test_secret_value_decodes_data_and_reads_string_data() -> None:
    secret = {"data": {"k": "IHMzY3JldAo="}, "stringData": {"p": " plain "}}  # " s3cret\n"
    assert secret_value(secret, "k") == "s3cret" and secret_value(secret, "p") == "plain"
    assert secret_value(secret, "absent") is None and secret_value({}, "k") is None


def test_owner_name_and_replica_index() -> None:
    pod = {"metadata": {"ownerReferences": [{"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "name": "m",
                                             "uid": "u", "controller": True}]}}
    assert owner_name(pod) == "m" and owned_by(pod, "u") and not owned_by(pod, "v")
    assert owner_name({"metadata": {}}) is None
    assert replica_index("m-0123456789-4", "m", "0123456789") == 4
    assert replica_index("m-0123456789-x", "m", "0123456789") is None
    assert replica_index("other-0123456789-1", "m", "0123456789") is None


def test_status_to_apply_holds_its_own_fields_and_nothing_when_unchanged() -> None:
    old = {"phase": "Ready", "endpoint": "http://x", "desiredReplicas": 3, "scalingHistory": [1],
           "conditions": [{"type": "AdaptersReady", "status": "True"}]}
    new = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}
    # endpoint is left out, so the apply removes it; AdaptersReady is not the reconcile's.
    assert H.status_to_apply(new, old) == {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}
    same = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}
    assert H.status_to_apply(same, {**same, "conditions": [*same["conditions"], {"type": "AdaptersReady"}]}) is None


def test_status_to_apply_leaves_desired_replicas_to_the_autoscaler_when_it_owns_them() -> None:
    # One writer of replica counts: with builtin autoscaling running, only its loop writes
    # status.desiredReplicas; the reconcile writes it otherwise (spec.replicas, HPA, KEDA).
    old = {"phase": "Ready", "desiredReplicas": 3, "conditions": []}
    new = {"phase": "Ready", "desiredReplicas": 1, "conditions": []}
    assert H.status_to_apply(new, old) == {"phase": "Ready", "desiredReplicas": 1, "conditions": []}
    assert H.status_to_apply(new, old, autoscaler_owns_desired=True) is None


async def test_the_reconcile_and_the_adapter_sync_each_keep_their_own_conditions(kube: Kube) -> None:
    from tidal_operator.kube import MANAGER_ADAPTERS

    await create(kube, body())
    await run(kube)
    adapters = {"type": "AdaptersReady", "status": "False", "reason": "Loading", "message": "sql: loading"}
    await kube.apply_llmservice_status(NS, "m", {"adapters": [], "conditions": [adapters]}, manager=MANAGER_ADAPTERS)
    (pod,) = await pods(kube)
    await set_ready(kube, pod["metadata"]["name"])
    await run(kube)  # Ready now: the reconcile rewrites its conditions
    status = (await kube.get_llmservice(NS, "m"))["status"]
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["status"] == "True" and by_type["AdaptersReady"]["reason"] == "Loading"
    # An invalid edit: the reconcile drops its endpoint, the adapter sync's condition stays.
    await kube.request("PATCH", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}/m",
                       content_type="application/merge-patch+json",
                       body={"spec": {"podTemplate": {"labels": {"tidal.dev/x": "y"}}}})
    await run(kube)
    status = (await kube.get_llmservice(NS, "m"))["status"]
    assert "endpoint" not in status and status["desiredReplicas"] == 1
    assert "AdaptersReady" in {c["type"] for c in status["conditions"]}
    managers = {e["manager"] for e in (await kube.get_llmservice(NS, "m"))["metadata"]["managedFields"]}
    assert managers == {"tidal-operator", MANAGER_ADAPTERS}


def test_config_from_env() -> None:
    config = E.config_from_env({E.ENV_DEFAULT_IMAGE: "img:1", E.ENV_ADAPTER_PREFIXES: "hf://, s3://",
                                E.ENV_NAMESPACE: "ml"})
    assert config.default_engine_image == "img:1" and config.allowed_adapter_uri_prefixes == ("hf://", "s3://")
    assert config.namespace == "ml" and config.allowed_file_roots == ()
    assert E.config_from_env({}) == OperatorConfig()


def test_pre_stop_sleep_from_env_reaches_the_engine_pod_and_bad_values_are_refused() -> None:
    config = E.config_from_env({E.ENV_PRE_STOP_SLEEP: "1"})
    assert config.pre_stop_sleep_seconds == 1
    llm = {**body(), "metadata": {"name": "m", "namespace": NS, "uid": "u1"}}
    pod = pod_manifest(llm, 0, config)
    assert pod["spec"]["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": 1}}
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match=E.ENV_PRE_STOP_SLEEP):
            E.config_from_env({E.ENV_PRE_STOP_SLEEP: bad})


def test_peering_gate_yields_to_a_live_higher_priority_peer() -> None:
    class FakeKube:
        def __init__(self, status: dict[str, Any]) -> None:
            self.status = status

        async def get_peering(self, name: str, namespace: str | None) -> dict[str, Any]:
            return {"status": self.status}

    import kopf
    settings = kopf.OperatorSettings()
    settings.peering.clusterwide = True
    settings.peering.priority = 10
    now = datetime.now(timezone.utc).isoformat()
    old = "2000-01-01T00:00:00+00:00"
    cases = [({"me": {"priority": 10, "lastseen": now, "lifetime": 60}}, True),
             ({"other": {"priority": 20, "lastseen": now, "lifetime": 60}}, False),
             ({"other": {"priority": 20, "lastseen": old, "lifetime": 60}}, True),
             ({"other": {"priority": 5, "lastseen": now, "lifetime": 60}}, True)]
    for status, active in cases:
        gate = PeeringGate(FakeKube(status), settings, "me")  # type: ignore[arg-type]
        assert asyncio.run(gate.active()) is active, status
    settings.peering.standalone = True
    assert asyncio.run(PeeringGate(FakeKube({"x": {"priority": 99, "lastseen": now}}), settings, "me").active())  # type: ignore[arg-type]


async def test_a_later_claim_on_a_served_name_is_a_conflict_with_an_event(kube: Kube) -> None:
    # Served names are global to the router: team-b's later "shared" must not shadow default's.
    await create(kube, body("a", model={"uri": "bundled://smollm2-135m", "servedName": "shared"}))
    later = body("b", model={"uri": "bundled://smollm2-135m", "servedName": "shared"})
    later["metadata"]["namespace"] = "team-b"
    await kube.request("POST", f"/apis/{L.GROUP}/{L.VERSION}/namespaces/team-b/{L.PLURAL}", body=later)

    first = await run(kube, "a")
    assert first is not None and first.valid
    outcome = await H.reconcile(kube, CONFIG, "team-b", "b")
    assert outcome is not None and not outcome.valid
    assert await kube.list_pods("team-b", L.selector_string("b")) == []
    status = (await kube.get_llmservice("team-b", "b"))["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ServedNameConflict"
    assert "already served by LLMService default/a" in ready["message"]
    listing = await kube.request("GET", "/api/v1/namespaces/team-b/events")
    assert [e["reason"] for e in listing["items"] if e["type"] == "Warning"] == ["ServedNameConflict"]
    # The first claimant is untouched by the second.
    assert (await run(kube, "a")).valid  # type: ignore[union-attr]


async def test_the_router_gets_copies_of_engine_and_namespace_keys_in_its_own_namespace(kube: Kube) -> None:
    import base64

    from tidal_operator.controller.router_secrets import ROUTER_SECRET, sync_router_secrets

    def b64(value: str) -> str:
        return base64.b64encode(value.encode()).decode()

    await kube.request("POST", f"/api/v1/namespaces/{NS}/secrets",
                       body={"metadata": {"name": "m-key"}, "data": {"api-key": b64("engine-secret")}})
    await kube.request("POST", f"/api/v1/namespaces/{NS}/secrets",
                       body={"metadata": {"name": "tidal-client-keys"}, "data": {"alice": b64("tenant-key")}})
    llm = await create(kube, body(auth={"apiKeySecretRef": {"name": "m-key"}}))
    await sync_router_secrets(kube, "tidal-system", None)

    async def copies() -> dict[str, dict[str, Any]]:
        listing = await kube.request("GET", "/api/v1/namespaces/tidal-system/secrets",
                                     query={"labelSelector": ROUTER_SECRET})
        return {s["metadata"]["name"]: s for s in listing["items"]}

    found = await copies()
    engine = found[f"tidal-engine-key-{llm['metadata']['uid']}"]
    assert engine["data"] == {"api-key": b64("engine-secret")}
    assert engine["metadata"]["annotations"]["tidal.dev/source-secret"] == f"{NS}/m-key"
    # The deprecated fixed name, without the label, is still copied (as its source says).
    tenant = next(s for s in found.values() if s["metadata"]["labels"][ROUTER_SECRET] == "client-keys")
    assert tenant["data"] == {"alice": b64("tenant-key")}
    assert tenant["metadata"]["annotations"]["tidal.dev/namespace"] == NS
    # Rotation reaches the copy; a deleted source removes it.
    await kube.request("PATCH", f"/api/v1/namespaces/{NS}/secrets/m-key", content_type="application/merge-patch+json",
                       body={"data": {"api-key": b64("rotated")}})
    await kube.request("DELETE", f"/api/v1/namespaces/{NS}/secrets/tidal-client-keys")
    await sync_router_secrets(kube, "tidal-system", None)
    found = await copies()
    assert set(found) == {f"tidal-engine-key-{llm['metadata']['uid']}"}
    assert found[f"tidal-engine-key-{llm['metadata']['uid']}"]["data"] == {"api-key": b64("rotated")}


async def test_a_gpu_share_member_placed_elsewhere_than_its_group_is_refused_with_an_event(kube: Kube) -> None:
    share = {"group": "pair", "memoryFraction": 0.6}
    await create(kube, body("a", gpuShare=share))
    await run(kube, "a")
    await create(kube, body("b", gpuShare=share, podTemplate={"nodeSelector": {"pool": "other"}}))
    outcome = await run(kube, "b")
    assert outcome is not None and not outcome.valid
    assert await kube.list_pods(NS, L.selector_string("b")) == []
    validated = next(c for c in (await kube.get_llmservice(NS, "b"))["status"]["conditions"]
                     if c["type"] == "Validated")
    assert validated["status"] == "False" and validated["reason"] == "GPUShareConflict"
    assert "nodeSelector" in validated["message"] and f"{NS}/a" in validated["message"]
    listing = await kube.request("GET", f"/api/v1/namespaces/{NS}/events")
    assert any(e["type"] == "Warning" and e["reason"] == "GPUShareConflict" and "nodeSelector" in e["message"]
               and e["involvedObject"]["name"] == "b" for e in listing["items"])
    # A member placed like the first one is fine, and the first is untouched.
    await create(kube, body("c", gpuShare=share))
    assert (await run(kube, "c")).valid  # type: ignore[union-attr]
    assert (await run(kube, "a")).valid  # type: ignore[union-attr]


def test_only_an_orphan_with_the_operators_labels_for_that_name_counts_as_left_behind() -> None:
    from tidal_operator.controller.companions import left_by

    llm = {"metadata": {"name": "m", "namespace": NS, "uid": "u2"}}
    ours = {L.MANAGED_BY: L.MANAGED_BY_VALUE, L.LLMSERVICE: "m"}
    assert left_by(llm, {"metadata": {"name": "m", "labels": ours}})
    assert not left_by(llm, {"metadata": {"name": "m", "labels": {**ours, L.LLMSERVICE: "other"}}})
    assert not left_by(llm, {"metadata": {"name": "m", "labels": {"team": "theirs"}}})  # a user's
    controlled = [{"uid": "u1", "kind": "LLMService", "name": "m", "controller": True}]
    assert not left_by(llm, {"metadata": {"name": "m", "labels": ours, "ownerReferences": controlled}})
