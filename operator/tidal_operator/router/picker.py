"""Choosing a replica: least load, or consistent hashing with bounded load.

A replica's load is its estimated queue: what its engine last reported on /metrics (running
plus waiting requests, a few hundred milliseconds old) corrected by the requests this router
sent or finished since, or just this router's own outstanding requests while no report is
known. Least load also weighs KV-cache usage (a nearly full cache preempts). Prefix hashing
keeps a prompt on its ring replica until that one holds more than its bounded share of the
estimated queues, or its KV cache is saturated, then walks the ring.

`choose_replica` is pure: it gets the candidates, their loads and the cooling set, and
returns one. `LoadTracker` is the small bit of mutable state around it (outstanding
requests, engine reports, recent failures, the round-robin tie-breaker).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

from tidal_operator.router.registry import Key, Replica

DEFAULT_VNODES = 64
DEFAULT_EPSILON = 0.25
KV_WEIGHT = 4.0  # a full KV cache costs like this many queued requests (least load)
KV_SATURATED = 0.95  # prefix affinity gives way above this KV-cache usage


@dataclass(frozen=True)
class EngineLoad:
    """One engine's /metrics report, and this router's outstanding requests to it then."""

    running: float
    waiting: float
    kv_cache_usage: float
    local_at_report: int


def estimated_queue(report: EngineLoad | None, local_now: int) -> float:
    """The engine's queue now: its report plus what this router changed since (never less
    than this router's own outstanding requests to it)."""
    if report is None:
        return float(local_now)
    return max(float(local_now), report.running + report.waiting + local_now - report.local_at_report)


def _hash64(text: str) -> int:
    # blake2b rather than hash(): stable across processes, so every router replica agrees.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=256)
