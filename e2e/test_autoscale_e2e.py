"""Autoscaling and the idle policy end to end on `tidal dev`: real engines (SmolLM2-135M on
CPU), the real kubectl, the operator and the router as `tidal dev up` starts them.

One LLMService with builtin autoscaling on requestsInFlight (target 1 per replica, 0 to 3
replicas) and short windows, walked through its whole life:

1. a burst of two concurrent clients scales it 1 → 2, the reason in status.scalingHistory;
2. the operator is killed (SIGKILL) and restarted: it keeps the count and the history, and
   does not scale down before it has observed a whole scaleDownDelaySeconds window itself,
   though the load is gone and the last scale is long past;
3. idle → the replica sleeps (the engine says so, and status shows Sleeping);
4. a request through the router wakes that same replica and gets the same greedy answer;
5. longer idle → 0 Pods;
6. a request at zero through a second router replica (its demand reaches the operator only
   through its own Lease) is held, a Pod is created, and the request is answered;
7. across all of it, no request failed or was lost (the client's ledger and the router's
   own counters agree).

The tests share one stack and run in file order (each builds on the state the previous one
left). Every wait is on something observable (status, Pods, the engines' and the router's
reports, watch events), with a deadline; there are no fixed sleeps. Each step's wall time is
printed (pytest -s).
"""

from __future__ import annotations

import base64
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import pytest
import yaml

import autoscale_support as sup

NAME = "tide"
ENGINE_KEY = "e2e-autoscale-engine-key"
PORT = 8000
INTERVAL_S = 1  # TIDAL_AUTOSCALE_INTERVAL_SECONDS: one scrape + decision per second
SLEEP_AFTER_S = 3  # spec.sleep.afterIdleSeconds
SCALE_DOWN_DELAY_S = 7  # spec.autoscaling.scaleDownDelaySeconds
# spec.sleep.removeAfterSeconds. It must outlast the restart step (the new operator's first
# idle tick, then SCALE_DOWN_DELAY_S of its readings) plus the sleep and wake checks, or the
# last replica would be removed before the test wakes it.
REMOVE_AFTER_S = 18
MAX_REPLICAS = 3  # room above 2, so a spurious scale-up could happen and be seen
BURST_WORKERS = 2  # requests in flight during the burst: needs exactly 2 replicas at target 1
BURST_MAX_TOKENS = 24  # with ignore_eos: each burst request stays in flight across a scrape
READY_BOUND_S = 180  # apply → Ready with a real engine on 2 shared CPU cores

MANIFEST = yaml.safe_dump_all([
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{NAME}-engine-key"},
     "data": {"api-key": base64.b64encode(ENGINE_KEY.encode()).decode()}},
    {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": NAME},
     "spec": {
         "model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512},
         "engine": {"port": PORT, "resources": {"cpu": "1", "memory": "2Gi"}, "kvCacheMemory": "64Mi",
                    "startupTimeoutSeconds": 300},
         "auth": {"apiKeySecretRef": {"name": f"{NAME}-engine-key"}},
         "autoscaling": {"minReplicas": 0, "maxReplicas": MAX_REPLICAS, "metric": "requestsInFlight", "target": 1,
                         "scaleUpStabilizationSeconds": 0, "scaleDownDelaySeconds": SCALE_DOWN_DELAY_S},
         "sleep": {"afterIdleSeconds": SLEEP_AFTER_S, "level": 1, "removeAfterSeconds": REMOVE_AFTER_S},
     }},
])


