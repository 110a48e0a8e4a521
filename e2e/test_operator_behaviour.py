"""Operator behaviour on `tidal dev` with the real kubectl, using fake engines (the kubelet
marks Pods Ready without running a process): invalid specs, drift, a restart mid-reconcile,
and the schemas of everything generated. No real engine is needed to show any of these, and
the CPU is saved for the quickstart tests.

As on a real cluster, the emulated API server applies the CRD's schema and CEL rules, so some
invalid specs are refused at `kubectl apply` (a bad URI scheme, an unknown quantization,
negative replicas). What only the operator can see (a missing Secret, a reserved label) reaches
it, and its own validation reports it in status and Events.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 30  # anything with fake engines settles far sooner


def llmservice(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512}, "replicas": 1}
    for key, value in spec.items():
        body[key] = value
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name}, "spec": body}


def apply(stack: Any, *objs: dict[str, Any]) -> None:
    stack.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))


# Refused by the CRD (schema and CEL) at apply: (the object, what kubectl's error must mention).
REFUSED = {
    "bad-scheme": (llmservice("bad-scheme", model={"uri": "s3://bucket/model"}), "URI scheme"),
    "bad-quant": (llmservice("bad-quant", quantization={"weights": "int3"}), "spec.quantization.weights"),
    "bad-gpus": (llmservice("bad-gpus", parallelism={"tensor": 2, "pipeline": 2}, engine={"resources": {"gpu": 2}}),
                 "must equal parallelism.tensor x parallelism.pipeline"),
    "bad-replicas": (llmservice("bad-replicas", replicas=-1), "spec.replicas"),
}

# What the API server can't see: (the invalid object, the fix as a merge patch, the message's words).
INVALID = {
    "reserved-label": (llmservice("reserved-label", podTemplate={"labels": {"tidal.dev/llmservice": "x"}}),
                       {"spec": {"podTemplate": {"labels": {"tidal.dev/llmservice": None}}}}, "reserved"),
    "no-secret": (llmservice("no-secret", auth={"apiKeySecretRef": {"name": "no-secret-key"}}),
                  None, "Secret 'no-secret-key'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_api_server_refuses_what_the_crd_rules_out(fake_stack: Any, name: str) -> None:
    obj, mention = REFUSED[name]
    out = fake_stack.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert "is invalid" in out and mention in out, out
    assert "NotFound" in fake_stack.kubectl("get", "llm", name, check=False)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_spec_gives_no_pod_then_proceeds_once_fixed(fake_stack: Any, name: str) -> None:
    obj, fix, mention = INVALID[name]
    apply(fake_stack, obj)
    validated = fake_stack.wait_for(lambda: (c := fake_stack.condition(name, "Validated")).get("status") == "False"
                                    and c, BOUND_S, f"{name}: Validated=False")
    assert mention in validated["message"], validated
    assert fake_stack.llm(name)["status"]["phase"] == "Failed"
    warning = fake_stack.wait_for(lambda: [e for e in fake_stack.events(name)
                                           if e["type"] == "Warning" and e["reason"] == "InvalidSpec"],
                                  BOUND_S, f"{name}: an InvalidSpec Event")
    assert mention in warning[0]["message"]
    assert fake_stack.pods(name) == []

    if fix is None:  # the missing Secret: create it (the operator rechecks unsettled objects)
        fake_stack.kubectl("create", "secret", "generic", "no-secret-key", "--from-literal=api-key=engine-key")
    else:
        fake_stack.kubectl("patch", "llm", name, "--type=merge", "-p", json.dumps(fix))
    fake_stack.wait_ready(name, BOUND_S)
    assert fake_stack.condition(name, "Validated")["status"] == "True"
    assert len(fake_stack.pods(name)) == 1
    fake_stack.kubectl("delete", "llm", name, "--wait=false")


def test_deleted_pod_is_recreated(fake_stack: Any) -> None:
    apply(fake_stack, llmservice("drift-delete"))
    fake_stack.wait_ready("drift-delete", BOUND_S)
    (pod,) = fake_stack.pods("drift-delete")
    # --wait=false, then our own bounded wait: `kubectl delete --wait` was seen to hang now and
    # then against the emulated API server when the Pod is replaced within milliseconds.
    fake_stack.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")

    def replaced() -> bool:
        pods = fake_stack.pods("drift-delete")
        return len(pods) == 1 and pods[0]["metadata"]["uid"] != pod["metadata"]["uid"] and \
            pods[0]["metadata"].get("deletionTimestamp") is None and \
            fake_stack.llm("drift-delete")["status"]["phase"] == "Ready"
    fake_stack.wait_for(replaced, BOUND_S, "a new Pod, Ready")


def test_edited_labels_are_restored(fake_stack: Any) -> None:
    apply(fake_stack, llmservice("drift-labels"))
    fake_stack.wait_ready("drift-labels", BOUND_S)
    (pod,) = fake_stack.pods("drift-labels")
    name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
    # One label changed, one removed, and the selector label itself removed.
    fake_stack.kubectl("label", "pod", name, "app.kubernetes.io/component=hacked", "--overwrite")
    fake_stack.kubectl("label", "pod", name, "tidal.dev/replica-index-", "tidal.dev/llmservice-")

    def restored() -> bool:
        now = fake_stack.get("pod", name)["metadata"]["labels"]
        return all(now.get(k) == v for k, v in labels.items())
    fake_stack.wait_for(restored, BOUND_S, "the Pod's labels restored")
    # Restored in place: no replacement Pod.
    assert [p["metadata"]["name"] for p in fake_stack.pods("drift-labels")] == [name]
    # A label someone added by hand is not the operator's: left alone.
    fake_stack.kubectl("label", "pod", name, "team=ml")
    fake_stack.wait_ready("drift-labels", BOUND_S)
    assert fake_stack.get("pod", name)["metadata"]["labels"]["team"] == "ml"


def _operator_pid(stack: Any) -> int:
    return int((stack.state_dir / "pids" / "operator.pid").read_text())


# Enough replicas that the operator's create loop is still running when the first Pod shows
# up in the watch and the operator is killed (3 creates take only a few milliseconds).
REPLICAS = 12


def test_operator_killed_mid_reconcile_creates_no_duplicates(fake_stack: Any) -> None:
    with fake_stack.watch_pods("tidal.dev/llmservice=restart") as watch:
        apply(fake_stack, llmservice("restart", replicas=REPLICAS))
        # Kill the operator right after its first Pod create, before it finishes the plan.
        fake_stack.wait_for(lambda: watch.events, BOUND_S, "the first Pod created", interval_s=0.01)
        os.kill(_operator_pid(fake_stack), signal.SIGKILL)
        created_before_kill = {o["metadata"]["name"] for _, _, o in watch.events}
        print(f"{len(created_before_kill)} of {REPLICAS} Pods seen when the operator was killed")
        fake_stack.tidal("up", "--no-apply", "--no-router")  # restarts only the operator
        fake_stack.wait_ready("restart", BOUND_S)
        pods = fake_stack.pods("restart")
        names = [p["metadata"]["name"] for p in pods]
        assert len(names) == REPLICAS and len(set(names)) == REPLICAS, names
        ever = {o["metadata"]["name"] for _, _, o in watch.events}
        assert ever == set(names), f"a Pod beyond the wanted ones was created: {sorted(ever)}"
        assert created_before_kill <= ever
    assert fake_stack.llm("restart")["status"]["replicasText"] == f"{REPLICAS}/{REPLICAS}"


def test_generated_objects_pass_kubernetes_validate(fake_stack: Any) -> None:
    """Every Pod and Service the operator made in this module, against the official schemas."""
    objs = [o for o in fake_stack.get("pods,services")["items"]
            if o["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "tidal-operator"]
    assert len(objs) >= 4
    fake_stack.validate_generated(objs)


def test_deleting_the_llmservice_removes_pods_and_service(fake_stack: Any) -> None:
    # No finalizer (docs/install.md): deletion never waits for the operator; GC does the rest.
    assert not fake_stack.llm("restart")["metadata"].get("finalizers")
    fake_stack.kubectl("delete", "llm", "restart", "--wait=true", "--timeout=60s")
    fake_stack.wait_for(lambda: not fake_stack.pods("restart"), BOUND_S, "the Pods gone")
    assert "NotFound" in fake_stack.kubectl("get", "service", "restart", check=False)


def owner_uids(obj: dict[str, Any]) -> list[str]:
    return [r["uid"] for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]


def test_the_operator_owns_its_companions_and_refuses_a_users_service(fake_stack: Any) -> None:
    """What a platform team checks with kubectl: the PodDisruptionBudget and the HPA (mode hpa)
    are owned by the LLMService; mode keda without KEDA says so; a user's Service of the same
    name is never touched, and the LLMService reports ServiceConflict."""
    autoscaling = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3, "metric": "requestsWaiting", "target": 2}
    apply(fake_stack, llmservice("scaled-by-hpa", autoscaling=autoscaling))
    fake_stack.wait_ready("scaled-by-hpa", BOUND_S)
    uid = fake_stack.llm("scaled-by-hpa")["metadata"]["uid"]
    pdb = fake_stack.get("pdb", "scaled-by-hpa")
    assert owner_uids(pdb) == [uid] and pdb["spec"]["maxUnavailable"] == 1
    hpa = fake_stack.wait_for(lambda: "NotFound" not in fake_stack.kubectl("get", "hpa", "scaled-by-hpa", check=False)
                              and fake_stack.get("hpa", "scaled-by-hpa"), BOUND_S, "the HPA")
    assert owner_uids(hpa) == [uid] and hpa["spec"]["maxReplicas"] == 3

    fake_stack.kubectl("patch", "llm", "scaled-by-hpa", "--type=merge", "-p",
                       json.dumps({"spec": {"autoscaling": {"mode": "keda"}}}))
    keda = fake_stack.wait_for(lambda: (c := fake_stack.condition("scaled-by-hpa", "ExternalAutoscaler"))
                               .get("reason") == "KEDANotInstalled" and c, BOUND_S, "KEDANotInstalled")
    assert keda["status"] == "False"
    fake_stack.wait_for(lambda: "NotFound" in fake_stack.kubectl("get", "hpa", "scaled-by-hpa", check=False),
                        BOUND_S, "the HPA of the old mode gone")
    fake_stack.kubectl("delete", "llm", "scaled-by-hpa", "--wait=false")

    users = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken", "labels": {"team": "theirs"}},
             "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    apply(fake_stack, users)
    apply(fake_stack, llmservice("taken"))
    degraded = fake_stack.wait_for(lambda: (c := fake_stack.condition("taken", "Degraded")).get("reason")
                                   == "ServiceConflict" and c, BOUND_S, "Degraded=True ServiceConflict")
    assert degraded["status"] == "True"
    assert [e for e in fake_stack.events("taken") if e["type"] == "Warning" and e["reason"] == "ServiceConflict"]
    service = fake_stack.get("service", "taken")
    assert service["spec"]["selector"] == {"app": "theirs"} and [p["port"] for p in service["spec"]["ports"]] == [80]
    assert not owner_uids(service)
    fake_stack.kubectl("delete", "llm", "taken", "--wait=false")


def test_objects_left_by_an_orphaning_delete_are_adopted_when_it_comes_back(fake_stack: Any) -> None:
    """`kubectl delete llm --cascade=orphan` leaves the Pod, Service and PDB without an owner.
    Applied again, the LLMService adopts them (its Pod's name is taken: AlreadyExists, then the
    orphan is read and adopted): the same Pod keeps serving, nothing is recreated, and the
    Service, which carries the operator's labels, is not a ServiceConflict."""
    apply(fake_stack, llmservice("comeback"))
    fake_stack.wait_ready("comeback", BOUND_S)
    (pod,) = fake_stack.pods("comeback")
    fake_stack.kubectl("delete", "llm", "comeback", "--cascade=orphan", "--wait=true")
    left = [fake_stack.get(kind, name) for kind, name in (("pod", pod["metadata"]["name"]),
                                                           ("service", "comeback"), ("pdb", "comeback"))]
    assert [owner_uids(o) for o in left] == [[], [], []]

    apply(fake_stack, llmservice("comeback"))
    llm = fake_stack.wait_ready("comeback", BOUND_S)
    uid = llm["metadata"]["uid"]
    fake_stack.wait_for(lambda: all(owner_uids(fake_stack.get(kind, name)) == [uid] for kind, name in (
        ("pod", pod["metadata"]["name"]), ("service", "comeback"), ("pdb", "comeback"))), BOUND_S, "all three adopted")
    (now,) = fake_stack.pods("comeback")
    assert now["metadata"]["uid"] == pod["metadata"]["uid"]  # the same Pod, not a new one
    assert fake_stack.condition("comeback", "Degraded")["status"] == "False"
    reasons = {e["reason"] for e in fake_stack.events("comeback")}
    assert {"AdoptedPod", "AdoptedService", "AdoptedPodDisruptionBudget"} <= reasons, reasons
    fake_stack.kubectl("delete", "llm", "comeback", "--wait=false")


