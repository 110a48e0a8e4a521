"""Scrape many engines' /metrics at once: bounded concurrency, a timeout each, failures as None.

A failed scrape is *unknown* (None), never 0: counting a timed-out, overloaded engine as
idle is exactly the wrong way round, and decide.py holds scale-down while anything is unknown.
One Scraper (one connection pool, one semaphore) is shared by every LLMService's loop, so
the bound holds operator-wide.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Iterable

import httpx

from ..engine_client import EngineClient, EngineError, EngineMetrics

log = logging.getLogger("tidal.scaling.scraper")


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    base_url: str  # http://ip:port
    api_key: str | None = None

    def __repr__(self) -> str:  # the key stays out of logs
        return f"ScrapeTarget({self.pod!r}, {self.base_url!r})"


class Scraper:
    def __init__(self, *, timeout_s: float = 3.0, concurrency: int = 32,
                 http: httpx.AsyncClient | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.timeout_s = timeout_s
        self._semaphore = asyncio.Semaphore(concurrency)
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s,
                                               limits=httpx.Limits(max_connections=concurrency * 2))

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def scrape_one(self, target: ScrapeTarget) -> EngineMetrics | None:
        client = EngineClient(target.base_url, target.api_key, timeout_s=self.timeout_s, http=self._http)
        async with self._semaphore:
            try:
                # The overall deadline also covers a server that trickles bytes.
                return await asyncio.wait_for(client.metrics(), self.timeout_s)
            except (EngineError, asyncio.TimeoutError) as exc:
                log.info("scrape of %s failed: %s", target.pod, str(exc) or type(exc).__name__)
                return None

    async def scrape(self, targets: Iterable[ScrapeTarget]) -> dict[str, EngineMetrics | None]:
        """Every target's metrics by pod name; None for each one that failed."""
        targets = list(targets)
        results = await asyncio.gather(*(self.scrape_one(t) for t in targets))
        return {t.pod: r for t, r in zip(targets, results)}
