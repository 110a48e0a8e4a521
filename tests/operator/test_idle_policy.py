"""plan_idle: timelines of one or more replicas through awake → asleep-1 → asleep-2 → removed."""

from __future__ import annotations

from dataclasses import dataclass, replace
from tidal_operator import labels as L
from tidal_operator.api.types import SleepSpec
from tidal_operator.scaling.idle import STATE_OF_LEVEL, IdleAction, ReplicaIdleView, plan_idle

POLICY = SleepSpec(after_idle_seconds=60, level=1, deep_after_seconds=300, remove_after_seconds=900)


@dataclass
class Sim:
    """Applies plan_idle's actions to replica views, as the controller would on the cluster."""

    replicas: dict[str, ReplicaIdleView]
    sleep: SleepSpec | None
    removed: list[tuple[float, str]]

    def step(self, now: float, *, busy: dict[str, bool] | None = None, demand: int | None = 0,
             awake_wanted: int = 0, removable: int = 10) -> list[IdleAction]:
        busy = busy or {}
        views = [replace(v, busy=busy.get(v.pod, False)) for v in self.replicas.values()]
        actions = plan_idle(views, self.sleep, now, demand, awake_wanted=awake_wanted, removable=removable)
        for a in actions:
            v = self.replicas[a.pod]
            if a.kind == "set_idle_since":
                self.replicas[a.pod] = replace(v, idle_since=a.since)
            elif a.kind == "sleep":
                self.replicas[a.pod] = replace(v, sleep_state=STATE_OF_LEVEL[a.level])
            elif a.kind == "wake":
                self.replicas[a.pod] = replace(v, sleep_state=L.SLEEP_AWAKE)
            elif a.kind == "set_sleep_state":
                self.replicas[a.pod] = replace(v, sleep_state=a.state)
            elif a.kind == "remove":
                del self.replicas[a.pod]
                self.removed.append((now, a.pod))
        return actions

    def state(self, pod: str) -> str:
        return self.replicas[pod].sleep_state if pod in self.replicas else "removed"


def sim(*pods: str, sleep: SleepSpec | None = POLICY) -> Sim:
    return Sim({p: ReplicaIdleView(p, ready=True) for p in pods}, sleep, [])


def kinds(actions: list[IdleAction]) -> list[tuple[str, str]]:
    return [(a.kind, a.pod) for a in actions if a.kind in ("sleep", "wake", "remove")]


def test_level1_then_level2_then_removed_on_schedule() -> None:
    s = sim("a")
    timeline = {}
    for t in range(0, 1000, 10):
        s.step(float(t))
        timeline.setdefault(s.state("a"), t)
    # Counted from the first idle observation (t=0), each threshold on its tick.
    assert timeline == {L.SLEEP_AWAKE: 0, L.SLEEP_LEVEL_1: 60, L.SLEEP_LEVEL_2: 300, "removed": 900}


def test_the_first_idle_observation_starts_the_count() -> None:
    s = sim("a")
    actions = s.step(100.0)
    assert [(a.kind, a.since) for a in actions] == [("set_idle_since", 100.0)]
    assert s.step(159.0) == [] and s.state("a") == L.SLEEP_AWAKE
    assert kinds(s.step(160.0)) == [("sleep", "a")]


def test_work_resets_the_count_and_interrupts_the_descent() -> None:
    s = sim("a")
    s.step(0.0)
    s.step(50.0, busy={"a": True})  # a request at 50: not idle any more
    assert s.replicas["a"].idle_since is None
    s.step(60.0)  # idle again from 60
    s.step(110.0)
    assert s.state("a") == L.SLEEP_AWAKE
    s.step(120.0)
    assert s.state("a") == L.SLEEP_LEVEL_1


def test_router_demand_counts_as_not_idle_for_every_replica() -> None:
    s = sim("a", "b")
    s.step(0.0)
    actions = s.step(30.0, demand=2)
    assert {(a.kind, a.since) for a in actions} == {("set_idle_since", None)}
    s.step(80.0)
    assert s.state("a") == s.state("b") == L.SLEEP_AWAKE  # the count restarted at 80


def test_demand_wakes_sleepers_level1_first() -> None:
    s = sim("a", "b", "c")
    s.replicas["a"] = replace(s.replicas["a"], sleep_state=L.SLEEP_LEVEL_2, idle_since=0.0)
    s.replicas["b"] = replace(s.replicas["b"], sleep_state=L.SLEEP_LEVEL_1, idle_since=0.0)
    s.replicas["c"] = replace(s.replicas["c"], sleep_state=L.SLEEP_LEVEL_1, idle_since=0.0)
    actions = s.step(400.0, demand=1, awake_wanted=1)
    assert kinds(actions) == [("wake", "b")]
    assert s.replicas["b"].idle_since is None
    # More load: the next sleepers, level 1 before level 2.
    assert kinds(s.step(401.0, demand=0, awake_wanted=3)) == [("wake", "c"), ("wake", "a")]


