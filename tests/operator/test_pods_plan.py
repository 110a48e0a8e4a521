"""reconcile/pods.py: the planner, step by step against a tiny simulated cluster."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from tidal_operator.reconcile.manifests import pod_name
from tidal_operator.reconcile.pods import PodPlan, PodView, plan_pods

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
OLD, NEW = "aaaaaaaaaa", "bbbbbbbbbb"


class Cluster:
    """Pods as the planner sees them. Created Pods start not Ready; `become_ready` plays
    the kubelet; deleted Pods linger as terminating until `finish_deletes`."""

    def __init__(self, pods: list[PodView] | None = None) -> None:
        self.pods: dict[str, PodView] = {p.name: p for p in pods or []}
        self.clock = 0

    def view(self) -> list[PodView]:
        return list(self.pods.values())

    def apply(self, plan: PodPlan, spec_hash: str) -> None:
        for name in plan.delete:
            self.pods[name] = replace(self.pods[name], deleting=True)
        for c in plan.create:
            assert c.name not in self.pods, f"duplicate {c.name}"
            self.clock += 1
            self.pods[c.name] = PodView(c.name, spec_hash, "Pending", False, False, T0 + timedelta(seconds=self.clock))

    def become_ready(self) -> None:
        for name, p in self.pods.items():
            if not p.deleting:
                self.pods[name] = replace(p, phase="Running", ready=True)

    def finish_deletes(self) -> None:
        self.pods = {n: p for n, p in self.pods.items() if not p.deleting}

    def live(self) -> list[PodView]:
        return [p for p in self.pods.values() if not p.deleting]

    def ready_count(self) -> int:
        return sum(p.ready for p in self.live())


def running(name: str, h: str, ready: bool = True, age: int = 0, **kw: object) -> PodView:
    return PodView(name, h, "Running", ready, False, T0 - timedelta(seconds=age), **kw)  # type: ignore[arg-type]


def fleet(n: int, h: str, llm: str = "m") -> list[PodView]:
    return [running(pod_name(llm, h, i), h, age=100 - i) for i in range(n)]


def test_fresh_creates_desired_with_deterministic_names() -> None:
    plan = plan_pods(3, NEW, [], llm_name="m")
    assert [c.name for c in plan.create] == [f"m-{NEW}-0", f"m-{NEW}-1", f"m-{NEW}-2"]
    assert [c.index for c in plan.create] == [0, 1, 2] and plan.delete == ()


def test_steady_state_is_empty() -> None:
    assert plan_pods(2, NEW, fleet(2, NEW), llm_name="m").empty


def test_idempotent_and_restart_safe() -> None:
    pods = fleet(1, NEW) + [running(pod_name("m", NEW, 2), NEW)]
    first = plan_pods(4, NEW, pods, llm_name="m")
    # Same inputs in any order, as a restarted operator would list them: the same plan.
    assert plan_pods(4, NEW, list(reversed(pods)), llm_name="m") == first
    assert [c.name for c in first.create] == [f"m-{NEW}-1", f"m-{NEW}-3"], "lowest free indices"
    # The operator created the first Pod, then crashed; after restart it asks only for the rest.
    cluster = Cluster(pods)
    cluster.apply(PodPlan(create=first.create[:1]), NEW)
    again = plan_pods(4, NEW, cluster.view(), llm_name="m")
    assert [c.name for c in again.create] == [f"m-{NEW}-3"]


def test_missing_pod_is_recreated() -> None:
    pods = fleet(3, NEW)
    del pods[1]
    plan = plan_pods(3, NEW, pods, llm_name="m")
    assert [c.name for c in plan.create] == [f"m-{NEW}-1"] and plan.delete == ()


def test_failed_pod_is_deleted_and_replaced() -> None:
    pods = fleet(2, NEW)
    pods[0] = replace(pods[0], phase="Failed", ready=False)
    plan = plan_pods(2, NEW, pods, llm_name="m")
    assert plan.delete == (pods[0].name,)
    # Its name is still taken until it is gone, so the replacement gets a new one.
    assert [c.name for c in plan.create] == [f"m-{NEW}-2"]


def test_terminating_pods_dont_count_but_keep_their_names() -> None:
    pods = fleet(2, NEW)
    pods[0] = replace(pods[0], deleting=True)
    plan = plan_pods(2, NEW, pods, llm_name="m")
    assert [c.name for c in plan.create] == [f"m-{NEW}-2"] and plan.delete == ()


def test_extras_are_deleted_not_ready_first_then_newest() -> None:
    pods = [running("m-x-0", NEW, age=50), running("m-x-1", NEW, age=10), running("m-x-2", NEW, ready=False, age=40),
            running("m-x-3", NEW, age=30)]
    assert plan_pods(2, NEW, pods, llm_name="m").delete == ("m-x-2", "m-x-1")
    assert plan_pods(0, NEW, pods, llm_name="m").delete == ("m-x-2", "m-x-1", "m-x-3", "m-x-0")


def test_sleeping_replicas_go_first_on_scale_down() -> None:
    pods = [running("m-x-0", NEW, age=50, sleep_state="asleep-1"), running("m-x-1", NEW, age=10),
            running("m-x-2", NEW, age=40, sleep_state="asleep-2")]
    assert plan_pods(1, NEW, pods, llm_name="m").delete == ("m-x-2", "m-x-0")


@pytest.mark.parametrize("desired", [1, 2, 3, 5])
def test_rolling_update_surge_one(desired: int) -> None:
    cluster = Cluster(fleet(desired, OLD))
    max_live, steps = 0, 0
    while True:
        plan = plan_pods(desired, NEW, cluster.view(), llm_name="m")
        if plan.empty:
            break
        steps += 1
        assert steps < 10 * desired + 10, "the roll must converge"
        assert len(plan.create) <= 1, "surge 1: one new Pod at a time"
        cluster.apply(plan, NEW)
        max_live = max(max_live, len(cluster.live()))
        # Deleting never takes Ready below desired, at any point of the roll.
        assert cluster.ready_count() >= desired
        cluster.finish_deletes()
        cluster.become_ready()
        assert cluster.ready_count() >= desired
    assert max_live <= desired + 1
    assert sorted(p.spec_hash for p in cluster.live()) == [NEW] * desired
    assert all(p.ready for p in cluster.live())


@pytest.mark.parametrize("desired", [1, 2, 4])
def test_rolling_update_in_place_on_a_full_pool(desired: int) -> None:
    """maxSurge 0, maxUnavailable 1: never more live Pods than desired (a full GPU pool has
    no room for a surge Pod, and surge 1 would wait forever), at most one replica down."""
    cluster = Cluster(fleet(desired, OLD))
    steps = 0
    while True:
        plan = plan_pods(desired, NEW, cluster.view(), llm_name="m", max_surge=0, max_unavailable=1)
        if plan.empty:
            break
        steps += 1
        assert steps < 10 * desired + 10, "the roll must converge"
        cluster.apply(plan, NEW)
        assert len(cluster.live()) <= desired
        assert cluster.ready_count() >= desired - 1
        cluster.finish_deletes()
        cluster.become_ready()
    assert sorted(p.spec_hash for p in cluster.live()) == [NEW] * desired


def test_max_surge_two_creates_two_at_once() -> None:
    plan = plan_pods(3, NEW, fleet(3, OLD), llm_name="m", max_surge=2)
    assert len(plan.create) == 2 and plan.delete == ()


def test_roll_waits_for_the_new_pod_to_be_ready() -> None:
    pods = fleet(1, OLD)
    plan = plan_pods(1, NEW, pods, llm_name="m")
    assert [c.name for c in plan.create] == [f"m-{NEW}-0"] and plan.delete == () and plan.rolling
    starting = pods + [running(f"m-{NEW}-0", NEW, ready=False)]
    assert plan_pods(1, NEW, starting, llm_name="m").empty, "old Pod stays until the new one is Ready"
    ready = pods + [running(f"m-{NEW}-0", NEW)]
    assert plan_pods(1, NEW, ready, llm_name="m").delete == (pods[0].name,)


def test_old_pods_that_are_not_ready_go_at_once() -> None:
    pods = [running("m-o-0", OLD), running("m-o-1", OLD, ready=False)]
    plan = plan_pods(2, NEW, pods, llm_name="m")
    assert plan.delete == ("m-o-1",)
    assert len(plan.create) == 2, "desired+1 live Pods at most: 1 old + 2 new"


def test_broken_new_pod_stalls_the_roll_without_losing_service() -> None:
    pods = fleet(2, OLD) + [running(f"m-{NEW}-0", NEW, ready=False)]
    plan = plan_pods(2, NEW, pods, llm_name="m")
    assert plan.empty


def test_scale_down_during_roll() -> None:
    pods = fleet(3, OLD) + [running(f"m-{NEW}-0", NEW)]
    plan = plan_pods(1, NEW, pods, llm_name="m")
    assert set(plan.delete) == {p.name for p in fleet(3, OLD)} and plan.create == ()


def test_scale_to_zero_and_back() -> None:
    cluster = Cluster(fleet(2, NEW))
    cluster.apply(plan_pods(0, NEW, cluster.view(), llm_name="m"), NEW)
    cluster.finish_deletes()
    assert cluster.live() == []
    plan = plan_pods(1, NEW, cluster.view(), llm_name="m")
    assert [c.name for c in plan.create] == [f"m-{NEW}-0"]


def test_from_pod_reads_the_api_object() -> None:
    pod = {"metadata": {"name": "m-x-0", "annotations": {"tidal.dev/spec-hash": NEW},
                        "labels": {"tidal.dev/sleep-state": "asleep-1"},
                        "creationTimestamp": "2026-01-01T00:00:00Z", "deletionTimestamp": "2026-01-01T00:01:00Z"},
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    v = PodView.from_pod(pod)
    assert (v.name, v.spec_hash, v.phase, v.ready, v.deleting, v.sleep_state) == \
        ("m-x-0", NEW, "Running", True, True, "asleep-1")
    assert v.created == T0
    bare = PodView.from_pod({"metadata": {"name": "p"}})
    assert (bare.phase, bare.ready, bare.deleting, bare.spec_hash) == ("Pending", False, False, "")