def _ring(names: tuple[str, ...], vnodes: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    points = sorted((_hash64(f"{name}#{i}"), name) for name in names for i in range(vnodes))
    return tuple(p[0] for p in points), tuple(p[1] for p in points)


def ring_order(names: Sequence[str], key: str, vnodes: int = DEFAULT_VNODES) -> list[str]:
    """The replicas in the order the ring visits them, starting from `key`'s position.
    Adding or removing one replica moves only the keys that hashed next to it."""
    hashes, owners = _ring(tuple(sorted(set(names))), vnodes)
    if not hashes:
        return []
    start = bisect.bisect_left(hashes, _hash64(key)) % len(hashes)
    seen: list[str] = []
    for i in range(len(hashes)):
        owner = owners[(start + i) % len(hashes)]
        if owner not in seen:
            seen.append(owner)
            if len(seen) == len(set(names)):
                break
    return seen


def bounded_capacity(total_load: float, replicas: int, epsilon: float) -> int:
    """The most outstanding requests one replica may hold after placing the next request
    (consistent hashing with bounded loads: ceil(average * (1 + epsilon)), average
    counting the request being placed)."""
    return max(1, math.ceil((total_load + 1) / replicas * (1 + epsilon)))


def choose_replica(candidates: Sequence[Replica], loads: Mapping[Key, float], *, strategy: str = "leastLoad",
                   prefix_key: str | None = None, cooling: frozenset[Key] = frozenset(), tiebreak: int = 0,
                   epsilon: float = DEFAULT_EPSILON, vnodes: int = DEFAULT_VNODES,
                   kv_usage: Mapping[Key, float] | None = None) -> Replica | None:
    """Pick one of `candidates` (already filtered to routable ones), or None if empty.

    `loads`: each replica's estimated queue; `kv_usage`: its KV-cache usage (0 to 1) where
    known. Replicas in `cooling` (failed recently) are used only if nothing else is left.
    """
    kv = kv_usage or {}
    pool = [r for r in candidates if r.key not in cooling] or list(candidates)
    if not pool:
        return None
    pool.sort(key=lambda r: r.key)
    if strategy == "prefixHash" and prefix_key:
        by_name = {r.pod_name + "." + r.namespace: r for r in pool}
        cap = bounded_capacity(sum(loads.get(r.key, 0) for r in pool), len(pool), epsilon)
        order = ring_order(list(by_name), prefix_key, vnodes)
        for name in order:
            replica = by_name[name]
            if loads.get(replica.key, 0) + 1 <= cap and kv.get(replica.key, 0.0) < KV_SATURATED:
                return replica
        # Every replica is over its share or saturated: the least loaded one takes it.

    def cost(r: Replica) -> float:
        return loads.get(r.key, 0) + KV_WEIGHT * kv.get(r.key, 0.0)

    least = min(cost(r) for r in pool)
    tied = [r for r in pool if cost(r) == least]
    return tied[tiebreak % len(tied)]


# --- the prompt prefix ----------------------------------------------------------------------

def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def prompt_prefix(body: Mapping[str, Any], length: int) -> str:
    """The first `length` characters of what the engine will see first, so requests that
    share a system prompt (and so a cached KV prefix) get the same key. The model name is
    part of it: adapters don't share KV with their base model."""
    parts: list[str] = [str(body.get("model", "")), "\x00"]
    if isinstance(body.get("messages"), list):
        for message in body["messages"]:
            if isinstance(message, Mapping):
                parts.append(f"{message.get('role', '')}:{_content_text(message.get('content'))}\n")
            if sum(map(len, parts)) >= length:
                break
    else:
        prompt = body.get("prompt", body.get("input", ""))
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            prompt = " ".join(map(str, prompt)) if isinstance(first, int) else first
        parts.append(prompt if isinstance(prompt, str) else str(prompt))
    return "".join(parts)[:length]


# --- mutable bookkeeping --------------------------------------------------------------------

@dataclass
class LoadTracker:
    """Outstanding requests per replica and recent failures, for this router process."""

    cooldown_s: float = 10.0
    outstanding: dict[Key, int] = field(default_factory=dict)
    failed_at: dict[Key, float] = field(default_factory=dict)
    engines: dict[Key, EngineLoad] = field(default_factory=dict)  # the latest /metrics reports
    last_used: dict[Key, float] = field(default_factory=dict)  # monotonic time of the last request sent
    _counter: int = 0

    def report(self, key: Key, running: float, waiting: float, kv_cache_usage: float) -> None:
        self.engines[key] = EngineLoad(running, waiting, kv_cache_usage, self.outstanding.get(key, 0))

    def forget_reports(self, keep: frozenset[Key] = frozenset()) -> None:
        for key in [k for k in self.engines if k not in keep]:
            del self.engines[key]

    def estimated_loads(self, replicas: Sequence[Replica]) -> dict[Key, float]:
        return {r.key: estimated_queue(self.engines.get(r.key), self.outstanding.get(r.key, 0)) for r in replicas}

    def cooling(self, now: float | None = None) -> frozenset[Key]:
        now = time.monotonic() if now is None else now
        return frozenset(k for k, t in self.failed_at.items() if now - t < self.cooldown_s)

    def next_tiebreak(self) -> int:
        self._counter += 1
        return self._counter

    def acquire(self, replica: Replica) -> None:
        self.last_used[replica.key] = time.monotonic()
        self.outstanding[replica.key] = self.outstanding.get(replica.key, 0) + 1

    def release(self, replica: Replica) -> None:
        left = self.outstanding.get(replica.key, 0) - 1
        if left > 0:
            self.outstanding[replica.key] = left
        else:
            self.outstanding.pop(replica.key, None)

    def mark_failed(self, replica: Replica, now: float | None = None) -> None:
        self.failed_at[replica.key] = time.monotonic() if now is None else now

    def mark_ok(self, replica: Replica) -> None:
        self.failed_at.pop(replica.key, None)

    def pick(self, candidates: Sequence[Replica], *, strategy: str, prefix_key: str | None,
             exclude: frozenset[Key] = frozenset(), epsilon: float = DEFAULT_EPSILON) -> Replica | None:
        """Choose among `candidates` minus `exclude` (replicas this request already tried)."""
        remaining = [r for r in candidates if r.key not in exclude]
        kv = {r.key: self.engines[r.key].kv_cache_usage for r in remaining if r.key in self.engines}
        return choose_replica(remaining, self.estimated_loads(remaining), strategy=strategy, prefix_key=prefix_key,
                              cooling=self.cooling(), tiebreak=self.next_tiebreak(), epsilon=epsilon, kv_usage=kv)