def test_a_full_pool_rolls_in_place_with_max_surge_zero(fake_stack: Any) -> None:
    """`rollout: {maxSurge: 0, maxUnavailable: 1}`: a spec change replaces the Pods one at a
    time and never runs more Pods than replicas (no room for a surge Pod on a full GPU pool)."""
    apply(fake_stack, llmservice("full-pool", replicas=2, rollout={"maxSurge": 0, "maxUnavailable": 1}))
    fake_stack.wait_ready("full-pool", BOUND_S)
    old = {p["metadata"]["name"] for p in fake_stack.pods("full-pool")}
    with fake_stack.watch_pods("tidal.dev/llmservice=full-pool") as watch:
        fake_stack.kubectl("patch", "llm", "full-pool", "--type=merge", "-p",
                           json.dumps({"spec": {"model": {"maxModelLen": 256}}}))
        fake_stack.wait_for(lambda: (pods := fake_stack.pods("full-pool")) and len(pods) == 2
                            and not old & {p["metadata"]["name"] for p in pods}, BOUND_S, "both Pods replaced")
        fake_stack.wait_ready("full-pool", BOUND_S)
    live: set[str] = set()
    most = 0
    for _, kind, obj in watch.events:
        name = obj["metadata"]["name"]
        if kind == "DELETED" or obj["metadata"].get("deletionTimestamp"):
            live.discard(name)
        else:
            live.add(name)
        most = max(most, len(live))
    assert most == 2, [(k, o["metadata"]["name"]) for _, k, o in watch.events]
    for pod in fake_stack.pods("full-pool"):  # evictable by the cluster autoscaler, and no API token
        assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
        assert pod["spec"]["automountServiceAccountToken"] is False
    fake_stack.kubectl("delete", "llm", "full-pool", "--wait=false")