def test_no_wake_when_enough_replicas_are_awake() -> None:
    s = sim("a", "b")
    s.replicas["b"] = replace(s.replicas["b"], sleep_state=L.SLEEP_LEVEL_1)
    assert kinds(s.step(0.0, busy={"a": True}, awake_wanted=1)) == []


def test_min_replicas_protects_from_removal_but_not_from_sleep() -> None:
    s = sim("a", "b")
    for t in range(0, 2000, 10):
        s.step(float(t), removable=len(s.replicas) - 1)  # minReplicas 1
    assert s.removed == [(900.0, "a")]
    assert s.state("b") == L.SLEEP_LEVEL_2  # kept, asleep at the deepest level


def test_removal_takes_the_deepest_longest_idle_first() -> None:
    s = sim("a", "b")
    s.replicas["a"] = replace(s.replicas["a"], sleep_state=L.SLEEP_LEVEL_1, idle_since=0.0)
    s.replicas["b"] = replace(s.replicas["b"], sleep_state=L.SLEEP_LEVEL_2, idle_since=10.0)
    assert kinds(s.step(1000.0, removable=1)) == [("remove", "b"), ("sleep", "a")]


def test_unknown_scrape_holds_everything() -> None:
    view = ReplicaIdleView("a", ready=True, idle_since=0.0, busy=None)
    assert plan_idle([view], POLICY, 1000.0, 0, removable=1) == []
    known = replace(view, busy=False)
    assert plan_idle([known], POLICY, 1000.0, None, removable=1) == []  # unknown demand holds too


def test_not_ready_replicas_are_left_alone() -> None:
    view = ReplicaIdleView("a", ready=False, idle_since=0.0, busy=False)
    assert plan_idle([view], POLICY, 1000.0, 0, removable=1, awake_wanted=1) == []


def test_level_2_from_the_start() -> None:
    s = sim("a", sleep=SleepSpec(after_idle_seconds=30, level=2))
    for t in range(0, 100, 10):
        s.step(float(t))
    assert s.state("a") == L.SLEEP_LEVEL_2 and s.removed == []


def test_no_sleep_policy_only_wakes() -> None:
    s = sim("a", sleep=None)
    s.replicas["a"] = replace(s.replicas["a"], sleep_state=L.SLEEP_LEVEL_1)
    assert s.step(0.0) == []
    assert kinds(s.step(1.0, demand=1, awake_wanted=1)) == [("wake", "a")]


def test_a_restart_continues_the_count_from_the_annotation() -> None:
    # The annotation says idle since 0; a new operator at t=400 goes straight to level 2.
    view = ReplicaIdleView("a", ready=True, idle_since=0.0, busy=False)
    actions = plan_idle([view], POLICY, 400.0, 0, removable=1)
    assert [(a.kind, a.level) for a in actions] == [("sleep", 2)]


def test_the_engine_report_wins_over_the_label() -> None:
    # The router woke it (label not yet updated): relabel, and don't sleep it again at once.
    view = ReplicaIdleView("a", ready=True, sleep_state=L.SLEEP_LEVEL_1, idle_since=None, busy=False,
                           engine_level=0)
    actions = plan_idle([view], POLICY, 0.0, 0)
    assert [(a.kind, a.state) for a in actions if a.kind == "set_sleep_state"] == [("set_sleep_state", L.SLEEP_AWAKE)]
    assert kinds(actions) == []
    # And a label that says awake for an engine that sleeps is corrected the other way.
    view = ReplicaIdleView("a", ready=True, sleep_state=L.SLEEP_AWAKE, busy=False, engine_level=2)
    assert [a.state for a in plan_idle([view], POLICY, 0.0, 0) if a.kind == "set_sleep_state"] == [L.SLEEP_LEVEL_2]


def test_a_replica_woken_by_the_router_starts_a_new_count() -> None:
    # Idle since 0, asleep until a router woke it: not straight back to sleep at t=500.
    view = ReplicaIdleView("a", ready=True, idle_since=0.0, busy=False, engine_level=0, woken=True)
    actions = plan_idle([view], POLICY, 500.0, 0, removable=1)
    assert [(a.kind, a.since) for a in actions] == [("set_idle_since", None)]
