"""Held demand from every router replica, read from their Leases (see router/demand_lease.py).

Each router keeps a Lease labelled `tidal.dev/router-demand` in its namespace with what it
holds per LLMService; this sums the unexpired ones. One list per tick (cached for `ttl_s`)
serves every LLMService; a failed list makes the demand unknown (None), never 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, Iterable, Mapping

from .. import labels as L

log = logging.getLogger("tidal.scaling.demand")

def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def demand_from_leases(leases: Iterable[Mapping[str, Any]], now: datetime) -> dict[tuple[str, str], int]:
    """{(namespace, llmservice): held} summed over the routers whose Lease has not expired (pure)."""
    totals: dict[tuple[str, str], int] = {}
    for lease in leases:
        meta = lease.get("metadata") or {}
        spec = lease.get("spec") or {}
        renewed = _parse_time(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds")
        if renewed is None or not isinstance(duration, int) or renewed + timedelta(seconds=duration) < now:
            continue  # a router that stopped renewing (crashed): what it held is gone with it
        try:
            held = json.loads((meta.get("annotations") or {}).get(L.HELD_DEMAND) or "[]")
        except ValueError:
            log.warning("Lease %s: unreadable %s annotation", meta.get("name"), L.HELD_DEMAND)
            continue
        add_held(totals, held if isinstance(held, list) else [])
    return totals


def add_held(totals: dict[tuple[str, str], int], entries: Iterable[Any]) -> None:
    """Adds one router's [{namespace, llmservice, held}] to `totals` (in place)."""
    for d in entries:
        if isinstance(d, Mapping):
            key = (str(d.get("namespace")), str(d.get("llmservice")))
            totals[key] = totals.get(key, 0) + int(d.get("held") or 0)


DemandTotals = dict[tuple[str, str], int]


class CachedDemand:
    """A DemandSource whose totals for every LLMService come from one `_fetch`, cached for
    `ttl_s` so all LLMServices of one tick share it. `_fetch` gives None when unknown."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._cache: tuple[float, DemandTotals | None] | None = None
        self._lock = asyncio.Lock()

    async def _fetch(self) -> DemandTotals | None:
        raise NotImplementedError

    async def held(self, namespace: str, llmservice: str) -> int | None:
        async with self._lock:
            now = self._clock()
            if self._cache is None or now - self._cache[0] >= self.ttl_s:
                self._cache = (now, await self._fetch())
            totals = self._cache[1]
        return None if totals is None else totals.get((namespace, llmservice), 0)


class LeaseDemandClient(CachedDemand):
    """DemandSource over the routers' Leases in one namespace."""

    def __init__(self, request: Callable[..., Awaitable[Any]], namespace: str, *, ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        super().__init__(ttl_s, clock)
        self.request = request  # Kube.request
        self.namespace = namespace
        self._now = now

    async def _fetch(self) -> DemandTotals | None:
        try:
            listing = await self.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
                                          query={"labelSelector": L.ROUTER_DEMAND})
        except Exception as exc:
            log.info("router demand Leases in %s unknown: %r", self.namespace, exc)
            return None
        return demand_from_leases(listing.get("items") or [], self._now())
