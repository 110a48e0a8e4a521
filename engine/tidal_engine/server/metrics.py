"""Prometheus metrics: vLLM's names with the `tidal:` prefix, or with vLLM's own `vllm:` prefix
(--metrics-prefix vllm) so vLLM dashboards, KEDA triggers and the Gateway API Inference
Extension read them unchanged (docs/metrics.md maps them). Tidal-only families keep `tidal:`.

Gauges and counters are read from the engine's own cumulative stats at scrape time (a
custom collector), so they can never drift from the engine. Per-request histograms and
`request_success` are observed when a request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidal_engine.engine.async_engine import EngineClient, FinishedRequest

PREFIX = "tidal:"
METRICS_PREFIXES = {"tidal": "tidal:", "vllm": "vllm:"}  # --metrics-prefix
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges follow vLLM's, so ported dashboards keep their resolution.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's scheme)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


SLEEP_STATES = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's latest stats snapshot."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str = PREFIX) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        snapshot = self.engine.snapshot
        stats = snapshot.stats
        labels = [self.model_name]

        def value(name: str) -> float:
            return float(getattr(stats, name, 0) or 0)

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            family.add_metric(labels, v)
            return family

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            family = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            family.add_metric(labels, v)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", value("num_running"))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", value("num_waiting"))
        peak = GaugeMetricFamily(PREFIX + "num_requests_running_peak",  # Tidal only: always tidal:
                                 "Tidal only: the most requests ever seen running in one step since start.",
                                 labels=["model_name"])
        peak.add_metric(labels, float(snapshot.peak_running))
        yield peak
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", value("kv_cache_usage"))
        sleep = GaugeMetricFamily(
            self.prefix + "engine_sleep_state",
            "1 for the engine's current sleep state, 0 for the others.",
            labels=["model_name", "sleep_state"],
        )
        for level, state in SLEEP_STATES.items():
            sleep.add_metric([self.model_name, state], 1.0 if snapshot.sleep_level == level else 0.0)
        yield sleep
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      value("prefix_cache_queries"))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", value("prefix_cache_hits"))
        if getattr(stats, "kv_offload_enabled", False):
            yield from self._offload_families(stats, labels)
        yield counter("prompt_tokens", "Prefill tokens processed.", value("prompt_tokens_total"))
        computed = CounterMetricFamily(PREFIX + "prompt_tokens_computed",
                                       "Tidal only: prompt tokens computed, not served from any cache tier.",
                                       labels=["model_name"])
        computed.add_metric(labels, value("prompt_tokens_computed"))
        yield computed
        yield counter("generation_tokens", "Tokens generated.", value("generation_tokens_total"))
        yield counter("num_preemptions", "Requests preempted (their KV recomputed later).",
                      value("num_preemptions"))
        per_pos = list(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", None) or [])
        if per_pos:  # the engine speculates: vLLM's spec-decode counters
            yield counter("spec_decode_num_drafts", "Rows that verified drafts.", value("spec_decode_num_drafts"))
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                          value("spec_decode_num_draft_tokens"))
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          value("spec_decode_num_accepted_tokens"))
            family = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft.",
                                         labels=["model_name", "position"])
            for pos, count in enumerate(per_pos):
                family.add_metric([self.model_name, str(pos)], float(count))
            yield family
        max_loras = int(getattr(stats, "max_loras", 0) or 0)
        if max_loras:
            # vLLM's lora_requests_info: the adapters in the labels, the update time as the value.
            lora = GaugeMetricFamily(
                self.prefix + "lora_requests_info",
                "Running and waiting LoRA adapters (comma-separated) and max_lora; the value is the time "
                "of the update.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            lora.add_metric(
                [",".join(getattr(stats, "running_lora_adapters", ())),
                 ",".join(getattr(stats, "waiting_lora_adapters", ())), str(max_loras)],
                snapshot.updated_at,
            )
            yield lora


    def _offload_families(self, stats: Any, labels: list[str]) -> Iterator[Metric]:
        """KV offload (docs/kv-offload.md): the host tier's prefix-cache counters under vLLM's
        connector names, and Tidal-only families for the tiers, the bytes and the copy time."""

        def value(name: str) -> float:
            return float(getattr(stats, name, 0) or 0)

        for name, doc, field in (
            ("external_prefix_cache_queries", "Prompt tokens looked up in the KV connector's tier (host "
             "memory): those the device prefix cache missed.", "external_prefix_cache_queries"),
            ("external_prefix_cache_hits", "Prompt tokens loaded from the KV connector's tier (host memory).",
             "external_prefix_cache_hits"),
        ):
            family = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            family.add_metric(labels, value(field))
            yield family
        by_tier = {"queries": ("prefix_cache_queries", "external_prefix_cache_queries"),
                   "hits": ("prefix_cache_hits", "external_prefix_cache_hits")}
        for kind, (device, host) in by_tier.items():
            family = CounterMetricFamily(PREFIX + f"prefix_cache_tier_{kind}",
                                         f"Tidal only: prefix-cache {kind} in tokens, by tier (device, host).",
                                         labels=["model_name", "tier"])
            family.add_metric([*labels, "device"], value(device))
            family.add_metric([*labels, "host"], value(host))
            yield family
        moved = CounterMetricFamily(PREFIX + "kv_offload_bytes", "Tidal only: KV bytes copied between the tiers.",
                                    labels=["model_name", "direction"])
        moved.add_metric([*labels, "host_to_device"], value("kv_offload_bytes_loaded"))
        moved.add_metric([*labels, "device_to_host"], value("kv_offload_bytes_saved"))
        yield moved
        took = CounterMetricFamily(PREFIX + "kv_offload_transfer_seconds",
                                   "Tidal only: time the KV copies between the tiers took (device time on GPU).",
                                   labels=["model_name", "direction"])
        took.add_metric([*labels, "host_to_device"], value("kv_offload_load_seconds"))
        took.add_metric([*labels, "device_to_host"], value("kv_offload_save_seconds"))
        yield took
        failed = CounterMetricFamily(PREFIX + "kv_offload_failed_loads",
                                     "Tidal only: host-to-device loads that failed (the tokens were recomputed).",
                                     labels=["model_name"])
        failed.add_metric(labels, value("kv_offload_failed_loads"))
        yield failed
        usage = GaugeMetricFamily(PREFIX + "kv_offload_usage_perc",
                                  "Tidal only: fraction of the host KV pool in use (0 to 1).", labels=["model_name"])
        usage.add_metric(labels, value("kv_offload_host_usage"))
        yield usage


class ServerMetrics:
    """The server's registry; `observe_finished` is called in the engine loop thread."""

    def __init__(self, engine: EngineClient, model_name: str, max_model_len: int, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(engine, model_name, prefix))
        token_buckets = _token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(prefix + name, doc, ["model_name"], registry=self.registry, buckets=buckets)

        self.request_success = Counter(
            prefix + "request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        # Label children resolved once: the hot path only calls observe()/inc().
        name = model_name
        self._ttft = self.ttft.labels(name)
        self._itl = self.itl.labels(name)
        self._e2e = self.e2e.labels(name)
        self._queue = self.queue.labels(name)
        self._prompt = self.prompt_tokens.labels(name)
        self._gen = self.generation_tokens.labels(name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(name, reason)  # present at 0 from the start
        engine.add_finished_listener(self.observe_finished)

    def observe_finished(self, record: FinishedRequest) -> None:
        for reason in record.finish_reasons:
            self.request_success.labels(self.model_name, reason).inc()
        if record.ttft_s is not None:
            self._ttft.observe(record.ttft_s)
        for gap in record.inter_token_latencies_s:
            self._itl.observe(gap)
        self._e2e.observe(record.e2e_s)
        if record.queue_time_s is not None:
            self._queue.observe(record.queue_time_s)
        self._prompt.observe(record.prompt_tokens)
        self._gen.observe(record.generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metric_value(text: str, name: str, **labels: Any) -> float | None:
    """Read one sample from exposition text (tests and tools use this)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
                return float(sample.value)
    return None
