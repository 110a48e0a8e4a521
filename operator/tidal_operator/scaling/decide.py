"""Pure: from a metric history to the number of replicas an LLMService wants.

The rules (docs/autoscaling.md explains each):
- needed(reading) = ceil(total / target), total = the metric summed over the replicas plus,
  for the request metrics, the requests the router holds; any held request needs >= 1 replica.
- Clamped to [minReplicas, maxReplicas]. With a sleep policy the load never takes the last
  replica away: the idle policy does that (sleep first, remove later), so the floor is 1
  while a replica exists.
- Scale-from-zero: demand held at zero replicas scales up at once, past every window.
- Scale-up: to the *lowest* need over the last scaleUpStabilizationSeconds (a burst must last
  the window), never while Pods are still loading (their capacity isn't in the readings yet).
- Scale-down: to the *highest* need over the last scaleDownDelaySeconds, only when every
  reading of that window is lower than now, the window is fully observed, none of its readings
  is unknown, and the last scale is at least that long ago.
- Unknown scrapes: the known part of a reading is a lower bound of the truth, so it may
  justify a scale-up, but never a scale-down.
Time is in seconds (float, any epoch); the caller supplies `now`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..api.types import AutoscalingSpec, ScalingMetric
from ..engine_client import EngineMetrics

# ceil(8.000000001 / 4) must be 2, not 3: readings are sums of floats.
_EPSILON = 1e-9


@dataclass(frozen=True)
class Reading:
    """One scrape round of one LLMService."""

    time: float
    # The metric per scraped replica (Ready Pods); None: the scrape failed (unknown).
    values: Mapping[str, float | None] = field(default_factory=dict)
    # Requests the router holds for this LLMService; None: the router couldn't be asked.
    demand: int | None = 0

    @property
    def complete(self) -> bool:
        return self.demand is not None and all(v is not None for v in self.values.values())


@dataclass(frozen=True)
class ScalingState:
    """What decide needs besides the readings, read back from status and the Pod list."""

    current: int  # the last decision (status.desiredReplicas)
    loading: int = 0  # replicas wanted but not Ready yet (starting, or not created yet)
    last_scale_time: float | None = None
    # A sleep policy exists: idle replicas sleep, and leave only through the idle policy.
    idle_floor: bool = False


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    previous: int
    load: int = 0  # replicas the newest reading needs, before windows and clamping

    @property
    def changed(self) -> bool:
        return self.desired != self.previous


def metric_value(metrics: EngineMetrics | None, metric: ScalingMetric) -> float | None:
    """The scaled-on value of one replica's scrape; None when unknown."""
    if metrics is None:
        return None
    if metric == "requestsWaiting":
        return metrics.waiting
    if metric == "requestsInFlight":
        return metrics.in_flight
    return metrics.kv_cache_usage


def reading_total(reading: Reading, metric: ScalingMetric) -> float:
    total = sum(v for v in reading.values.values() if v is not None)
    if metric != "kvCacheUsage":
        # A held request is a waiting request that has no replica to wait in yet.
        total += reading.demand or 0
    return total


def replicas_needed(reading: Reading, spec: AutoscalingSpec) -> int:
    """ceil(total / target), unclamped; at least 1 while the router holds requests."""
    total = reading_total(reading, spec.metric)
    need = math.ceil(total / spec.target - _EPSILON) if total > 0 else 0
    if (reading.demand or 0) > 0:
        need = max(need, 1)
    return need


def _window(history: Sequence[Reading], now: float, seconds: float) -> tuple[list[Reading], bool]:
    """The readings of the last `seconds`, and whether the history reaches back that far."""
    start = now - seconds
    inside = [r for r in history if start <= r.time <= now]
    covered = bool(history) and history[0].time <= start
    return inside, covered


def _fmt(x: float) -> str:
    return f"{x:g}"


def decide_replicas(history: Sequence[Reading], spec: AutoscalingSpec, state: ScalingState, now: float,
                    router_demand: int | None = None) -> Decision:
    """Desired replicas for one LLMService in builtin mode.

    `history`: readings, oldest first, none later than `now`. `router_demand`: the held
    requests now, if fresher than the newest reading's (it replaces that reading's demand).
    """
    readings = [r for r in history if r.time <= now]
    if readings and router_demand is not None:
        last = readings[-1]
        readings[-1] = Reading(last.time, last.values, router_demand)
    current = state.current
    lo, hi = spec.min_replicas, spec.max_replicas

    def hold(reason: str, load: int = 0) -> Decision:
        return Decision(current, reason, current, load)

    # Limits first: a spec edit takes effect now, without waiting for any window.
    if current < lo:
        return Decision(lo, f"minReplicas is {lo}", current)
    if current > hi:
        return Decision(hi, f"maxReplicas is {hi}", current)
    if not readings:
        return hold("no metrics yet")

    latest = readings[-1]
    load = replicas_needed(latest, spec)
    demand = latest.demand or 0
    total = reading_total(latest, spec.metric)

    if current == 0:
        if demand > 0:
            # Held requests wait on us: no stabilization window at zero.
            want = min(max(load, 1, lo), hi)
            return Decision(want, f"{demand} request(s) held by the router at zero replicas", current, load)
        return hold("no demand at zero replicas", load)

    floor = max(lo, 1) if state.idle_floor else lo

    def clamp(n: int) -> int:
        return min(max(n, floor), hi)

    # --- scale up ----------------------------------------------------------------------
    up_window, up_covered = _window(readings, now, spec.scale_up_stabilization_seconds)
    if spec.scale_up_stabilization_seconds == 0:
        up_window, up_covered = [latest], True
    if clamp(load) > current:
        if not up_covered:
            return hold(f"scale-up waits: fewer than {spec.scale_up_stabilization_seconds}s of readings", load)
        up = clamp(min(replicas_needed(r, spec) for r in up_window))
        if up <= current:
            return hold(f"scale-up waits: load must last {spec.scale_up_stabilization_seconds}s", load)
        if state.loading > 0:
            return hold(f"scale-up to {up} waits: {state.loading} replica(s) still loading", load)
        unknown = sum(v is None for v in latest.values.values())
        return Decision(up, f"{spec.metric} {_fmt(total)} for target {_fmt(spec.target)} per replica"
                        + (f" ({demand} held by the router)" if demand else "")
                        + (f" ({unknown} replica(s) unknown, counted as a lower bound)" if unknown else "")
                        + f": {up} replica(s)", current, load)

    # --- scale down --------------------------------------------------------------------
    if clamp(load) < current:
        delay = spec.scale_down_delay_seconds
        if state.last_scale_time is not None and now - state.last_scale_time < delay:
            return hold(f"scale-down waits: last scale {_fmt(now - state.last_scale_time)}s ago, delay {delay}s", load)
        window, covered = _window(readings, now, delay)
        if delay == 0:
            window, covered = [latest], True
        if not covered:
            return hold(f"scale-down waits: fewer than {delay}s of readings", load)
        if not all(r.complete for r in window):
            return hold("scale-down holds: a scrape or the router's demand was unknown in the window", load)
        down = clamp(max(replicas_needed(r, spec) for r in window))
        if down >= current:
            return hold(f"scale-down waits: readings must stay lower for {delay}s", load)
        return Decision(down, f"{spec.metric} at most {_fmt(max(reading_total(r, spec.metric) for r in window))} "
                        f"for target {_fmt(spec.target)} per replica over {delay}s: {down} replica(s)",
                        current, load)

    return hold("within target", load)
