"""Polling each routable engine's /metrics for its own load (running and waiting requests,
KV-cache usage), which the picker adds to what this router knows itself: other router
replicas, direct clients and long generations all show up in the engine's queue."""

from __future__ import annotations

import asyncio
import logging

import httpx

from tidal_operator.engine_client import EngineMetrics
from tidal_operator.router.picker import LoadTracker
from tidal_operator.router.registry import ModelEntry, Registry, Replica

log = logging.getLogger("tidal.router.engine_load")


class EngineLoadPoller:
    """Every `interval_s`, scrape every routable replica (with its engine key) into `loads`.
    A replica whose scrape fails loses its report: the picker falls back to this router's
    own count for it rather than trusting a stale number."""

    def __init__(self, registry: Registry, http: httpx.AsyncClient, loads: LoadTracker, *,
                 interval_s: float = 0.5, timeout_s: float = 1.0) -> None:
        self.registry = registry
        self.http = http
        self.loads = loads
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        targets: dict[tuple[str, str], tuple[Replica, ModelEntry]] = {}
        for entry in self.registry.state.entries():
            for replica in entry.routable():
                targets[replica.key] = (replica, entry)
        results = await asyncio.gather(*(self._scrape(r, e) for r, e in targets.values()))
        kept = set()
        for (replica, _), metrics in zip(targets.values(), results):
            if metrics is None or metrics.in_flight is None:
                continue
            self.loads.report(replica.key, metrics.running or 0.0, metrics.waiting or 0.0,
                              metrics.kv_cache_usage or 0.0)
            kept.add(replica.key)
        self.loads.forget_reports(frozenset(kept))

    async def _scrape(self, replica: Replica, entry: ModelEntry) -> EngineMetrics | None:
        key = self.registry.engine_api_key(entry)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            response = await asyncio.wait_for(self.http.get(f"{replica.url}/metrics", headers=headers,
                                                            timeout=self.timeout_s), self.timeout_s)
            response.raise_for_status()
            return EngineMetrics.parse(response.text)
        except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
            log.debug("load scrape of %s/%s failed: %r", replica.namespace, replica.pod_name, exc)
            return None
