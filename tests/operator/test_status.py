"""reconcile/status.py: phases, counts, endpoint, conditions with reasons read from Pod
status, and lastTransitionTime kept while a condition's status holds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tidal_operator.api import LLMServiceSpec, OperatorConfig, validate_spec
from tidal_operator.reconcile.manifests import pod_manifest, spec_hash
from tidal_operator.reconcile.status import compute_status, desired_replicas

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
CONFIG = OperatorConfig()
SPEC = {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 2048}, "replicas": 2}


def llm(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "smollm2", "namespace": "team-a", "uid": "u1", "generation": 3},
                            "spec": spec or SPEC}
    if status is not None:
        body["status"] = status
    return body


def pod(index: int, *, ready: bool = True, hash_: str | None = None, phase: str = "Running",
        ip: str | None = None, **status: Any) -> dict[str, Any]:
    body = llm()
    manifest = pod_manifest(body, index, CONFIG)
    if hash_ is not None:
        manifest["metadata"]["annotations"]["tidal.dev/spec-hash"] = hash_
    manifest["status"] = {"phase": phase, "podIP": ip or f"10.0.0.{index + 1}",
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **status}
    return manifest


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def compute(pods: list[dict[str, Any]], body: dict[str, Any] | None = None, problems: Any = (),
            now: datetime = NOW, **kw: Any) -> dict[str, Any]:
    return compute_status(body or llm(), pods, list(problems), 3, now, config=CONFIG, **kw)


def test_ready() -> None:
    s = compute([pod(0), pod(1)])
    assert s["phase"] == "Ready" and s["replicasText"] == "2/2"
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"], s["desiredReplicas"]) == (2, 2, 2, 2)
    assert s["endpoint"] == "http://smollm2.team-a.svc.cluster.local:8000/v1"
    assert s["podEndpoints"][0]["url"] == "http://10.0.0.1:8000/v1"
    assert s["observedGeneration"] == 3 and s["specHash"] == spec_hash(SPEC, CONFIG)
    assert s["servedModelName"] == "smollm2"
    assert s["selector"] == "app.kubernetes.io/name=tidal-engine,tidal.dev/llmservice=smollm2"
    assert cond(s, "Validated")["status"] == "True" and cond(s, "Ready")["status"] == "True"
    assert cond(s, "Progressing")["status"] == "False" and cond(s, "Degraded")["status"] == "False"
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == "2026-03-01T12:00:00Z"
               for c in s["conditions"])


def test_pending_then_progressing_then_ready() -> None:
    assert compute([])["phase"] == "Pending"
    assert cond(compute([]), "Progressing")["reason"] == "ScalingUp"
    assert compute([pod(0, ready=False), pod(1, ready=False)])["phase"] == "Pending"
    s = compute([pod(0), pod(1, ready=False)])
    assert s["phase"] == "Progressing" and cond(s, "Ready")["reason"] == "WaitingForReplicas"
    assert cond(s, "Progressing")["reason"] == "PodsStarting"
    assert compute([pod(0), pod(1)])["phase"] == "Ready"


def test_rolling_update_is_progressing_and_still_ready() -> None:
    s = compute([pod(0, hash_="oldoldold0"), pod(1, hash_="oldoldold0"), pod(2, ready=False)])
    assert s["phase"] == "Progressing" and s["updatedReplicas"] == 1 and s["readyReplicas"] == 2
    assert cond(s, "Progressing")["reason"] == "RollingUpdate"
    assert cond(s, "Ready")["status"] == "True"


def test_invalid_spec() -> None:
    bad = {"model": {"uri": "s3://x"}}
    problems = validate_spec(bad, name="smollm2", namespace="team-a")
    s = compute([], body=llm(bad), problems=problems)
    assert s["phase"] == "Failed"
    v = cond(s, "Validated")
    assert v["status"] == "False" and v["reason"] == "UnsupportedURIScheme" and "s3://" in v["message"]
    assert cond(s, "Ready")["status"] == "False"


def test_only_its_own_conditions_are_computed() -> None:
    # AdaptersReady is the adapter sync's: server-side apply keeps it; it is never written here.
    adapters = {"type": "AdaptersReady", "status": "True", "reason": "AllLoaded", "message": "",
                "lastTransitionTime": "2026-03-01T11:00:00Z"}
    bad = {"model": {"uri": "s3://x"}}
    problems = validate_spec(bad, name="smollm2", namespace="team-a")
    for body in (llm(bad, status={"conditions": [adapters]}), llm(status={"conditions": [adapters]})):
        s = compute([], body=body, problems=problems if body["spec"] is bad else ())
        assert [c["type"] for c in s["conditions"]] == ["Validated", "Ready", "Progressing", "Degraded"]


def test_unparseable_spec_without_given_problems_still_fails() -> None:
    s = compute([], body=llm({"model": {"uri": "bundled://smollm2-135m"}, "replicas": -1}))
    assert s["phase"] == "Failed" and "spec.replicas" in cond(s, "Validated")["message"]


def waiting(reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "engine", "ready": False, "restartCount": 3, "started": False,
                                   "state": {"waiting": {"reason": reason, "message": message}}, **extra}]}


@pytest.mark.parametrize("status,reason", [
    (waiting("ImagePullBackOff", "Back-off pulling image"), "ImagePullBackOff"),
    (waiting("ErrImagePull", "not found"), "ErrImagePull"),
    (waiting("CrashLoopBackOff", "back-off 5m0s restarting"), "CrashLoopBackOff"),
    (waiting("CreateContainerConfigError", 'secret "api" not found'), "CreateContainerConfigError"),
    (waiting("CrashLoopBackOff", "", lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}), "OOMKilled"),
    ({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": "0/3 nodes: insufficient nvidia.com/gpu"}]}, "Unschedulable"),
    ({"containerStatuses": [{"name": "engine", "ready": False, "started": False, "restartCount": 0,
                             "state": {"running": {"startedAt": "2026-03-01T11:40:00Z"}}}]}, "StartupProbeFailing"),
    ({"containerStatuses": [{"name": "engine", "ready": False, "started": False, "restartCount": 1,
                             "state": {"running": {"startedAt": "2026-03-01T11:59:00Z"}},
                             "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}}}]}, "StartupProbeFailing"),
])
def test_stuck_pods_are_degraded_with_the_reason(status: dict[str, Any], reason: str) -> None:
    stuck = pod(1, ready=False)
    stuck["status"].update(status)
    s = compute([pod(0), stuck])
    assert s["phase"] == "Degraded"
    d = cond(s, "Degraded")
    assert d["status"] == "True" and d["reason"] == reason and stuck["metadata"]["name"] in d["message"]
    assert cond(s, "Ready")["reason"] == reason


def test_slow_start_within_timeout_is_not_stuck() -> None:
    starting = pod(1, ready=False)
    starting["status"]["containerStatuses"] = [{"name": "engine", "ready": False, "started": False, "restartCount": 0,
                                                "state": {"running": {"startedAt": "2026-03-01T11:59:00Z"}}}]
    s = compute([pod(0), starting])
    assert s["phase"] == "Progressing" and cond(s, "Degraded")["status"] == "False"


def test_a_stuck_new_pod_stalls_the_rollout_while_old_pods_serve() -> None:
    # quantization.weights: fp8 on an engine without it: the new Pod crash-loops, the old
    # ones serve. Ready stays True, but the rollout is visibly stuck and the Pod's reason shown.
    surge = pod(2, ready=False)
    surge["status"].update(waiting("CrashLoopBackOff", "back-off 40s restarting failed container"))
    s = compute([pod(0, hash_="oldoldold0"), pod(1, hash_="oldoldold0"), surge])
    name = surge["metadata"]["name"]
    assert s["phase"] == "Degraded" and cond(s, "Ready")["status"] == "True"
    p, d = cond(s, "Progressing"), cond(s, "Degraded")
    assert (p["status"], p["reason"]) == ("False", "RolloutStuck") and name in p["message"]
    assert "2 Ready Pod(s) keep serving" in p["message"]
    assert (d["status"], d["reason"]) == ("True", "CrashLoopBackOff") and "back-off 40s" in d["message"]


# What the engine logs when quantization.weights names a format its checkpoint does not have;
# FallbackToLogsOnError makes the log's tail the container's termination message.
ENGINE_EXIT_LOG = ("2026-12-01 05:19:25,589 INFO __main__: loading smollm2-135m\n"
                   "2026-12-01 05:20:02,480 ERROR __main__: the engine could not start: ValueError: --quantization "
                   "awq needs a awq checkpoint, but the model's config.json has no quantization_config\n")


def test_an_engine_that_cannot_run_the_spec_is_degraded_with_the_engines_reason() -> None:
    spec = {**SPEC, "replicas": 1, "quantization": {"weights": "awq"}}
    body = llm(spec)
    crashing = pod_manifest(body, 0, CONFIG)
    crashing["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}], **waiting(
        "CrashLoopBackOff", "back-off 20s restarting failed container=engine",
        lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": ENGINE_EXIT_LOG}})}
    s = compute([crashing], body=body)
    d, r = cond(s, "Degraded"), cond(s, "Ready")
    assert s["phase"] == "Degraded" and (d["status"], d["reason"]) == ("True", "CrashLoopBackOff")
    assert "the engine exited with code 1: " in d["message"] and "--quantization awq needs a awq checkpoint" in d["message"]
    assert "loading smollm2-135m" not in d["message"] and "back-off 20s" in d["message"]
    assert (r["status"], r["reason"]) == ("False", "CrashLoopBackOff") and "needs a awq checkpoint" in r["message"]
    # A clean exit (or no message) adds nothing: the kubelet's own message stays.
    crashing["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = 0
    assert cond(compute([crashing], body=body), "Degraded")["message"].endswith(
        "back-off 20s restarting failed container=engine")


def test_progress_deadline_marks_a_new_pod_that_never_gets_ready() -> None:
    spec = {**SPEC, "rollout": {"progressDeadlineSeconds": 120}}
    slow = pod(2, ready=False)
    slow["metadata"]["creationTimestamp"] = "2026-03-01T11:57:00Z"  # 180 s before NOW
    old = [pod(0, hash_="oldoldold0"), pod(1, hash_="oldoldold0")]
    s = compute([*old, slow], body=llm(spec))
    assert cond(s, "Progressing")["reason"] == "RolloutStuck"
    assert cond(s, "Degraded")["reason"] == "ProgressDeadlineExceeded"
    within = compute([*old, slow], body=llm({**SPEC, "rollout": {"progressDeadlineSeconds": 600}}))
    assert cond(within, "Progressing")["reason"] == "RollingUpdate" and cond(within, "Degraded")["status"] == "False"


def test_failed_and_terminating_pods_are_not_counted() -> None:
    gone = pod(2)
    gone["metadata"]["deletionTimestamp"] = "2026-03-01T11:59:59Z"
    dead = pod(3, ready=False, phase="Failed")
    s = compute([pod(0), pod(1), gone, dead])
    assert (s["replicas"], s["readyReplicas"], s["phase"]) == (2, 2, "Ready")


def test_sleeping() -> None:
    spec = {"model": {"uri": "bundled://smollm2-135m"}, "autoscaling": {"maxReplicas": 2, "target": 4},
            "sleep": {"afterIdleSeconds": 60}}
    body = llm(spec, status={"desiredReplicas": 1})
    asleep = pod_manifest(body, 0, CONFIG)
    asleep["metadata"]["labels"]["tidal.dev/sleep-state"] = "asleep-1"
    asleep["status"] = {"phase": "Running", "podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}
    s = compute([asleep], body=body)
    assert s["phase"] == "Sleeping" and s["sleepingReplicas"] == 1 and s["desiredReplicas"] == 1
    assert s["podEndpoints"] == [{"name": asleep["metadata"]["name"], "url": "http://10.0.0.9:8000/v1",
                                  "ready": True, "sleepState": "asleep-1"}]
    zero = compute([], body=llm(spec, status={"desiredReplicas": 0}))
    assert zero["phase"] == "Sleeping" and cond(zero, "Ready")["reason"] == "ScaledToZero"


def test_last_transition_time_preserved_while_status_holds() -> None:
    first = compute([pod(0), pod(1)])
    later = NOW + timedelta(minutes=5)
    second = compute([pod(0), pod(1)], body=llm(status=first), now=later)
    assert cond(second, "Ready")["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    # A change of status moves it; a change of reason alone doesn't.
    third = compute([pod(0), pod(1, ready=False)], body=llm(status=second), now=later)
    assert cond(third, "Ready")["lastTransitionTime"] == "2026-03-01T12:05:00Z"
    assert cond(third, "Validated")["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    assert cond(third, "Progressing")["lastTransitionTime"] == "2026-03-01T12:05:00Z"


def test_only_owned_fields_are_returned() -> None:
    s = compute([pod(0), pod(1)], body=llm(status={"scalingHistory": [{"time": "x", "from": 1, "to": 2}]}))
    assert "scalingHistory" not in s and "lastScaleTime" not in s and "adapters" not in s


@pytest.mark.parametrize("spec,previous,expected", [
    ({"replicas": 3}, None, 3),
    ({}, None, 1),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 4, "target": 1}}, None, 1),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 4, "target": 1}}, None, 2),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 4, "target": 1}}, {"desiredReplicas": 0}, 0),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 4, "target": 1}}, {"desiredReplicas": 9}, 4),
    ({"replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "target": 1, "mode": "hpa"}}, None, 3),
])
def test_desired_replicas(spec: dict[str, Any], previous: dict[str, Any] | None, expected: int) -> None:
    parsed = LLMServiceSpec.from_body({"model": {"uri": "bundled://smollm2-135m"}, **spec})
    assert desired_replicas(parsed, previous) == expected


def test_status_shows_the_parallelism() -> None:
    body = llm({"model": {"uri": "bundled://smollm2-135m"}, "parallelism": {"tensor": 2}})
    assert compute([pod(0)], body)["parallelism"] == "tp=2 pp=1"  # kubectl get llm -o wide shows it
