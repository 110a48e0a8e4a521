"""Publishing this router's held demand in a Lease, so the autoscaler sees every router replica.

Requests held for a model at zero replicas are the autoscaler's only signal to create a Pod.
Asking one router URL (a Service) reaches one replica per tick and misses what the others
hold; instead each replica keeps its own Lease (`tidal-router-demand-<id>`, labelled
`tidal.dev/router-demand`) in its namespace, rewritten within ~0.1 s of a change and renewed
every `renew_s`. The autoscaler lists them and sums the unexpired ones (a router that died
stops counting once `leaseDurationSeconds` pass).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import datetime, timezone
from typing import Any

from tidal_operator import labels as L
from tidal_operator.router.waker import DemandBook

log = logging.getLogger("tidal.router.demand")

LEASE_PREFIX = "tidal-router-demand-"


def lease_name(router_id: str) -> str:
    """A DNS-subdomain name for this router's Lease."""
    safe = re.sub(r"[^a-z0-9-]+", "-", router_id.lower()).strip("-") or "router"
    return (LEASE_PREFIX + safe)[:253]


def micro_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(name: str, router_id: str, held: list[dict[str, Any]], now: datetime,
               duration_s: int, owner_pod: tuple[str, str] | None = None) -> dict[str, Any]:
    """The Lease object (pure): identity, expiry, and the held demand in an annotation.
    `owner_pod` (name, uid): the router's own Pod, so the Lease is garbage-collected with it."""
    meta: dict[str, Any] = {"name": name, "labels": {L.ROUTER_DEMAND: "true"},
                            "annotations": {L.HELD_DEMAND: json.dumps(held, separators=(",", ":"))}}
    if owner_pod is not None:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner_pod[0], "uid": owner_pod[1]}]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": router_id, "leaseDurationSeconds": duration_s, "renewTime": micro_time(now)}}


def held_list(book: DemandBook) -> list[dict[str, Any]]:
    return [{"namespace": d.namespace, "llmservice": d.llmservice, "held": d.held}
            for _, d in sorted(book.by_service.items()) if d.held > 0]


class DemandLeasePublisher:
    """Keeps this router's Lease current while it runs; deletes it on a clean stop.
    RBAC: create, patch and delete on leases in `namespace` (nothing cluster-wide)."""

    def __init__(self, api_client: Any, namespace: str, router_id: str, book: DemandBook, *,
                 renew_s: float = 5.0, duration_s: int = 15, debounce_s: float = 0.1,
                 owner_pod: tuple[str, str] | None = None) -> None:
        from kubernetes_asyncio import client as k8s

        self._leases = k8s.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.router_id = router_id
        self.name = lease_name(router_id)
        self.book = book
        self.renew_s = renew_s
        self.duration_s = duration_s
        self.debounce_s = debounce_s
        self.owner_pod = owner_pod

    async def run(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is down: keep trying; held requests keep waiting
                log.warning("cannot publish held demand in Lease %s/%s: %r", self.namespace, self.name, exc)
            try:
                await asyncio.wait_for(self.book.changed.wait(), self.renew_s)
                await asyncio.sleep(self.debounce_s)  # one write for a burst of arrivals
            except asyncio.TimeoutError:
                pass

    async def publish(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        self.book.changed.clear()
        body = lease_body(self.name, self.router_id, held_list(self.book), datetime.now(timezone.utc),
                          self.duration_s, self.owner_pod)
        try:
            await self._leases.patch_namespaced_lease(self.name, self.namespace, body,
                                                      _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self._leases.create_namespaced_lease(self.namespace, body)

    async def withdraw(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self._leases.delete_namespaced_lease(self.name, self.namespace)
        except Exception as exc:  # it expires by itself anyway
            if not (isinstance(exc, ApiException) and exc.status == 404):
                log.warning("cannot delete Lease %s/%s: %r", self.namespace, self.name, exc)
