"""GPU-share groups on the request path: put the least recently used members to sleep, then
wake the requested one, one switch at a time per group (docs/gpu-sharing.md).

`GroupSwitcher` stands where the proxy expects the Waker: for an LLMService outside a group
it hands over to the Waker; for a member it runs `gpu_share.plan_switch` under the group's
lock, so concurrent requests for different members queue for their turn instead of undoing
each other's switches. A member that has requests in flight, or held for it, is not put to
sleep until the requested member has waited `preempt_after_s`; then its in-flight requests
still finish, because the engine drains them (`/sleep?mode=wait`) before it sleeps.

Within one router process only: several router replicas each serialise their own switches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import httpx

from tidal_operator import labels as L
from tidal_operator.router.gpu_share import Member, plan_switch
from tidal_operator.router.picker import LoadTracker
from tidal_operator.router.registry import Key, ModelEntry, Registry
from tidal_operator.router.waker import DemandBook, Waker, cancel_and_wait

log = logging.getLogger("tidal.router.group_switch")


class GroupSwitcher:
    def __init__(self, registry: Registry, http: httpx.AsyncClient, waker: Waker, loads: LoadTracker,
                 demand: DemandBook, *, preempt_after_s: float = 5.0, sleep_timeout_s: float = 120.0,
                 poll_interval_s: float = 0.05, retry_backoff_s: float = 1.0) -> None:
        self.registry = registry
        self.http = http
        self.waker = waker
        self.loads = loads
        self.demand = demand
        self.preempt_after_s = preempt_after_s
        self.sleep_timeout_s = sleep_timeout_s
        self.poll_interval_s = poll_interval_s
        self.retry_backoff_s = retry_backoff_s
        self._locks: dict[Key, asyncio.Lock] = {}  # (namespace, group)
        self._tasks: dict[Key, asyncio.Task[bool]] = {}  # (namespace, llmservice)
        # The latest switches, (put to sleep, woken), oldest first: for debugging and tests.
        self.switches: deque[tuple[tuple[str, ...], str | None]] = deque(maxlen=100)

    # --- what the proxy calls ---------------------------------------------------------------
    def fits(self, entry: ModelEntry) -> bool:
        if entry.gpu_share_group is None:
            return True
        return plan_switch(self.members(entry), entry.llmservice).outcome == "ready"

    def ensure_waking(self, entry: ModelEntry) -> asyncio.Task[bool] | None:
        if entry.gpu_share_group is None:
            return self.waker.ensure_waking(entry)
        key = (entry.namespace, entry.llmservice)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return task
        if not entry.wakeable() and not entry.routable():
            return None  # nothing running to wake: the hold waits for a Pod
        task = asyncio.create_task(self._switch(entry), name=f"gpu-share-{entry.namespace}/{entry.llmservice}")
        self._tasks[key] = task
        return task

    async def close(self) -> None:
        await cancel_and_wait(self._tasks.values())

    # --- the group's state ------------------------------------------------------------------
    def members(self, entry: ModelEntry) -> list[Member]:
        out = []
        state = self.registry.state
        for svc in state.services.values():
            if svc.namespace != entry.namespace or svc.gpu_share_group != entry.gpu_share_group:
                continue
            replicas = [r for r in state.replicas_of(svc.namespace, svc.name, svc.uid) if r.ready and not r.deleting]
            demand = self.demand.by_service.get(svc.key)
            busy = any(self.loads.outstanding.get(r.key, 0) > 0 for r in replicas) or (
                demand is not None and demand.held > 0)
            out.append(Member(name=svc.name, share=svc.gpu_share, awake=any(r.awake for r in replicas),
                              last_used=max((self.loads.last_used.get(r.key, 0.0) for r in replicas), default=0.0),
                              busy=busy))
        return out

    # --- switching --------------------------------------------------------------------------
    async def _switch(self, entry: ModelEntry) -> bool:
        lock = self._locks.setdefault((entry.namespace, str(entry.gpu_share_group)), asyncio.Lock())
        asked = time.monotonic()
        async with lock:
            try:
                while True:
                    current = self.registry.lookup(entry.model_name) or entry
                    preempt = time.monotonic() - asked >= self.preempt_after_s
                    plan = plan_switch(self.members(current), current.llmservice, preempt_busy=preempt)
                    if plan.outcome == "impossible":
                        log.warning("%s/%s does not fit its GPU-share group even alone", entry.namespace,
                                    entry.llmservice)
                        return False
                    if plan.outcome == "wait":  # only busy members could make room: let them finish
                        await asyncio.sleep(self.poll_interval_s)
                        continue
                    for victim in plan.sleep:
                        await self._sleep_member(current.namespace, victim)
                    woken = plan.wake is None or await self.waker.wake(current)
                    self.switches.append((plan.sleep, plan.wake))
                    return woken
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("GPU-share switch to %s/%s failed: %r", entry.namespace, entry.llmservice, exc)
                await asyncio.sleep(self.retry_backoff_s)  # the held requests ask again after this
                return False

    async def _sleep_member(self, namespace: str, name: str) -> None:
        entry = next(e for e in self.registry.state.entries() if (e.namespace, e.llmservice) == (namespace, name))
        key = self.registry.engine_api_key(entry)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        for replica in entry.replicas:
            if not (replica.ready and replica.awake and not replica.deleting and replica.url):
                continue
            self.registry.observe_sleep_state(replica, L.SLEEP_LEVEL_1)  # no new requests go there
            log.info("GPU share: putting %s/%s to sleep", namespace, replica.pod_name)
            try:
                response = await self.http.post(f"{replica.url}/sleep", params={"level": 1, "mode": "wait"},
                                                headers=headers, timeout=self.sleep_timeout_s)
                response.raise_for_status()
            except Exception:
                self.registry.observe_sleep_state(replica, L.SLEEP_AWAKE)  # still awake: route to it again
                raise
            try:
                await self.waker.lease.confirm_asleep(replica)
            except Exception as exc:  # the label is a courtesy; this router already knows
                log.warning("could not label %s/%s asleep: %r", namespace, replica.pod_name, exc)