@pytest.fixture(scope="module", autouse=True)
def short_controller_interval() -> Iterator[None]:
    """Set before the stack starts (autouse fixtures come first): `tidal dev up` passes its
    environment to the operator, which reads it through scaling_config_from_env."""
    name = "TIDAL_AUTOSCALE_INTERVAL_SECONDS"
    old = os.environ.get(name)
    os.environ[name] = str(INTERVAL_S)
    yield
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@dataclass
class Scenario:
    stack: Any
    llm_watch: sup.Watch
    pod_watch: sup.Watch
    ledger: sup.Ledger = field(default_factory=sup.Ledger)
    reference: str = ""  # the greedy answer before anything slept
    burst: sup.Burst | None = None
    sleeper: str = ""  # the Pod that slept and was woken
    woken_at: float = 0.0
    engine_pids: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    second_router_answers: int = 0  # requests answered by the second router replica (step 6)

    def llm(self) -> dict[str, Any]:
        return self.stack.llm(NAME)

    def llm_where(self, check: Any) -> dict[str, Any] | None:
        obj = self.llm()
        return obj if check(obj) else None

    def status(self) -> dict[str, Any]:
        return sup.status_of(self.llm())

    def live_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.stack.pods(NAME) if not p["metadata"].get("deletionTimestamp")]

    def ask(self, what: str, router_url: str | None = None) -> sup.Answer:
        return sup.ask(router_url or self.stack.router_url, self.stack.api_key, NAME, self.ledger, what)

    def demand(self, router_url: str | None = None) -> dict[str, Any]:
        return sup.router_demand(router_url or self.stack.router_url, self.stack.api_key, NAME)

    def step(self, what: str, since: float) -> None:
        print(f"{what}: {time.monotonic() - since:.1f}s (scenario at {time.monotonic() - self.started:.1f}s)")


@pytest.fixture(scope="module")
def scenario(real_stack: Any) -> Iterator[Scenario]:
    llm_watch = sup.Watch(real_stack.env, "llmservices")
    pod_watch = sup.Watch(real_stack.env, "pods", "-l", f"tidal.dev/llmservice={NAME}")
    s = Scenario(real_stack, llm_watch, pod_watch)
    try:
        yield s
    finally:
        if s.burst is not None and s.burst.running:
            s.burst.stop()
        llm_watch.stop()
        pod_watch.stop()


def _history_pairs(llm: dict[str, Any]) -> list[tuple[int, int]]:
    return [(e["from"], e["to"]) for e in sup.history(llm)]


# --- 1. burst: 1 → 2 ---------------------------------------------------------------------------

def test_burst_of_concurrent_requests_scales_one_to_two(scenario: Scenario) -> None:
    st = scenario.stack
    began = time.monotonic()
    st.kubectl("apply", "-f", "-", input=MANIFEST)
    st.wait_ready(NAME, READY_BOUND_S)
    scenario.step("apply → Ready 1/1", began)
    (first,) = scenario.live_pods()
    assert scenario.status()["desiredReplicas"] == 1 and not sup.history(scenario.llm())

    reference = scenario.ask("reference")
    assert reference.ok and "Paris" in reference.text, reference
    scenario.reference = reference.text

    began = time.monotonic()
    scenario.burst = sup.Burst(st.router_url, st.api_key, NAME, scenario.ledger, workers=BURST_WORKERS,
                               max_tokens=BURST_MAX_TOKENS)
    llm = st.wait_for(lambda: scenario.llm_where(lambda o: sup.status_of(o).get("desiredReplicas") != 1),
                      60, "the burst to change desiredReplicas")
    scenario.step("burst → desiredReplicas 2", began)
    status = sup.status_of(llm)
    assert status["desiredReplicas"] == 2, status
    (entry,) = sup.history(llm)
    assert (entry["from"], entry["to"]) == (1, 2), entry
    # decide.py's words: the metric, its total over the replicas, the target, the result (and
    # the requests the router held, had the replica fallen asleep before the burst came).
    assert re.fullmatch(r"requestsInFlight 2 for target 1 per replica( \(\d held by the router\))?: "
                        r"2 replica\(s\)", entry["reason"]), entry
    assert status["lastScaleTime"] == entry["time"]
    scaled_up = [e for e in st.events(NAME) if e.get("reason") == "ScaledUp"]
    assert [e["message"] for e in scaled_up] == [f"1 -> 2: {entry['reason']}"]

    # The planner acts on the decision: a second Pod, which starts loading.
    def two_pods() -> list[dict[str, Any]] | None:
        pods = scenario.live_pods()
        return pods if len(pods) == 2 else None
    pods = st.wait_for(two_pods, 30, "a second Pod")
    assert first["metadata"]["name"] in {p["metadata"]["name"] for p in pods}
    # For the next step: the operator has seen the first replica busy (no idle-since mark
    # left on it; the second one is not Ready, so it has none either).
    st.wait_for(lambda: all(sup.IDLE_SINCE not in (p["metadata"].get("annotations") or {})
                            for p in scenario.live_pods()), 30, "the first replica seen busy")
    llm = scenario.llm()
    assert sup.status_of(llm)["desiredReplicas"] == 2 and sup.history(llm) == [entry]
    assert scenario.burst.running and not scenario.ledger.failed()


