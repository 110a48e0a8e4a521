"""The safety net for what no event announces: a Secret that appears later, a Pod stuck past
its startup budget. A plain task rather than a kopf timer, which would add kopf's finalizer."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from .reconciler import Reconciler

log = logging.getLogger(__name__)


async def resync_loop(reconciler: Reconciler, active: Callable[[], Awaitable[bool]], *, full_every_s: float,
                      unsettled_every_s: float, namespace: str | None) -> None:
    """Every LLMService each `full_every_s`, the unsettled ones (invalid, or not Ready yet)
    each `unsettled_every_s`, so fixing a missing Secret takes effect soon."""
    loop = asyncio.get_running_loop()
    next_full = loop.time() + full_every_s
    while True:
        await asyncio.sleep(unsettled_every_s)
        try:
            if not await active():
                continue
            if loop.time() >= next_full:
                next_full = loop.time() + full_every_s
                keys = {(o["metadata"]["namespace"], o["metadata"]["name"])
                        for o in await reconciler.kube.list_llmservices(namespace)}
                reconciler.unsettled &= keys
            else:
                keys = set(reconciler.unsettled)
            for ns, name in sorted(keys):
                await reconciler.run(ns, name)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - keep the safety net alive through API hiccups
            log.exception("resync failed; retrying at the next tick")
