"""EngineClient and Scraper against real local HTTP servers.

`ScalingTestEngine` is a TEST UPSTREAM, not the real engine: a small FastAPI app served by a
real uvicorn, speaking the engine's admin routes (/sleep, /wake_up, /is_sleeping, LoRA) and
a /metrics exposition whose numbers the test sets. The controller tests import it too.
One test checks the parser against the real engine's metrics collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tidal_operator.engine_client import EngineClient, EngineError, EngineMetrics
from tidal_operator.scaling.scraper import Scraper, ScrapeTarget

KEY = "engine-secret-key"
LEVEL_NAMES = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}


@dataclass
class ScalingTestEngine:
    """TEST UPSTREAM: an engine-like server whose load the test dials in."""

    name: str = "engine"
    api_key: str | None = KEY
    running: float = 0
    waiting: float = 0
    kv: float = 0.0
    tokens: float = 0  # prompt + generation counters
    sleep_level: int = 0
    sleep_enabled: bool = True
    metrics_status: int = 200
    metrics_delay_s: float = 0.0
    metrics_prefix: str = "tidal:"  # "vllm:": an engine started with --metrics-prefix vllm
    sleep_gate: asyncio.Event | None = None  # /sleep waits for it (a drain in progress)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    auth_seen: list[str | None] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def exposition(self) -> str:
        m = f'model_name="{self.name}"'
        lines = [
            "# HELP tidal:num_requests_running Requests in the running batch.",
            "# TYPE tidal:num_requests_running gauge", f"tidal:num_requests_running{{{m}}} {self.running}",
            "# HELP tidal:num_requests_waiting Requests waiting to be scheduled.",
            "# TYPE tidal:num_requests_waiting gauge", f"tidal:num_requests_waiting{{{m}}} {self.waiting}",
            "# HELP tidal:kv_cache_usage_perc Fraction of KV-cache blocks in use (0 to 1).",
            "# TYPE tidal:kv_cache_usage_perc gauge", f"tidal:kv_cache_usage_perc{{{m}}} {self.kv}",
            "# HELP tidal:engine_sleep_state 1 for the engine's current sleep state.",
            "# TYPE tidal:engine_sleep_state gauge",
            *(f'tidal:engine_sleep_state{{{m},sleep_state="{s}"}} {1.0 if lvl == self.sleep_level else 0.0}'
              for lvl, s in LEVEL_NAMES.items()),
            "# HELP tidal:prompt_tokens Prefill tokens processed.", "# TYPE tidal:prompt_tokens counter",
            f"tidal:prompt_tokens_total{{{m}}} {self.tokens}",
            "# HELP tidal:generation_tokens Tokens generated.", "# TYPE tidal:generation_tokens counter",
            f"tidal:generation_tokens_total{{{m}}} 0.0",
        ]
        return "\n".join(line.replace("tidal:", self.metrics_prefix) for line in lines) + "\n"

    def app(self) -> FastAPI:
        app = FastAPI()

        def denied(request: Request) -> JSONResponse | None:
            header = request.headers.get("authorization")
            self.auth_seen.append(header)
            if self.api_key and header != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Invalid API key", "type": "authentication_error"}},
                                    status_code=401)
            return None

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(request: Request) -> Any:
            if (d := denied(request)) is not None:
                return d
            if self.metrics_delay_s:
                await asyncio.sleep(self.metrics_delay_s)  # a hung engine, on purpose
            if self.metrics_status != 200:
                return PlainTextResponse("boom", status_code=self.metrics_status)
            return PlainTextResponse(self.exposition())

        @app.get("/is_sleeping")
        async def is_sleeping(request: Request) -> Any:
            return denied(request) or {"is_sleeping": self.sleep_level > 0}

        @app.post("/sleep")
        async def sleep(request: Request, level: int = 1, mode: str = "wait") -> Any:
            if (d := denied(request)) is not None:
                return d
            self.calls.append(("sleep", {"level": level, "mode": mode}))
            if not self.sleep_enabled:
                return JSONResponse({"error": {"message": "sleep mode is not enabled"}}, status_code=400)
            if self.sleep_gate is not None:
                await self.sleep_gate.wait()
            self.sleep_level = level
            return {"is_sleeping": True, "level": level}

        @app.post("/wake_up")
        async def wake_up(request: Request) -> Any:
            if (d := denied(request)) is not None:
                return d
            self.calls.append(("wake_up", {"tags": request.query_params.getlist("tags")}))
            self.sleep_level = 0
            return {"is_sleeping": False}

        @app.post("/v1/load_lora_adapter")
        async def load_lora(request: Request) -> Any:
            if (d := denied(request)) is not None:
                return d
            self.calls.append(("load_lora", await request.json()))
            return {"status": "ok"}

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(request: Request) -> Any:
            if (d := denied(request)) is not None:
                return d
            self.calls.append(("unload_lora", await request.json()))
            return {"status": "ok"}

        return app


def listening(host: str, port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    return sock


@contextlib.asynccontextmanager
async def serve_engine(engine: ScalingTestEngine, host: str = "127.0.0.1", port: int = 0
                       ) -> AsyncIterator[ScalingTestEngine]:
    """Serve a test engine on host:port (port 0: a free one) with a real uvicorn."""
    sock = listening(host, port)
    engine.host, engine.port = host, sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(engine.app(), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield engine
    finally:
        server.should_exit = True
        server.force_exit = True  # a test may leave a request hanging (the timeout case)
        await asyncio.wait_for(task, 10)
        sock.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the client --------------------------------------------------------------------------------

async def test_admin_routes_with_the_key() -> None:
    async with serve_engine(ScalingTestEngine()) as e, EngineClient(e.url, KEY) as client:
        assert await client.health()
        assert not await client.is_sleeping()
        await client.sleep(2, "wait")
        assert e.sleep_level == 2 and await client.is_sleeping()
        await client.wake_up(["weights"])
        assert not await client.is_sleeping()
        await client.load_lora("sql", "/adapters/sql")
        await client.unload_lora("sql")
        assert e.calls == [("sleep", {"level": 2, "mode": "wait"}), ("wake_up", {"tags": ["weights"]}),
                           ("load_lora", {"lora_name": "sql", "lora_path": "/adapters/sql"}),
                           ("unload_lora", {"lora_name": "sql"})]
        assert set(e.auth_seen) == {f"Bearer {KEY}"}


async def test_errors_carry_status_and_message_but_never_the_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    engine = ScalingTestEngine(sleep_enabled=False)
    async with serve_engine(engine) as e, EngineClient(e.url, KEY) as client:
        with pytest.raises(EngineError) as info:
            await client.sleep(1)
        assert info.value.status == 400 and "sleep mode is not enabled" in str(info.value)
        async with EngineClient(e.url, "wrong") as bad:
            with pytest.raises(EngineError) as denied:
                await bad.is_sleeping()
            assert denied.value.status == 401
        assert KEY not in repr(client) and "***" in repr(client)
    assert KEY not in caplog.text and KEY not in str(info.value)


async def test_unreachable_and_slow_engines_raise_engine_error() -> None:
    async with EngineClient(f"http://127.0.0.1:{closed_port()}", KEY, timeout_s=1) as client:
        with pytest.raises(EngineError):
            await client.is_sleeping()
        assert not await client.health()
    async with serve_engine(ScalingTestEngine(metrics_delay_s=5)) as e, EngineClient(e.url, KEY) as client:
        with pytest.raises(EngineError, match="timed out"):
            await client.metrics(timeout_s=0.2)


@pytest.mark.parametrize("prefix", ["tidal:", "vllm:"])
async def test_metrics_are_parsed(prefix: str) -> None:
    engine = ScalingTestEngine(running=3, waiting=2, kv=0.25, tokens=40, sleep_level=1, metrics_prefix=prefix)
    async with serve_engine(engine) as e, EngineClient(e.url, KEY) as client:
        m = await client.metrics()
    assert m == EngineMetrics(running=3, waiting=2, kv_cache_usage=0.25, sleep_level=1, activity=40)
    assert m.in_flight == 5


def test_parse_sums_label_sets_and_tolerates_missing_series() -> None:
    text = ('tidal:num_requests_waiting{model_name="a"} 1\n'
            'tidal:num_requests_waiting{model_name="b"} 2\n'
            'other_metric 7\n')
    m = EngineMetrics.parse(text)
    assert m.waiting == 3 and m.running is None and m.kv_cache_usage is None and m.sleep_level is None
    assert m.in_flight == 3
    assert EngineMetrics.parse("").in_flight is None


@pytest.mark.parametrize("prefix", ["tidal:", "vllm:"])
def test_parse_reads_the_real_engines_exposition(prefix: str) -> None:
    """The names the parser reads are the ones the engine's collector writes, under either
    `--metrics-prefix`."""
    pytest.importorskip("tidal_engine")
    from prometheus_client import CollectorRegistry, generate_latest

    from tidal_engine.server.metrics import _EngineStatsCollector

    stats = SimpleNamespace(num_running=4, num_waiting=6, kv_cache_usage=0.5, prompt_tokens_total=100,
                            generation_tokens_total=20, prefix_cache_queries=0, prefix_cache_hits=0,
                            num_preemptions=0)
    fake = SimpleNamespace(snapshot=SimpleNamespace(stats=stats, peak_running=4, sleep_level=2))
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(fake, "smollm2", prefix))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert f"{prefix}num_requests_running" in text
    m = EngineMetrics.parse(text)
    assert m == EngineMetrics(running=4, waiting=6, kv_cache_usage=0.5, sleep_level=2, activity=120)


# --- the scraper ------------------------------------------------------------------------------

async def test_scraper_reads_many_engines_and_failures_are_unknown() -> None:
    healthy = ScalingTestEngine("ok", running=2, waiting=1)
    hung = ScalingTestEngine("hung", metrics_delay_s=10)
    broken = ScalingTestEngine("broken", metrics_status=500)
    locked = ScalingTestEngine("locked", api_key="another-key")
    async with contextlib.AsyncExitStack() as stack:
        for e in (healthy, hung, broken, locked):
            await stack.enter_async_context(serve_engine(e))
        scraper = Scraper(timeout_s=0.5, concurrency=2)
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            got = await scraper.scrape([
                ScrapeTarget("ok", healthy.url, KEY), ScrapeTarget("hung", hung.url, KEY),
                ScrapeTarget("broken", broken.url, KEY), ScrapeTarget("locked", locked.url, KEY),
                ScrapeTarget("gone", f"http://127.0.0.1:{closed_port()}", KEY)])
            elapsed = loop.time() - started
        finally:
            await scraper.aclose()
    assert got["ok"] is not None and got["ok"].in_flight == 3
    assert {k: v for k, v in got.items() if k != "ok"} == {"hung": None, "broken": None, "locked": None,
                                                            "gone": None}
    assert elapsed < 3  # the hung one cost one timeout, not ten seconds


async def test_scraper_bounds_concurrency() -> None:
    engines = [ScalingTestEngine(f"e{i}", metrics_delay_s=0.2) for i in range(4)]
    in_flight = 0
    peak = 0

    async with contextlib.AsyncExitStack() as stack:
        for e in engines:
            await stack.enter_async_context(serve_engine(e))
        scraper = Scraper(timeout_s=5, concurrency=2)
        original = scraper._http.request

        async def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await original(*args, **kwargs)
            finally:
                in_flight -= 1

        scraper._http.request = counting  # type: ignore[method-assign]
        try:
            got = await scraper.scrape([ScrapeTarget(e.name, e.url, KEY) for e in engines])
        finally:
            await scraper.aclose()
    assert all(v is not None for v in got.values()) and len(got) == 4
    assert peak == 2


def test_scrape_target_repr_hides_the_key() -> None:
    assert KEY not in repr(ScrapeTarget("p", "http://x", KEY))
