"""Wake on demand, and the bookkeeping of held requests (the demand the autoscaler reads).

Deduplication of wake_up:
- within one router process: one wake task per LLMService at a time, shared by every
  request held for it;
- across router replicas: an optional annotation lease on the Pod (`KubernetesWakeLease`).
  The first router to write `tidal.dev/wake-requested-at` with a matching resourceVersion
  (optimistic concurrency: the API server answers 409 to the others) sends the wake_up; the
  others only poll `/is_sleeping`. The engine's wake_up is idempotent (waking an awake
  engine is a no-op), so a duplicate after a lost lease or an expired one costs a request,
  never correctness; the lease only keeps the count at one in the common case.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Iterable
from typing import Any, Protocol

import httpx

from tidal_operator import labels as L
from tidal_operator.router.metrics import RouterMetrics
from tidal_operator.router.registry import Key, ModelEntry, Registry, Replica

log = logging.getLogger("tidal.router.waker")

WAKE_REQUESTED_AT = "tidal.dev/wake-requested-at"
WAKE_REQUESTED_BY = "tidal.dev/wake-requested-by"


# --- the cross-router lease ---------------------------------------------------------------

class WakeLease(Protocol):
    async def acquire(self, replica: Replica) -> bool:
        """True: this router should send the wake_up. False: another one is doing it."""

    async def confirm_awake(self, replica: Replica) -> None:
        """The engine answered is_sleeping=false."""

    async def confirm_asleep(self, replica: Replica) -> None:
        """This router put the engine to sleep (a GPU-share switch)."""


class LocalWakeLease:
    """A single router (or tolerate duplicates across routers): always send the wake_up."""

    async def acquire(self, replica: Replica) -> bool:
        return True

    async def confirm_awake(self, replica: Replica) -> None:
        return None

    async def confirm_asleep(self, replica: Replica) -> None:
        return None


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class KubernetesWakeLease:
    """An annotation lease on the Pod, taken with a resourceVersion precondition.

    Needs `get` and `patch` on pods. After the wake it also sets the Pod's
    `tidal.dev/sleep-state` label back to `awake`, so the operator and other routers see it.
    """

    def __init__(self, api_client: Any, *, lease_s: float = 60.0, holder: str | None = None) -> None:
        from kubernetes_asyncio import client as k8s

        self._core = k8s.CoreV1Api(api_client)
        self.lease_s = lease_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"

    async def acquire(self, replica: Replica) -> bool:
        from kubernetes_asyncio.client.exceptions import ApiException

        pod = await self._core.read_namespaced_pod(replica.pod_name, replica.namespace)
        annotations = pod.metadata.annotations or {}
        taken_at = _parse_time(annotations.get(WAKE_REQUESTED_AT))
        now = datetime.now(timezone.utc)
        if taken_at is not None and (now - taken_at).total_seconds() < self.lease_s \
                and annotations.get(WAKE_REQUESTED_BY) != self.holder:
            return False
        patch = {"metadata": {"resourceVersion": pod.metadata.resource_version, "annotations": {
            WAKE_REQUESTED_AT: now.isoformat().replace("+00:00", "Z"), WAKE_REQUESTED_BY: self.holder}}}
        try:
            await self._core.patch_namespaced_pod(replica.pod_name, replica.namespace, patch,
                                                  _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status == 409:  # another router wrote first
                return False
            raise
        return True

    async def confirm_awake(self, replica: Replica) -> None:
        patch = {"metadata": {"labels": {L.SLEEP_STATE: L.SLEEP_AWAKE},
                              "annotations": {WAKE_REQUESTED_AT: None, WAKE_REQUESTED_BY: None}}}
        await self._core.patch_namespaced_pod(replica.pod_name, replica.namespace, patch,
                                              _content_type="application/merge-patch+json")

    async def confirm_asleep(self, replica: Replica) -> None:
        patch = {"metadata": {"labels": {L.SLEEP_STATE: L.SLEEP_LEVEL_1}}}
        await self._core.patch_namespaced_pod(replica.pod_name, replica.namespace, patch,
                                              _content_type="application/merge-patch+json")


# --- waking ---------------------------------------------------------------------------------

def choose_replica_to_wake(candidates: tuple[Replica, ...]) -> Replica | None:
    """Level 1 sleepers first (weights are in host memory: the fastest wake), then by name."""
    order = {L.SLEEP_LEVEL_1: 0, L.SLEEP_LEVEL_2: 1}
    ranked = sorted(candidates, key=lambda r: (order.get(r.sleep_state, 2), r.pod_name))
    return ranked[0] if ranked else None


class Waker:
    """At most one wake task per LLMService in this process; every held request shares it."""

    def __init__(self, registry: Registry, http: httpx.AsyncClient, metrics: RouterMetrics, *,
                 lease: WakeLease | None = None, wake_timeout_s: float = 120.0, poll_interval_s: float = 0.2,
                 retry_backoff_s: float = 1.0) -> None:
        self.registry = registry
        self.http = http
        self.metrics = metrics
        self.lease: WakeLease = lease or LocalWakeLease()
        self.wake_timeout_s = wake_timeout_s
        self.poll_interval_s = poll_interval_s
        self.retry_backoff_s = retry_backoff_s
        self._tasks: dict[Key, asyncio.Task[bool]] = {}
        self.wake_calls = 0  # wake_up requests sent by this process (for tests and /debug)

    def ensure_waking(self, entry: ModelEntry) -> asyncio.Task[bool] | None:
        """Start waking one of the entry's sleeping replicas unless that is already under way.
        Returns the task (done = woken or given up), or None if nothing can be woken."""
        key = (entry.namespace, entry.llmservice)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return task
        if not entry.wakeable():
            return None
        task = asyncio.create_task(self._wake(entry), name=f"wake-{entry.namespace}/{entry.llmservice}")
        self._tasks[key] = task
        return task

    def fits(self, entry: ModelEntry) -> bool:
        """Whether a routable replica may be used now (GroupSwitcher says no for an over-full group)."""
        return True

    async def wake(self, entry: ModelEntry) -> bool:
        """Wake one sleeping replica of `entry` now (a GroupSwitcher's step); True once awake."""
        return await self._wake(entry)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks.values())

    async def _wake(self, entry: ModelEntry) -> bool:
        deadline = time.monotonic() + self.wake_timeout_s
        while time.monotonic() < deadline:
            current = self.registry.lookup(entry.model_name) or entry
            if current.routable():
                return True  # woken by someone else, or a new replica became Ready
            replica = choose_replica_to_wake(current.wakeable())
            if replica is None:
                return False
            try:
                if await self._wake_one(current, replica, deadline):
                    return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("waking %s/%s failed: %r", replica.namespace, replica.pod_name, exc)
                self.metrics.wakeups.labels(entry.namespace, entry.llmservice, "failed").inc()
            await asyncio.sleep(min(self.retry_backoff_s, max(0.0, deadline - time.monotonic())))
        return False

    async def _wake_one(self, entry: ModelEntry, replica: Replica, deadline: float) -> bool:
        headers = self._headers(entry)
        if await self.lease.acquire(replica):
            self.wake_calls += 1
            self.metrics.wakeups.labels(entry.namespace, entry.llmservice, "sent").inc()
            log.info("waking %s/%s for model %s", replica.namespace, replica.pod_name, entry.model_name)
            response = await self.http.post(f"{replica.url}/wake_up", headers=headers,
                                            timeout=max(1.0, deadline - time.monotonic()))
            response.raise_for_status()
        else:
            self.metrics.wakeups.labels(entry.namespace, entry.llmservice, "lease_held_elsewhere").inc()
        # Poll even after our own wake_up answered: a router that lost the lease must, and an
        # engine may answer wake_up before it is ready to serve.
        while time.monotonic() < deadline:
            response = await self.http.get(f"{replica.url}/is_sleeping", headers=headers,
                                           timeout=max(1.0, deadline - time.monotonic()))
            response.raise_for_status()
            if not response.json().get("is_sleeping", True):
                self.registry.observe_sleep_state(replica, L.SLEEP_AWAKE)
                self.metrics.wakeups.labels(entry.namespace, entry.llmservice, "awake").inc()
                try:
                    await self.lease.confirm_awake(replica)
                except Exception as exc:  # the label is a courtesy; routing already knows
                    log.warning("could not mark %s/%s awake: %r", replica.namespace, replica.pod_name, exc)
                return True
            await asyncio.sleep(self.poll_interval_s)
        return False

    def _headers(self, entry: ModelEntry) -> dict[str, str]:
        key = self.registry.engine_api_key(entry)
        return {"authorization": f"Bearer {key}"} if key else {}