# --- 2. a restarted operator keeps the count and the history -----------------------------------

def test_restarted_operator_keeps_count_and_history(scenario: Scenario) -> None:
    """The operator is SIGKILLed right after its scale-up, while the burst still runs; the
    burst then ends and the second replica finishes loading with no operator at all. When a
    new operator starts, everything that would let a memoryless one scale down at once is
    true: the load is 0, and lastScaleTime is more than scaleDownDelaySeconds ago. The new
    operator must read the count and the history back from status, and wait until it has
    observed a full scaleDownDelaySeconds window of its own readings.

    Synchronisation, on the new operator's own writes: its first tick marks both Pods
    idle (the `tidal.dev/idle-since` annotation, written with milliseconds), afterIdleSeconds
    later it puts them to sleep (their sleep-state label, and sleepingReplicas in status), and
    only scaleDownDelaySeconds after its first reading does it scale down. The LLMService
    watch holds every version of status from the restart until that scale-down:
    desiredReplicas was 2 and scalingHistory unchanged in each one, over more than
    SCALE_DOWN_DELAY_S / INTERVAL_S controller ticks.
    """
    st = scenario.stack
    assert scenario.burst is not None
    before = scenario.llm()
    assert sup.status_of(before)["desiredReplicas"] == 2
    kept = sup.history(before)

    old_pid = sup.kill_operator(st.state_dir)
    scenario.burst.stop()  # returns when every burst request has been answered
    burst = scenario.burst.answers
    assert burst and all(a.ok and "Paris" in a.text for a in burst), [a for a in burst if not a.ok][:3]

    # The second replica comes up without an operator (the kubelet's probes); a memoryless
    # operator would now be free to scale down at once.
    began = time.monotonic()
    st.wait_for(lambda: len(p := scenario.live_pods()) == 2 and all(map(sup.pod_ready, p)),
                READY_BOUND_S, "the second replica Ready")
    scenario.step("kill → 2/2 Ready", began)
    scaled_up_at = sup.parse_time(kept[-1]["time"])
    st.wait_for(lambda: time.time() > scaled_up_at + SCALE_DOWN_DELAY_S + 1, SCALE_DOWN_DELAY_S + 5,
                "scaleDownDelaySeconds since the scale-up")
    assert sup.status_of(scenario.llm())["desiredReplicas"] == 2
    assert sup.history(scenario.llm()) == kept  # nobody wrote status meanwhile

    began = time.monotonic()
    restarted_at = time.time()
    st.tidal("up", "--no-apply", "--router-port", str(st.router_port))
    new_pid = sup.operator_pid(st.state_dir)
    assert new_pid is not None and new_pid != old_pid

    changed = st.wait_for(lambda: scenario.llm_where(lambda o: sup.history(o) != kept),
                          SCALE_DOWN_DELAY_S + 120, "the restarted operator's first scaling decision")
    scenario.step("restart → the first decision", began)

    # Every version of the LLMService since the restart, up to the first decision.
    versions = [obj for _, _, obj in scenario.llm_watch.snapshot(since=restarted_at)
                if obj["metadata"]["name"] == NAME]
    first_change = next((i for i, obj in enumerate(versions) if sup.history(obj) != kept), None)
    assert first_change is not None, "the LLMService watch did not see the decision"
    for obj in versions[:first_change]:
        assert sup.status_of(obj).get("desiredReplicas") == 2, sup.status_of(obj)
        assert sup.history(obj) == kept
    # That decision: one entry appended to the kept history, a scale-down by the window rule.
    history = sup.history(changed)
    assert history[:-1] == kept and len(history) == len(kept) + 1, history
    entry = history[-1]
    assert (entry["from"], entry["to"]) == (2, 1), entry
    assert entry["reason"] == (f"requestsInFlight at most 0 for target 1 per replica over "
                               f"{SCALE_DOWN_DELAY_S}s: 1 replica(s)"), entry
    assert sup.status_of(changed)["desiredReplicas"] == 1
    # Not at once: the new process's first reading is after `restarted_at`, and the decision
    # needs SCALE_DOWN_DELAY_S of readings (status times are whole seconds, rounded down).
    decided_at = sup.parse_time(entry["time"])
    assert decided_at >= math.floor(restarted_at) + SCALE_DOWN_DELAY_S, (entry["time"], restarted_at)

    # The new operator was ticking, and acting, all along: it marked both Pods idle at its
    # first tick and put them to sleep afterIdleSeconds later, before that decision.
    pod_events = scenario.pod_watch.snapshot(since=restarted_at)
    names = {obj["metadata"]["name"] for _, _, obj in pod_events}
    assert len(names) == 2, names
    for name in names:
        marks = [sup.parse_time(obj["metadata"]["annotations"][sup.IDLE_SINCE]) for _, _, obj in pod_events
                 if obj["metadata"]["name"] == name and sup.IDLE_SINCE in (obj["metadata"].get("annotations") or {})]
        assert marks and min(marks) >= restarted_at, (name, marks, restarted_at)
        assert decided_at + 1 - min(marks) >= SCALE_DOWN_DELAY_S  # the whole window, unchanged
        asleep = [obj for _, _, obj in pod_events if obj["metadata"]["name"] == name
                  and obj["metadata"]["labels"].get(sup.SLEEP_STATE) == "asleep-1"]
        assert asleep, f"{name} never put to sleep by the restarted operator"
    sleeping_before = [obj for obj in versions[:first_change] if sup.status_of(obj).get("sleepingReplicas") == 2]
    assert sleeping_before, "status never counted both replicas asleep before the scale-down"
    assert any(e.get("reason") == "ScaledDown" and e["message"] == f"2 -> 1: {entry['reason']}"
               for e in st.events(NAME))