def test_kubectl_scale_changes_the_replicas(fake_stack: Any) -> None:
    apply(fake_stack, llmservice("scaled"))
    fake_stack.wait_for(lambda: len(fake_stack.pods("scaled")) == 1, BOUND_S, "1 Pod")
    assert "scaled" in fake_stack.kubectl("scale", "llm/scaled", "--replicas=2")
    fake_stack.wait_for(lambda: len(fake_stack.pods("scaled")) == 2, BOUND_S, "2 Pods after kubectl scale")
    assert fake_stack.llm("scaled")["spec"]["replicas"] == 2


def test_kubectl_get_prints_the_printer_columns(fake_stack: Any) -> None:
    """The emulated API server answers kubectl's Table requests (additionalPrinterColumns)."""
    apply(fake_stack, llmservice("tables", replicas=2))
    fake_stack.wait_ready("tables", BOUND_S)
    header, *rows = fake_stack.kubectl("get", "llm", "tables").splitlines()
    assert header.split() == ["NAME", "MODEL", "READY", "PHASE", "ENDPOINT", "AGE"]
    assert rows[0].split()[:4] == ["tables", "bundled://smollm2-135m", "2/2", "Ready"]
    wide = fake_stack.kubectl("get", "llm", "tables", "-o", "wide").splitlines()[0].split()
    assert wide[-5:] == ["SERVED", "PARALLELISM", "SLEEPING", "TASK", "REASON"]
    header, *rows = fake_stack.kubectl("get", "pods", "-l", "tidal.dev/llmservice=tables").splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert len(rows) == 2 and all(r.split()[1:3] == ["1/1", "Running"] for r in rows)
    fake_stack.kubectl("delete", "llm", "tables", "--wait=false")


def test_dev_up_applies_waits_and_prints_how_to_reach_it(tmp_path: Path) -> None:
    """`tidal dev up -f FILE` on a stack of its own: apply, wait for Ready, print a curl."""
    import subprocess
    import sys

    def tidal(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "tidal_operator.cli", "dev", "--state-dir", str(tmp_path),
                                 *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    try:
        out = tidal("up", "-f", str(ROOT / "examples" / "quickstart.yaml"), "--fake-engines", "--no-router",
                    "--timeout", "60")
        assert "applied LLMService default/smollm2" in out and "smollm2 is Ready" in out
        assert "curl -s http://127.0.0.2:8000/v1/chat/completions" in out
        assert f"export KUBECONFIG={tmp_path.resolve()}/kubeconfig" in out
        status = tidal("status")
        assert "default/smollm2: Ready 1/1" in status and "operator      running" in status
    finally:
        assert "controlplane" in tidal("down")
    assert "nothing was running" in tidal("down")
