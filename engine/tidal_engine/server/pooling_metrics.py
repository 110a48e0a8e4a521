"""Prometheus metrics of a pooling server: the queue gauges autoscaling reads
(``tidal:num_requests_running`` / ``_waiting``, as the generation server names them) and
cumulative request, token and step-time counters, all read at scrape time from the latest
stats the engine core sent."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidal_engine.engine.messages import CoreStats
from tidal_engine.pooling.client import PoolingClient
from tidal_engine.server.metrics import CONTENT_TYPE, PREFIX, SLEEP_STATES


class _PoolingCollector(Collector):
    def __init__(self, engine: PoolingClient, model_name: str, prefix: str = PREFIX) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.snapshot.stats or CoreStats()
        sleep_level = self.engine.snapshot.sleep_level
        for name, doc, value in (
            ("num_requests_running", "Pooling requests in the step on the device.", stats.num_running),
            ("num_requests_waiting", "Pooling requests queued for a step.", stats.num_waiting),
        ):
            gauge = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(value))
            yield gauge
        sleep = GaugeMetricFamily(self.prefix + "engine_sleep_state", "1 for the engine's current sleep state, 0 for the others.",
                                  labels=["model_name", "sleep_state"])
        for level, state in SLEEP_STATES.items():
            sleep.add_metric([self.model_name, state], 1.0 if sleep_level == level else 0.0)
        yield sleep
        for name, doc, value in (
            ("pooling_requests", "Pooling inputs (texts or pairs) processed.", stats.pooling_requests_total),
            ("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens_total),
            ("pooling_step_seconds", "Seconds spent in pooling steps.", stats.pooling_step_seconds),
        ):
            counter = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(value))
            yield counter


class PoolingMetrics:
    content_type = CONTENT_TYPE

    def __init__(self, engine: PoolingClient, model_name: str, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_PoolingCollector(engine, model_name, prefix))

    def render(self) -> bytes:
        return generate_latest(self.registry)