# --- 3. idle → asleep ----------------------------------------------------------------------------

def test_idle_replica_sleeps(scenario: Scenario) -> None:
    st = scenario.stack
    began = time.monotonic()

    def one_asleep() -> dict[str, Any] | None:
        status, pods = scenario.status(), scenario.live_pods()
        if (status.get("phase"), status.get("desiredReplicas"), status.get("sleepingReplicas")) != ("Sleeping", 1, 1):
            return None
        if len(pods) != 1 or pods[0]["metadata"]["labels"].get(sup.SLEEP_STATE) != "asleep-1":
            return None
        return pods[0]
    pod = st.wait_for(one_asleep, 60, "one replica left, asleep, and status Sleeping")
    scenario.step("scale-down → one replica, Sleeping", began)
    assert sup.engine_sleeping(pod, PORT, ENGINE_KEY) is True  # the engine itself says so
    row = st.kubectl("get", "llm", NAME, "--no-headers").split()
    assert row[2:4] == ["1/1", "Sleeping"], row
    assert any(e.get("reason") == "ReplicaSleeping" and pod["metadata"]["name"] in e["message"]
               for e in st.events(NAME))
    scenario.sleeper = pod["metadata"]["name"]
    scenario.engine_pids = dict(st.engine_pids())


# --- 4. a request through the router wakes it -----------------------------------------------

