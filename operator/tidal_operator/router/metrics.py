"""The router's Prometheus metrics, on a registry of their own so each app (and test) is
independent and /metrics shows only the router's series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency spans sub-millisecond (errors, tiny upstreams) to minutes (long generations).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tidal_router_requests", "Requests answered, by model, endpoint and HTTP status.",
                                ["model", "endpoint", "status"], registry=r)
        self.latency = Histogram("tidal_router_request_duration_seconds",
                                 "Time from request to the last byte sent to the client (holding included).",
                                 ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("tidal_router_upstream_errors",
                                       "Failures talking to an engine, by kind (connect, reset, midstream, "
                                       "timeout, unavailable).", ["model", "kind"], registry=r)
        self.retries = Counter("tidal_router_retries", "Requests re-sent to another replica.", ["model"], registry=r)
        self.held = Gauge("tidal_router_held_requests",
                          "Requests held now, waiting for a replica to wake or appear (the queue depth). "
                          "The autoscaler reads this as demand.", ["model", "namespace", "llmservice"], registry=r)
        self.rejected = Counter("tidal_router_rejected_requests",
                                "Held requests refused with 503, by reason (queue_full, timeout).",
                                ["model", "reason"], registry=r)
        self.wakeups = Counter("tidal_router_wakeups",
                               "wake_up attempts, by result (sent, lease_held_elsewhere, awake, failed).",
                               ["namespace", "llmservice", "result"], registry=r)
        self.replica_requests = Counter("tidal_router_replica_requests",
                                        "Requests sent to each replica (retries included).",
                                        ["model", "namespace", "pod"], registry=r)
        self.outstanding = Gauge("tidal_router_outstanding_requests", "Requests in flight to each replica.",
                                 ["namespace", "pod"], registry=r)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
