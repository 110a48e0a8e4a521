"""The quickstart on `tidal dev` with real engines (SmolLM2-135M on CPU) and the real kubectl:
apply → a running engine → Ready 1/1 → "Paris" (direct and through the router) → the same
model at tensor: 2 (two gloo ranks) answers the same → a rolling
update with surge while requests keep succeeding → schemas → delete, processes gone.

The tests share one stack and run in file order (each builds on the previous state).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENGINE_READY_BOUND_S = 120  # apply → Ready with a real engine, on 2 shared CPU cores
NAME = "smollm2"


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def test_apply_quickstart_runs_a_real_engine(real_stack: Any) -> None:
    started = time.monotonic()
    real_stack.kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))
    llm = real_stack.wait_ready(NAME, ENGINE_READY_BOUND_S)
    took = time.monotonic() - started
    print(f"quickstart Ready in {took:.1f}s")

    pods = real_stack.pods(NAME)
    assert len(pods) == 1 and _ready(pods[0])
    container = pods[0]["spec"]["containers"][0]
    # Every address in the Pod (port-forward, meshes); the local kubelet binds its loopback address.
    assert container["command"] == ["tidal-engine", "serve"] and "0.0.0.0" in container["args"]
    # The kubelet runs it as a real local process.
    pids = real_stack.engine_pids()
    assert any(pods[0]["metadata"]["name"] in key for key in pids), pids

    table = real_stack.kubectl("get", "llm")
    header, row = table.splitlines()[:2]
    assert header.split()[:6] == ["NAME", "MODEL", "READY", "PHASE", "ENDPOINT", "AGE"]
    assert row.split()[:5] == [NAME, "bundled://smollm2-135m", "1/1", "Ready",
                               "http://smollm2.default.svc.cluster.local:8000/v1"]
    assert llm["status"]["endpoint"] == "http://smollm2.default.svc.cluster.local:8000/v1"

    pod_ip = pods[0]["status"]["podIP"]
    assert "Paris" in real_stack.chat(f"http://{pod_ip}:8000", NAME)
    assert "Paris" in real_stack.chat(real_stack.router_url, NAME, real_stack.api_key)


def test_tensor_parallel_2_on_cpu_answers_like_tensor_1(real_stack: Any) -> None:
    # Two gloo ranks in one Pod: the status and `kubectl get llm -o wide` show the parallelism,
    # and the greedy answer through the router is the quickstart's (tensor: 1) answer.
    name = "smollm2-tp2"
    body = {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
            "spec": {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512},
                     "engine": {"resources": {"cpu": "2", "memory": "2Gi"}, "kvCacheMemory": "64Mi",
                                "startupTimeoutSeconds": 300},
                     "parallelism": {"tensor": 2}, "replicas": 1}}
    real_stack.kubectl("apply", "-f", "-", input=json.dumps(body))
    try:
        llm = real_stack.wait_ready(name, 2 * ENGINE_READY_BOUND_S)
        assert llm["status"]["parallelism"] == "tp=2 pp=1"
        header, row = real_stack.kubectl("get", "llm", name, "-o", "wide").splitlines()[:2]
        assert row.split()[header.split().index("PARALLELISM")] == "tp=2"
        (pod,) = real_stack.pods(name)
        assert "--tensor-parallel-size" in pod["spec"]["containers"][0]["args"]
        expected = real_stack.chat(real_stack.router_url, NAME, real_stack.api_key)
        assert real_stack.chat(real_stack.router_url, name, real_stack.api_key) == expected
    finally:
        real_stack.kubectl("delete", "llm", name, "--wait=true", timeout=120)


def test_spec_change_rolls_with_surge_and_requests_keep_succeeding(real_stack: Any) -> None:
    (old,) = real_stack.pods(NAME)
    old_name = old["metadata"]["name"]
    results: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        # Sequential requests through the router for the whole rollout.
        while not stop.is_set():
            try:
                results.append(real_stack.chat(real_stack.router_url, NAME, real_stack.api_key, timeout=60))
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                failures.append(repr(exc))

    with real_stack.watch_pods(f"tidal.dev/llmservice={NAME}") as watch:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        real_stack.wait_for(lambda: results, 60, "a first request through the router")
        real_stack.kubectl("patch", "llm", NAME, "--type=merge", "-p",
                           json.dumps({"spec": {"model": {"maxModelLen": 1536}}}))
        llm = real_stack.wait_ready(NAME, ENGINE_READY_BOUND_S + 60)
        real_stack.wait_for(lambda: [p["metadata"]["name"] for p in real_stack.pods(NAME)] != [old_name]
                 and len(real_stack.pods(NAME)) == 1, 90, "the old Pod gone")
        served_after = len(results)
        real_stack.wait_for(lambda: len(results) > served_after, 60, "a request served by the new Pod")
        stop.set()
        thread.join(90)

    (new,) = real_stack.pods(NAME)
    new_name = new["metadata"]["name"]
    assert new_name != old_name and new["metadata"]["annotations"]["tidal.dev/spec-hash"] == llm["status"]["specHash"]
    assert "--max-model-len" in new["spec"]["containers"][0]["args"]
    assert new["spec"]["containers"][0]["args"][new["spec"]["containers"][0]["args"].index("--max-model-len") + 1] == "1536"

    # Ordering, from the watch: the new Pod was Ready before the old one began terminating.
    events = watch.events
    new_ready_at = next(i for i, (_, _, obj) in enumerate(events)
                        if obj["metadata"]["name"] == new_name and _ready(obj))
    old_terminating_at = next(i for i, (_, kind, obj) in enumerate(events) if obj["metadata"]["name"] == old_name
                              and (kind == "DELETED" or obj["metadata"].get("deletionTimestamp")))
    assert new_ready_at < old_terminating_at, [(k, o["metadata"]["name"]) for _, k, o in events]
    # Surge 1: never more than two live Pods at once.
    live: set[str] = set()
    most = 0
    for _, kind, obj in events:
        name = obj["metadata"]["name"]
        if kind == "DELETED" or obj["metadata"].get("deletionTimestamp"):
            live.discard(name)
        else:
            live.add(name)
        most = max(most, len(live))
    assert most <= 2

    assert not failures, failures
    assert len(results) >= 3 and all("Paris" in r for r in results), results


def test_a_crash_looping_new_pod_is_a_visible_stuck_rollout_while_the_old_one_serves(real_stack: Any) -> None:
    """An edit the engine can't start with: the new Pod crash-loops, the old one keeps serving,
    and the LLMService says so (Progressing=False RolloutStuck, Degraded with the Pod's reason,
    a Warning Event). Undoing the edit ends it without touching the old Pod."""
    (old,) = real_stack.pods(NAME)
    real_stack.kubectl("patch", "llm", NAME, "--type=merge", "-p",
                       json.dumps({"spec": {"engine": {"args": ["--no-such-flag"]}}}))
    progressing = real_stack.wait_for(
        lambda: (c := real_stack.condition(NAME, "Progressing")).get("reason") == "RolloutStuck" and c,
        120, "Progressing=False RolloutStuck")
    assert progressing["status"] == "False"
    degraded = real_stack.condition(NAME, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoopBackOff"), degraded
    assert real_stack.condition(NAME, "Ready")["status"] == "True"
    assert [e for e in real_stack.events(NAME) if e["type"] == "Warning" and e["reason"] == degraded["reason"]]
    assert "Paris" in real_stack.chat(real_stack.router_url, NAME, real_stack.api_key, timeout=60)

    real_stack.kubectl("patch", "llm", NAME, "--type=merge", "-p", json.dumps({"spec": {"engine": {"args": []}}}))
    real_stack.wait_for(lambda: [p["metadata"]["name"] for p in real_stack.pods(NAME)] == [old["metadata"]["name"]]
                        and real_stack.condition(NAME, "Progressing").get("reason") == "Complete", 90,
                        "the stuck Pod gone, the old one kept")
    assert real_stack.condition(NAME, "Degraded")["status"] == "False"


def test_generated_objects_pass_kubernetes_validate(real_stack: Any) -> None:
    objs = real_stack.pods(NAME) + [real_stack.get("service", NAME)]
    assert len(objs) == 2
    real_stack.validate_generated(objs)


def test_delete_removes_pods_service_and_processes(real_stack: Any) -> None:
    pids = real_stack.engine_pids()
    assert pids
    real_stack.kubectl("delete", "llm", NAME, "--wait=true", "--timeout=120s")
    real_stack.wait_for(lambda: not real_stack.pods(NAME), 120, "the engine Pods gone")
    real_stack.wait_for(lambda: "NotFound" in real_stack.kubectl("get", "service", NAME, check=False), 30, "the Service gone")

    groups = set(pids.values())  # each engine Pod runs in its own session: API server, engine core, workers

    def processes_ended() -> bool:
        alive = []
        for pid in pids.values():
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return not alive and not live_processes_in_groups(groups)
    real_stack.wait_for(processes_ended, 90, f"engine processes {sorted(pids.values())} and their children ended")


def live_processes_in_groups(groups: set[int]) -> list[int]:
    """Non-zombie processes whose process group is one of ``groups`` (an orphaned engine core
    or worker would keep its Pod's group)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            found.append(int(entry.name))
    return found


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])
