"""Pure: the idle policy of one LLMService's replicas, awake → asleep → deeper → removed.

A replica is idle while its engine reports no running or waiting request, its token counters
stand still, and the router holds no request for the LLMService. The time it became idle is
kept on the Pod (annotation `tidal.dev/idle-since`), so an operator restart continues the
count instead of starting over. Every threshold counts from that moment:

    idle ≥ afterIdleSeconds    → sleep(level)           (engine /sleep?mode=wait: drains first)
    idle ≥ deepAfterSeconds    → sleep(2)               (optional; from level 1)
    idle ≥ removeAfterSeconds  → remove the Pod         (optional; only above minReplicas)

Work, held demand, or a wake by someone else (a router) resets the count. An unknown scrape holds everything as it is. Sleepers
are woken when the load needs more awake replicas than there are (level 1 first: fastest).
The engine's own report of its sleep level wins over the Pod label, and the label is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from .. import labels as L
from ..api.types import SleepSpec

IDLE_SINCE_ANNOTATION = "tidal.dev/idle-since"

LEVEL_OF_STATE = {L.SLEEP_AWAKE: 0, L.SLEEP_LEVEL_1: 1, L.SLEEP_LEVEL_2: 2}
STATE_OF_LEVEL = {v: k for k, v in LEVEL_OF_STATE.items()}

ActionKind = Literal["sleep", "wake", "remove", "set_idle_since", "set_sleep_state"]


@dataclass(frozen=True)
class ReplicaIdleView:
    """What the idle policy knows of one engine Pod this round."""

    pod: str
    ready: bool
    sleep_state: str = L.SLEEP_AWAKE  # the Pod's label
    idle_since: float | None = None  # the Pod's annotation
    busy: bool | None = None  # None: this round's scrape failed
    engine_level: int | None = None  # the sleep level the engine reports, when scraped
    # Asleep at the previous round, awake now, and not by us: a router woke it for a request.
    # Its old idle count must not put it straight back to sleep.
    woken: bool = False


@dataclass(frozen=True)
class IdleAction:
    kind: ActionKind
    pod: str
    level: int = 0  # sleep
    since: float | None = None  # set_idle_since (None: clear)
    state: str = ""  # set_sleep_state
    reason: str = ""


def _target_level(idle_for: float, sleep: SleepSpec) -> int:
    if sleep.deep_after_seconds is not None and idle_for >= sleep.deep_after_seconds:
        return 2
    if idle_for >= sleep.after_idle_seconds:
        return sleep.level
    return 0


def plan_idle(replicas: Iterable[ReplicaIdleView], sleep: SleepSpec | None, now: float, demand: int | None, *,
              awake_wanted: int = 0, removable: int = 0) -> list[IdleAction]:
    """The idle actions for this round, in the order to apply them.

    awake_wanted: awake replicas the load needs now (decide's `load`; >= 1 with demand).
    removable: Pods that may be removed (current - minReplicas in builtin mode, else 0).
    """
    actions: list[IdleAction] = []
    live = sorted((r for r in replicas if r.ready), key=lambda r: r.pod)

    # The engine knows whether it sleeps; the label is what the router reads. Make them agree.
    level: dict[str, int] = {}
    for r in live:
        label_level = LEVEL_OF_STATE.get(r.sleep_state, 0)
        level[r.pod] = r.engine_level if r.engine_level is not None else label_level
        if r.engine_level is not None and r.engine_level != label_level and r.engine_level in STATE_OF_LEVEL:
            actions.append(IdleAction("set_sleep_state", r.pod, state=STATE_OF_LEVEL[r.engine_level],
                                      reason=f"the engine reports sleep level {r.engine_level}"))

    awake = [r for r in live if level[r.pod] == 0]
    sleepers = sorted((r for r in live if level[r.pod] > 0), key=lambda r: (level[r.pod], r.pod))
    waking = sleepers[:max(0, awake_wanted - len(awake))]
    for r in waking:
        actions.append(IdleAction("wake", r.pod, reason=f"the load needs {awake_wanted} awake replica(s), "
                                                           f"{len(awake)} awake"))
        if r.idle_since is not None:
            actions.append(IdleAction("set_idle_since", r.pod, since=None, reason="woken"))
    waking_names = {r.pod for r in waking}

    if sleep is None:
        return actions

    remove_candidates: list[tuple[ReplicaIdleView, float]] = []
    for r in live:
        if r.pod in waking_names or r.busy is None or demand is None:
            continue  # unknown: keep the count and the state as they are
        if r.busy or r.woken or demand > 0:
            if r.idle_since is not None:
                why = "busy" if r.busy else "woken" if r.woken else f"{demand} request(s) held by the router"
                actions.append(IdleAction("set_idle_since", r.pod, since=None, reason=why))
            continue
        since = r.idle_since
        if since is None or since > now:
            since = now
            actions.append(IdleAction("set_idle_since", r.pod, since=now, reason="idle"))
        idle_for = now - since
        if sleep.remove_after_seconds is not None and idle_for >= sleep.remove_after_seconds:
            remove_candidates.append((r, idle_for))
            continue
        target = _target_level(idle_for, sleep)
        if target > level[r.pod]:
            actions.append(IdleAction("sleep", r.pod, level=target, reason=f"idle for {idle_for:.0f}s"))

    # Deepest and longest-idle first; the rest stay asleep at their deepest level.
    remove_candidates.sort(key=lambda c: (-level[c[0].pod], -c[1], c[0].pod))
    for i, (r, idle_for) in enumerate(remove_candidates):
        if i < removable:
            actions.append(IdleAction("remove", r.pod, reason=f"idle for {idle_for:.0f}s"))
            continue
        target = _target_level(idle_for, sleep)
        if target > level[r.pod]:
            actions.append(IdleAction("sleep", r.pod, level=target,
                                      reason=f"idle for {idle_for:.0f}s (kept: minReplicas)"))
    return actions
