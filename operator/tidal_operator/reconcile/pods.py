"""The Pod planner: from the observed engine Pods to what to create and delete next.

Pure and idempotent: the same inputs give the same plan, and Pod names are deterministic
(`<llm>-<spec hash>-<index>`, lowest free index), so an operator restarted mid-reconcile
computes the very names it was about to create and the API server's AlreadyExists (409)
stops a duplicate. The handler applies one plan, then waits for the next Pod event.

Rules:
- Terminating Pods (deletionTimestamp set) count for nothing, but keep their names taken.
- Failed/Succeeded Pods are deleted and replaced.
- Rolling update (spec.rollout): at most desired+maxSurge live Pods while old-hash Pods
  remain; an old Pod goes only when enough others are Ready that Ready stays >=
  desired-maxUnavailable (an old Pod that isn't Ready goes at once: it serves nothing).
  The default, surge 1 and unavailable 0, never drops below desired; surge 0 and
  unavailable 1 replaces Pods one at a time in place (a full GPU pool has no surge room).
- Extras go in this order: not Ready, old hash, asleep (deepest first), newest.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from .. import labels as L
from .manifests import pod_name

TERMINAL_PHASES = frozenset({"Failed", "Succeeded"})
_SLEEP_RANK = {L.SLEEP_LEVEL_2: 0, L.SLEEP_LEVEL_1: 1, L.SLEEP_AWAKE: 2}


@dataclass(frozen=True)
class PodView:
    """What the planner needs to know about one engine Pod."""

    name: str
    spec_hash: str
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    deleting: bool = False
    created: datetime | None = None
    sleep_state: str = L.SLEEP_AWAKE

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> "PodView":
        """Read a Pod object (as the API returns it)."""
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return cls(
            name=meta["name"],
            spec_hash=(meta.get("annotations") or {}).get(L.SPEC_HASH, ""),
            phase=status.get("phase") or "Pending",
            ready=ready,
            deleting=bool(meta.get("deletionTimestamp")),
            created=parse_time(meta.get("creationTimestamp")),
            sleep_state=(meta.get("labels") or {}).get(L.SLEEP_STATE, L.SLEEP_AWAKE),
        )

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def asleep(self) -> bool:
        return self.sleep_state != L.SLEEP_AWAKE


@dataclass(frozen=True)
class PodToCreate:
    name: str
    index: int  # pass to manifests.pod_manifest(llm, index, config)


@dataclass(frozen=True)
class PodPlan:
    """Do the deletes (in order) and the creates; both are safe to retry."""

    create: tuple[PodToCreate, ...] = ()
    delete: tuple[str, ...] = ()
    rolling: bool = False  # old-hash Pods are still alive

    @property
    def empty(self) -> bool:
        return not self.create and not self.delete


def parse_time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _deletion_rank(p: PodView, spec_hash: str) -> tuple[Any, ...]:
    """Sort key: the first Pods in this order are the first to delete."""
    created = p.created or _EPOCH
    return (p.ready, p.spec_hash == spec_hash, _SLEEP_RANK.get(p.sleep_state, 2), -created.timestamp(), p.name)


def plan_pods(desired_replicas: int, spec_hash: str, pods: Iterable[PodView], *, llm_name: str,
              max_surge: int = 1, max_unavailable: int = 0) -> PodPlan:
    """What to create and delete so that `desired_replicas` Pods with `spec_hash` run."""
    desired = max(0, desired_replicas)
    every = sorted(pods, key=lambda p: p.name)
    live = [p for p in every if not p.deleting]
    dead = [p for p in live if p.terminal]
    alive = [p for p in live if not p.terminal]
    current = [p for p in alive if p.spec_hash == spec_hash]
    old = [p for p in alive if p.spec_hash != spec_hash]

    delete: list[PodView] = list(dead)

    # Current-hash Pods beyond desired: scale-down, or a stray from a crashed operator.
    extra = sorted(current, key=lambda p: _deletion_rank(p, spec_hash))[: max(0, len(current) - desired)]
    delete += extra
    kept = [p for p in current if p not in extra]

    # Old Pods that aren't Ready serve nothing: they go now. Ready ones go as new Pods become
    # Ready, keeping Ready >= desired - maxUnavailable.
    old_unready = [p for p in old if not p.ready]
    old_ready = sorted((p for p in old if p.ready), key=lambda p: _deletion_rank(p, spec_hash))
    ready_total = sum(p.ready for p in kept) + len(old_ready)
    removable = max(0, min(len(old_ready), ready_total - max(0, desired - max_unavailable)))
    delete += old_unready + old_ready[:removable]
    old_left = len(old_ready) - removable

    missing = desired - len(kept)
    if old_left:
        # Never more than desired+maxSurge live Pods while the roll is on.
        missing = min(missing, desired + max_surge - (len(kept) + old_left))
    taken = {p.name for p in every}  # terminating Pods still hold their names
    creates: list[PodToCreate] = []
    index = 0
    while len(creates) < max(0, missing):
        name = pod_name(llm_name, spec_hash, index)
        if name not in taken:
            creates.append(PodToCreate(name, index))
            taken.add(name)
        index += 1

    ordered = sorted(delete, key=lambda p: (not p.terminal, _deletion_rank(p, spec_hash)))
    return PodPlan(create=tuple(creates), delete=tuple(p.name for p in ordered), rolling=bool(old))
