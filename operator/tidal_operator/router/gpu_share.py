"""Which members of a GPU-share group to put to sleep so that a requested one can wake.

Pure: from the group's state (who is awake, each one's share of the device, when each was
last used, which ones have requests in flight) and the requested member to a plan. The
router runs one plan at a time per group (group_switch.py, docs/gpu-sharing.md).

Rules:
- The awake members' shares must sum to at most `capacity` (1: the whole device) once the
  requested member is awake.
- Victims are taken least recently used first. A member with requests in flight (or held
  for it) is taken only when `preempt_busy` is set (the requested member has waited long
  enough), and then after every idle one, so a burst is not cut in half to serve a
  single request for another model.
- If the requested member can't fit even with every other member asleep, the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

CAPACITY = 1.0
# Shares are fractions written by people (0.45 + 0.55): compare with a little slack.
_EPSILON = 1e-9


@dataclass(frozen=True)
class Member:
    """One LLMService of the group, as the router sees it."""

    name: str
    share: float  # the fraction of the device it uses while awake
    awake: bool
    last_used: float = 0.0  # monotonic time of its last request; 0: never
    busy: bool = False  # requests in flight on it, or held for it


@dataclass(frozen=True)
class SwitchPlan:
    """`outcome`: ready (nothing to sleep; `wake` may still be needed), sleep_then_wake, wait
    (only busy members could make room and preempting them is not allowed yet) or
    impossible (the member doesn't fit the device even alone)."""

    outcome: Literal["ready", "sleep_then_wake", "wait", "impossible"]
    sleep: tuple[str, ...] = ()
    wake: str | None = None


def awake_share(members: Iterable[Member]) -> float:
    return sum(m.share for m in members if m.awake)


def plan_switch(members: Iterable[Member], requested: str, *, capacity: float = CAPACITY,
                preempt_busy: bool = False) -> SwitchPlan:
    """What to put to sleep (in order) so that `requested` is awake and the group fits."""
    group = {m.name: m for m in members}
    if requested not in group:
        raise KeyError(f"{requested!r} is not a member of the group")
    target = group[requested]
    wake = None if target.awake else requested
    if target.share > capacity + _EPSILON:
        return SwitchPlan("impossible", wake=wake)
    others = [m for m in group.values() if m.name != requested and m.awake]
    used = target.share + sum(m.share for m in others)
    if used <= capacity + _EPSILON:
        return SwitchPlan("ready", wake=wake)
    victims: list[str] = []
    # Idle before busy, then least recently used, then by name (deterministic).
    for m in sorted(others, key=lambda m: (m.busy, m.last_used, m.name)):
        if used <= capacity + _EPSILON:
            break
        if m.busy and not preempt_busy:
            return SwitchPlan("wait", wake=wake)
        victims.append(m.name)
        used -= m.share
    return SwitchPlan("sleep_then_wake", sleep=tuple(victims), wake=wake)