def test_request_through_the_router_wakes_it(scenario: Scenario) -> None:
    st = scenario.stack
    held_before = scenario.demand()["totalHeld"]
    pods_seen = {obj["metadata"]["name"] for _, _, obj in scenario.pod_watch.snapshot()}
    history_before = sup.history(scenario.llm())

    began, asked_at = time.monotonic(), time.time()
    answer = scenario.ask("wake")
    scenario.step("request to the sleeping replica answered", began)
    scenario.woken_at = time.time()
    assert answer.ok, answer
    assert answer.text == scenario.reference  # greedy: the same answer as before the sleep

    (pod,) = scenario.live_pods()
    assert pod["metadata"]["name"] == scenario.sleeper  # woken, not replaced
    assert sup.engine_sleeping(pod, PORT, ENGINE_KEY) is False
    assert scenario.demand()["totalHeld"] == held_before + 1  # held while the replica woke
    # The label followed the wake. Read from the Pod watch: on a slow box the replica can be
    # asleep again (afterIdleSeconds after it answered) before a poll of the Pod would see it.
    st.wait_for(lambda: any(obj["metadata"]["name"] == scenario.sleeper
                            and obj["metadata"]["labels"].get(sup.SLEEP_STATE) == "awake"
                            for _, _, obj in scenario.pod_watch.snapshot(since=asked_at)),
                30, "the Pod labelled awake")
    assert {obj["metadata"]["name"] for _, _, obj in scenario.pod_watch.snapshot()} == pods_seen  # no new Pod
    assert sup.history(scenario.llm()) == history_before  # a wake is not a scaling decision


# --- 5. longer idle → 0 Pods -------------------------------------------------------------------

def test_longer_idle_removes_the_last_pod(scenario: Scenario) -> None:
    st = scenario.stack
    began = time.monotonic()
    st.wait_for(lambda: not st.pods(NAME) and scenario.status().get("desiredReplicas") == 0,
                REMOVE_AFTER_S + 90, "no Pods left")
    scenario.step("wake → 0 Pods", began)
    llm = scenario.llm()
    entry = sup.history(llm)[-1]
    assert (entry["from"], entry["to"]) == (1, 0), entry
    assert entry["reason"].startswith(f"idle for removeAfterSeconds: {scenario.sleeper} (idle for "), entry
    status = sup.status_of(llm)
    assert status["phase"] == "Sleeping" and status["replicas"] == 0
    assert st.condition(NAME, "Ready")["reason"] == "ScaledToZero"

    # awake → asleep → removed, and counted from the idle mark the wake reset.
    since_wake = [(at, kind, obj) for at, kind, obj in scenario.pod_watch.snapshot(since=scenario.woken_at)
                  if obj["metadata"]["name"] == scenario.sleeper]
    marks = [sup.parse_time(obj["metadata"]["annotations"][sup.IDLE_SINCE]) for _, _, obj in since_wake
             if sup.IDLE_SINCE in (obj["metadata"].get("annotations") or {})]
    # The mark the removal counted from was set after the wake (the wake reset the count).
    assert marks and max(marks) >= scenario.woken_at - 1, (marks, scenario.woken_at)
    assert sup.parse_time(entry["time"]) >= math.floor(max(marks)) + REMOVE_AFTER_S
    first_asleep = next(i for i, (_, _, obj) in enumerate(since_wake)
                        if obj["metadata"]["labels"].get(sup.SLEEP_STATE) == "asleep-1")
    first_deleting = next(i for i, (_, kind, obj) in enumerate(since_wake)
                          if kind == "DELETED" or obj["metadata"].get("deletionTimestamp"))
    assert first_asleep < first_deleting

    # Its engine process is gone too.
    pids = [pid for key, pid in scenario.engine_pids.items() if scenario.sleeper in key]
    assert pids
    st.wait_for(lambda: not any(sup.alive(pid) for pid in pids), 60, f"engine process {pids} ended")


# --- 6. a request at zero is held, a Pod is created, the request is answered ------------------

