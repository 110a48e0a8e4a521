"""An async client for one engine's HTTP API: health, sleep/wake, LoRA and the /metrics scrape.

The operator acts on engines only through this client (the router has its own hot path).
Every call carries the engine's API key as a Bearer token and a timeout; the key never
appears in logs, reprs or exception messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("tidal.engine_client")

PREFIX = "tidal:"
# An engine started with `--metrics-prefix vllm` writes the same families under vLLM's names;
# the parser reads either, so autoscaling, idle and the router's load work with both.
ENGINE_PREFIXES = ("tidal:", "vllm:")
RUNNING = PREFIX + "num_requests_running"
WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
SLEEP_STATE = PREFIX + "engine_sleep_state"
# Token counters: when they move between two scrapes, the engine did work in between, even if
# both gauge samples happened to read 0 (short requests finish between scrapes).
ACTIVITY_COUNTERS = (PREFIX + "prompt_tokens_total", PREFIX + "generation_tokens_total")
# The engine's sleep_state label values, by level.
SLEEP_LEVELS = {"awake": 0, "weights_offloaded": 1, "discard_all": 2}

SleepMode = Literal["wait", "abort"]


class EngineError(Exception):
    """The engine answered with an error, or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EngineMetrics:
    """The few series the autoscaler and idle policy read from one scrape.

    A field is None when the exposition lacks the series (an older engine), so callers can
    tell "absent" from 0.
    """

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # a fraction, 0 to 1
    sleep_level: int | None = None  # 0 awake, 1, 2
    activity: float | None = None  # prompt + generation tokens so far (monotonic)

    @property
    def in_flight(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)

    @classmethod
    def parse(cls, text: str) -> "EngineMetrics":
        """Parse Prometheus text exposition. Values of several label sets (say, one per
        model_name) are summed; raises ValueError on text that isn't an exposition."""
        sums: dict[str, float] = {}
        sleep_level: int | None = None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = _tidal_name(sample.name)
                if name == SLEEP_STATE:
                    if sample.value >= 1 and sample.labels.get("sleep_state") in SLEEP_LEVELS:
                        sleep_level = max(sleep_level or 0, SLEEP_LEVELS[sample.labels["sleep_state"]])
                    continue
                if name in (RUNNING, WAITING, KV_CACHE_USAGE, *ACTIVITY_COUNTERS):
                    sums[name] = sums.get(name, 0.0) + float(sample.value)
        activity = None
        if any(c in sums for c in ACTIVITY_COUNTERS):
            activity = sum(sums.get(c, 0.0) for c in ACTIVITY_COUNTERS)
        return cls(running=sums.get(RUNNING), waiting=sums.get(WAITING), kv_cache_usage=sums.get(KV_CACHE_USAGE),
                   sleep_level=sleep_level, activity=activity)


def _tidal_name(name: str) -> str:
    """A series name under the `tidal:` prefix, whichever engine prefix it was written with."""
    for prefix in ENGINE_PREFIXES:
        if name.startswith(prefix):
            return PREFIX + name[len(prefix):]
    return name


class EngineClient:
    """One engine at `base_url` (http://ip:port, without /v1).

    Pass a shared `http` client to pool connections across engines; the client is then not
    closed by `aclose()`.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 5.0,
                 http: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key  # private: never logged, never in repr
        self.timeout_s = timeout_s
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s)

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r}, api_key={'***' if self._api_key else None})"

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    async def _request(self, method: str, path: str, *, timeout_s: float | None = None,
                       params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
                       json: Any = None) -> httpx.Response:
        url = self.base_url + path
        try:
            response = await self._http.request(method, url, headers=self._headers(), params=params, json=json,
                                                timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except httpx.TimeoutException:
            raise EngineError(f"{method} {url}: timed out") from None
        except httpx.HTTPError as exc:
            # The exception text names the URL only, never the headers.
            raise EngineError(f"{method} {url}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise EngineError(f"{method} {url}: HTTP {response.status_code}: {_error_message(response)}",
                              response.status_code)
        return response

    async def health(self) -> bool:
        """True when /health answers 200; False on any error (it is a probe)."""
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def is_sleeping(self) -> bool:
        response = await self._request("GET", "/is_sleeping")
        return bool(response.json().get("is_sleeping"))

    async def sleep(self, level: int = 1, mode: SleepMode = "wait", *, timeout_s: float | None = None) -> None:
        """Put the engine to sleep. mode=wait drains the requests in flight first, so give a
        timeout long enough for them (the default is the client's)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        await self._request("POST", "/sleep", params={"level": level, "mode": mode}, timeout_s=timeout_s)

    async def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> None:
        """Wake the engine (idempotent: waking an awake engine changes nothing)."""
        params = [("tags", t) for t in tags or ()]
        await self._request("POST", "/wake_up", params=params or None, timeout_s=timeout_s)

    async def load_lora(self, name: str, path: str, *, timeout_s: float | None = None) -> None:
        """vLLM's dynamic LoRA route."""
        await self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                            timeout_s=timeout_s)

    async def unload_lora(self, name: str, *, timeout_s: float | None = None) -> None:
        await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, timeout_s=timeout_s)

    async def metrics_text(self, *, timeout_s: float | None = None) -> str:
        return (await self._request("GET", "/metrics", timeout_s=timeout_s)).text

    async def metrics(self, *, timeout_s: float | None = None) -> EngineMetrics:
        """Scrape and parse /metrics. Raises EngineError on failure or unparsable text."""
        text = await self.metrics_text(timeout_s=timeout_s)
        try:
            return EngineMetrics.parse(text)
        except ValueError as exc:
            raise EngineError(f"GET {self.base_url}/metrics: not a Prometheus exposition: {exc}") from None


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:200]
        if body.get("detail"):
            return str(body["detail"])[:200]
    return response.text[:200]