# --- held requests and demand ----------------------------------------------------------------

@dataclass
class Demand:
    namespace: str
    llmservice: str
    held: int = 0
    total_held: int = 0
    held_since: float | None = None  # wall clock of the oldest request still held
    last_request_at: float | None = None
    models: set[str] = field(default_factory=set)

    def as_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "llmservice": self.llmservice, "held": self.held,
                "totalHeld": self.total_held, "models": sorted(self.models),
                "heldSince": _iso(self.held_since), "lastRequestAt": _iso(self.last_request_at)}


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class QueueFull(Exception):
    pass


class DemandBook:
    """Counts held requests per LLMService and bounds them (the per-model queue)."""

    def __init__(self, metrics: RouterMetrics, max_held: int) -> None:
        self.metrics = metrics
        self.max_held = max_held
        self.by_service: dict[Key, Demand] = {}
        self.changed = asyncio.Event()  # set on every hold and release (the demand Lease is rewritten)

    def hold(self, entry: ModelEntry) -> None:
        """Count one more held request, or raise QueueFull."""
        key = (entry.namespace, entry.llmservice)
        demand = self.by_service.setdefault(key, Demand(entry.namespace, entry.llmservice))
        if demand.held >= self.max_held:
            raise QueueFull(f"{demand.held} requests already held for {entry.model_name}")
        now = time.time()
        demand.held += 1
        demand.total_held += 1
        demand.models.add(entry.model_name)
        demand.last_request_at = now
        if demand.held_since is None:
            demand.held_since = now
        self.metrics.held.labels(entry.model_name, entry.namespace, entry.llmservice).inc()
        self.changed.set()

    def release(self, entry: ModelEntry) -> None:
        demand = self.by_service[(entry.namespace, entry.llmservice)]
        demand.held -= 1
        if demand.held == 0:
            demand.held_since = None
        self.metrics.held.labels(entry.model_name, entry.namespace, entry.llmservice).dec()
        self.changed.set()

    def snapshot(self) -> list[dict[str, Any]]:
        return [d.as_json() for _, d in sorted(self.by_service.items())]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancels every task and waits until each has ended, whatever it ended with."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except BaseException:
            pass