@pytest.fixture
def second_router(scenario: Scenario) -> Iterator[str]:
    """A second `tidal router` replica on the same cluster, as the chart runs two: its held
    demand reaches the operator only through its own Lease (issue 21: the operator used to
    ask one router URL and missed what the others held)."""
    import socket
    import subprocess
    import sys

    st = scenario.stack
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tidal_operator.cli", "router", "--kubeconfig", str(st.kubeconfig),
                             "--host", "127.0.0.1", "--port", str(port), "--demand-leases", "default",
                             "--keys-namespace", "default", "--router-id", "second-router", "--log-level", "warning"],
                            env={**st.env, "TIDAL_ROUTER_API_KEY": st.api_key})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        st.wait_for(ready, 60, "the second router ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_request_at_zero_is_held_and_answered(scenario: Scenario, second_router: str) -> None:
    st = scenario.stack
    assert not st.pods(NAME)
    before = scenario.demand(second_router)
    answers: list[sup.Answer] = []
    sent_at = time.time()
    began = time.monotonic()
    # Sent to the second router replica, not the one `tidal dev` started: only its Lease tells
    # the operator about it.
    client = threading.Thread(target=lambda: answers.append(scenario.ask("from zero", second_router)), daemon=True)
    client.start()
    st.wait_for(lambda: scenario.demand(second_router)["held"] == 1, 30, "the request held by the second router")
    client.join(READY_BOUND_S + 60)
    assert answers, "the first request at zero never came back"
    (answer,) = answers
    scenario.step("request at zero → answered", began)
    assert answer.ok, answer
    assert answer.text == scenario.reference

    llm = scenario.llm()
    entry = sup.history(llm)[-1]
    assert (entry["from"], entry["to"]) == (0, 1), entry
    assert entry["reason"] == "1 request(s) held by the router at zero replicas", entry
    (pod,) = scenario.live_pods()
    assert sup.pod_ready(pod)
    created = [at for at, kind, obj in scenario.pod_watch.snapshot(since=sent_at)
               if kind == "ADDED" and obj["metadata"]["name"] == pod["metadata"]["name"]]
    assert created, "the Pod that answered was not created after the request was sent"
    after = scenario.demand(second_router)
    assert after["held"] == 0 and after["totalHeld"] == before["totalHeld"] + 1
    scenario.second_router_answers = 1


# --- 7. across the whole scenario ------------------------------------------------------------

def test_no_request_lost_or_failed_across_the_scenario(scenario: Scenario) -> None:
    st = scenario.stack
    answers = scenario.ledger.answers
    assert not scenario.ledger.failed(), scenario.ledger.failed()[:5]
    assert all("Paris" in a.text for a in answers)
    kinds = {a.what for a in answers}
    assert kinds == {"reference", "burst", "wake", "from zero"}, kinds

    # The router's own count: every request it answered for this model was a 200, as many
    # as the client sent, and none was refused (held too long, or the queue full).
    samples = sup.metric_samples(sup.router_get(st.router_url, st.api_key, "/metrics").text)
    by_status: dict[str, float] = {}
    for (name, labels), value in samples.items():
        labels_ = dict(labels)
        if name == "tidal_router_requests_total" and labels_.get("model") == NAME:
            by_status[labels_["status"]] = by_status.get(labels_["status"], 0) + value
    # (The request at zero went through the second router replica, step 6.)
    assert by_status == {"200": len(answers) - scenario.second_router_answers}, (by_status, len(answers))
    assert sup.metric_sum(samples, "tidal_router_rejected_requests_total", lambda l: l.get("model") == NAME) == 0

    # The whole life in status.scalingHistory, and never more than two replicas.
    assert _history_pairs(scenario.llm()) == [(1, 2), (2, 1), (1, 0), (0, 1)]
    wanted = [sup.status_of(obj).get("desiredReplicas") for _, _, obj in scenario.llm_watch.snapshot()
              if obj["metadata"]["name"] == NAME]
    assert max(w for w in wanted if w is not None) == 2
    assert max(len(live) for _, live in sup.live_pods(scenario.pod_watch.snapshot())) <= 2
    print(f"{len(answers)} requests, all answered; scenario {time.monotonic() - scenario.started:.1f}s")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v", "-s"])
