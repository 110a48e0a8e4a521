"""decide_replicas: table-driven timelines of readings, one rule per case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tidal_operator.api.types import AutoscalingSpec
from tidal_operator.engine_client import EngineMetrics
from tidal_operator.scaling.decide import Reading, ScalingState, decide_replicas, metric_value, replicas_needed


def spec(**kw: Any) -> AutoscalingSpec:
    base: dict[str, Any] = {"min_replicas": 0, "max_replicas": 4, "metric": "requestsInFlight", "target": 4,
                            "scale_up_stabilization_seconds": 0, "scale_down_delay_seconds": 60}
    base.update(kw)
    return AutoscalingSpec(**base)


def r(t: float, *values: float | None, demand: int | None = 0) -> Reading:
    """A reading at time t with one value per replica p0, p1, ..."""
    return Reading(t, {f"p{i}": v for i, v in enumerate(values)}, demand)


def steady(t0: float, t1: float, *values: float | None, step: float = 10, demand: int | None = 0) -> list[Reading]:
    """Identical readings every `step` seconds from t0 to t1 inclusive."""
    out, t = [], t0
    while t <= t1:
        out.append(r(t, *values, demand=demand))
        t += step
    return out


@dataclass
class Case:
    name: str
    history: list[Reading]
    now: float
    current: int
    expect: int
    spec: dict[str, Any]
    loading: int = 0
    last_scale: float | None = None
    idle_floor: bool = False
    reason: str = ""  # a substring of the decision's reason


CASES = [
    # --- the formula and the limits ---
    Case("ceil of total over target", [r(0, 5, 4)], 0, 2, 3, {}, reason="requestsInFlight 9"),
    Case("exact multiple does not round up", [r(0, 4, 4)], 0, 2, 2, {}, reason="within target"),
    Case("float noise does not round up", [r(0, 4.000000001, 4)], 0, 2, 2, {}),
    Case("clamped to maxReplicas", [r(0, 40, 40)], 0, 2, 4, {}),
    Case("below minReplicas goes up at once", [], 0, 1, 2, {"min_replicas": 2}, reason="minReplicas is 2"),
    Case("above maxReplicas goes down at once", [r(0, 0)], 0, 6, 4, {}, reason="maxReplicas is 4"),
    Case("no readings yet: hold", [], 0, 2, 2, {}, reason="no metrics yet"),
    # --- bursts and the scale-up window ---
    Case("burst shorter than the up window: hold", [r(0, 1), r(10, 20), r(20, 20), r(30, 20)], 30, 1, 1,
         {"scale_up_stabilization_seconds": 30}, reason="must last"),
    Case("burst that lasts the up window scales to its lowest need",
         [r(0, 1), r(10, 20), r(20, 12), r(30, 20), r(40, 20)], 40, 1, 3,
         {"scale_up_stabilization_seconds": 30}),
    Case("up window not observed yet (restart): hold", [r(20, 20), r(30, 20)], 30, 1, 1,
         {"scale_up_stabilization_seconds": 30}, reason="fewer than 30s"),
    Case("no up window: the newest reading decides", [r(0, 1), r(10, 16)], 10, 1, 4, {}),
    # --- Pods still loading ---
    Case("no further scale-up while a Pod loads", [r(0, 30, 0)], 0, 2, 2, {}, loading=1,
         reason="still loading"),
    Case("scale-down is not blocked by loading", steady(0, 60, 0, 0), 60, 2, 0, {}, loading=1),
    # --- scale-down: delay, consecutive lower readings, noise ---
    Case("lower readings for the whole delay: down to the window's highest need",
         [r(0, 7), r(10, 3), r(20, 6), r(30, 2), r(40, 1), r(50, 1), r(60, 1)], 60, 3, 2, {},
         reason="over 60s"),
    Case("one reading at current need inside the window: hold",
         [r(0, 1), r(10, 1), r(20, 9), r(30, 1), r(40, 1), r(50, 1), r(60, 1)], 60, 3, 3, {}, reason="stay lower"),
    Case("noisy readings around the target: hold",
         [r(t, 9 if i % 2 else 3) for i, t in enumerate(range(0, 70, 10))], 60, 3, 3, {}),
    Case("window not observed yet (restart): hold", steady(20, 60, 0), 60, 3, 3, {}, reason="fewer than 60s"),
    Case("recent scale: hold until the delay passed", steady(0, 60, 0), 60, 3, 3, {}, last_scale=30,
         reason="last scale 30s ago"),
    Case("delay 0: the newest reading decides", [r(0, 0)], 0, 3, 0, {"scale_down_delay_seconds": 0}),
    Case("down respects minReplicas", steady(0, 60, 0), 60, 3, 1, {"min_replicas": 1}),
    # --- missing scrapes ---
    Case("unknown scrape in the down window: hold", [*steady(0, 40, 0, 0), r(50, 0, None), r(60, 0, 0)], 60, 2, 2,
         {}, reason="unknown"),
    Case("unknown router demand in the down window: hold", [*steady(0, 50, 0), r(60, 0, demand=None)], 60, 2, 2,
         {}, reason="unknown"),
    Case("unknown scrape: the known part still scales up", [r(0, 12, None)], 0, 1, 3, {},
         reason="1 replica(s) unknown"),
    Case("all unknown is not zero: no scale-down", steady(0, 60, None, None), 60, 2, 2, {}),
    # --- router demand ---
    Case("demand at zero replicas scales from zero at once", [r(0, demand=3)], 0, 0, 1,
         {"scale_up_stabilization_seconds": 600}, reason="3 request(s) held"),
    Case("much demand at zero replicas asks for more", [r(0, demand=9)], 0, 0, 3, {}),
    Case("demand at zero replicas respects minReplicas and max", [r(0, demand=90)], 0, 0, 4, {}),
    Case("no demand at zero replicas: stay at zero", [r(0)], 0, 0, 0, {}),
    Case("held requests add to the waiting total", [r(0, 2, demand=3)], 0, 1, 3,
         {"metric": "requestsWaiting", "target": 2}, reason="held by the router"),
    Case("held requests with kvCacheUsage need at least one replica", [r(0, demand=1)], 0, 0, 1,
         {"metric": "kvCacheUsage", "target": 0.8}),
    Case("held demand blocks scale-down to zero", [*steady(0, 50, 0), r(60, 0, demand=1)], 60, 1, 1, {}),
    # --- kvCacheUsage is a fraction per replica ---
    Case("kvCacheUsage over target", [r(0, 0.9, 0.85)], 0, 2, 3, {"metric": "kvCacheUsage", "target": 0.8}),
    Case("kvCacheUsage under target for the delay", steady(0, 60, 0.3, 0.2), 60, 2, 1,
         {"metric": "kvCacheUsage", "target": 0.8}),
    # --- a sleep policy owns the way to zero ---
    Case("idle floor keeps one replica for the idle policy", steady(0, 60, 0, 0), 60, 2, 1, {}, idle_floor=True),
    Case("idle floor never scales a lone replica away", steady(0, 60, 0), 60, 1, 1, {}, idle_floor=True),
    Case("without a sleep policy zero load goes to zero", steady(0, 60, 0, 0), 60, 2, 0, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    state = ScalingState(current=case.current, loading=case.loading, last_scale_time=case.last_scale,
                         idle_floor=case.idle_floor)
    decision = decide_replicas(case.history, spec(**case.spec), state, case.now)
    assert decision.desired == case.expect, decision.reason
    assert decision.previous == case.current
    assert decision.changed == (case.expect != case.current)
    assert case.reason in decision.reason


def test_a_burst_timeline_scales_up_then_back_down_after_the_delay() -> None:
    """1 → 3 on a burst, hold while the new Pods load, then 3 → 1 only after 60s of low readings."""
    s = spec(scale_down_delay_seconds=60)
    history: list[Reading] = []
    current, last_scale = 1, None
    seen: list[tuple[float, int]] = []
    for t in range(0, 200, 10):
        load = 10 if 20 <= t < 60 else 1
        history.append(r(t, load))
        loading = 2 if t == 20 else 0  # the new Pods are Ready by the next reading
        d = decide_replicas(history, s, ScalingState(current, loading, last_scale), t)
        if d.changed:
            current, last_scale = d.desired, t
            seen.append((t, current))
    # Up at 30 (not 20: two Pods were loading), down once the last high reading (50) is 60s old.
    assert seen == [(30, 3), (120, 1)]


def test_router_demand_overrides_the_newest_reading() -> None:
    d = decide_replicas([r(0, demand=0)], spec(), ScalingState(0), 0, router_demand=2)
    assert d.desired == 1 and d.load == 1


def test_load_reports_the_need_before_windows() -> None:
    d = decide_replicas([r(0, 1), r(10, 13)], spec(scale_up_stabilization_seconds=30), ScalingState(1), 10)
    assert d.desired == 1 and d.load == 4


def test_readings_after_now_are_ignored() -> None:
    d = decide_replicas([r(0, 1), r(100, 40)], spec(), ScalingState(1), 0)
    assert d.desired == 1


@pytest.mark.parametrize("metric,expected", [("requestsWaiting", 2.0), ("requestsInFlight", 5.0),
                                             ("kvCacheUsage", 0.5)])
def test_metric_value(metric: Any, expected: float) -> None:
    m = EngineMetrics(running=3, waiting=2, kv_cache_usage=0.5)
    assert metric_value(m, metric) == expected
    assert metric_value(None, metric) is None


def test_replicas_needed_is_zero_without_load() -> None:
    assert replicas_needed(r(0, 0, 0), spec()) == 0
    assert replicas_needed(r(0, 0, None), spec()) == 0
