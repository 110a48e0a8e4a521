"""TEST UPSTREAMS for the router tests: tiny engine-like HTTP servers, not the real engine.

Each `FakeEngine` is a real FastAPI app served by a real uvicorn on 127.0.0.1 (a port of its
own), speaking just enough of the engine's API for the router: the OpenAI endpoints
(answers name the replica), /is_sleeping, /wake_up, /health. Tests control timing with
asyncio.Events (gates), never sleeps, and read what each replica saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tidal_operator import labels as L


@dataclass
class FakeEngine:
    """One engine-like replica. Set the gates (asyncio.Event) to pause it at known points."""

    name: str
    api_key: str | None = None
    sleeping: bool = False
    answer_gate: asyncio.Event | None = None  # non-stream answers wait for it
    stream_gate: asyncio.Event | None = None  # streams wait for it after the first chunk
    wake_gate: asyncio.Event | None = None  # /wake_up waits for it before waking
    fail_midstream: bool = False  # abort the connection after the first chunk
    draining: bool = False  # refuse every request with a plain 503 before doing anything
    requests: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    wake_calls: int = 0
    sleep_calls: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    stream_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    first_chunk_sent: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set on every request; tests clear it
    load: tuple[float, float, float] | None = None  # (running, waiting, KV usage) on /metrics; None: 404
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        def unauthorized(request: Request) -> JSONResponse | None:
            self.auth_headers.append(request.headers.get("authorization"))
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Invalid API key", "type": "authentication_error",
                                               "param": None, "code": 401}}, status_code=401)
            return None

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(request: Request) -> Any:
            from fastapi.responses import PlainTextResponse

            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({}, status_code=401)  # not recorded in auth_headers: only the API calls are
            if self.load is None:
                return JSONResponse({}, status_code=404)
            running, waiting, kv = self.load
            return PlainTextResponse(f"tidal:num_requests_running {running}\ntidal:num_requests_waiting {waiting}\n"
                                     f"tidal:kv_cache_usage_perc {kv}\n")

        @app.get("/is_sleeping")
        async def is_sleeping(request: Request) -> Any:
            return unauthorized(request) or {"is_sleeping": self.sleeping}

        @app.post("/sleep")
        async def sleep(request: Request) -> Any:
            denied = unauthorized(request)
            if denied:
                return denied
            self.sleep_calls += 1
            self.sleeping = True
            return {"is_sleeping": True}

        @app.post("/wake_up")
        async def wake_up(request: Request) -> Any:
            denied = unauthorized(request)
            if denied:
                return denied
            self.wake_calls += 1
            if self.wake_gate is not None:
                await self.wake_gate.wait()
            self.sleeping = False
            return {"is_sleeping": False}

        async def completion(request: Request, kind: str) -> Any:
            denied = unauthorized(request)
            if denied:
                return denied
            body = await request.json()
            self.requests.append(body)
            self.arrived.set()
            if self.sleeping:
                return JSONResponse({"error": {"message": "sleeping", "type": "engine_sleeping", "param": None,
                                               "code": 503}}, status_code=503, headers={"Retry-After": "5"})
            if self.draining:
                return JSONResponse({"error": {"message": "draining", "type": "service_unavailable", "param": None,
                                               "code": 503}}, status_code=503)
            if body.get("force_status"):  # a test asks for an engine-side 4xx
                status = int(body["force_status"])
                return JSONResponse({"error": {"message": f"forced {status}", "type": "invalid_request_error",
                                               "param": "force_status", "code": status}}, status_code=status)
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self.answer_gate is not None:
                    await self.answer_gate.wait()
            finally:
                self.in_flight -= 1
            return {"object": kind, "replica": self.name, "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": f"from {self.name}"}}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await completion(request, "chat.completion")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await completion(request, "text_completion")

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Any:
            return await completion(request, "list")

        for path in ("/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            async def pooling(request: Request, path: str = path) -> Any:
                return await completion(request, path)

            app.add_api_route(path, pooling, methods=["POST"])
        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        finished = False
        try:
            yield _chunk(self.name, "chunk-1")
            self.first_chunk_sent.set()
            if self.fail_midstream:
                raise RuntimeError("test upstream: dying mid-stream")
            if self.stream_gate is not None:
                await self.stream_gate.wait()
            yield _chunk(self.name, "chunk-2")
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished and not self.fail_midstream:
                self.stream_cancelled.set()


def _chunk(replica: str, text: str) -> bytes:
    payload = {"object": "chat.completion.chunk", "replica": replica,
               "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def listening_socket() -> socket.socket:
    """A bound, listening socket on a free port: clients can connect (the kernel queues them)
    before the server's loop accepts, so no waiting for startup is needed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


@dataclass
class CrashingEngine:
    """Reads a whole request, then drops the connection without answering: an engine that
    crashed on it. `received` counts the requests that reached it."""

    received: int = 0
    port: int = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.received += head.startswith(b"POST ")  # not the router's GET /metrics
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serve_crashing() -> AsyncIterator[CrashingEngine]:
    engine = CrashingEngine()
    server = await asyncio.start_server(engine._handle, sock=listening_socket())
    engine.port = server.sockets[0].getsockname()[1]
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


def closed_port() -> int:
    """A port nothing listens on: connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on this loop; yields the port."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@contextlib.asynccontextmanager
async def serve_engines(*engines: FakeEngine) -> AsyncIterator[tuple[FakeEngine, ...]]:
    async with contextlib.AsyncExitStack() as stack:
        for engine in engines:
            engine.port = await stack.enter_async_context(serve(engine.app()))
        yield engines


# --- Kubernetes objects pointing at them ---------------------------------------------------------

def llmservice(name: str, *, served_name: str | None = None, adapters: tuple[str, ...] = (),
               strategy: str = "leastLoad", secret: str | None = None, namespace: str = "default") -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m"}, "routing": {"strategy": strategy}}
    if served_name:
        spec["model"]["servedName"] = served_name
    if adapters:
        spec["lora"] = {"adapters": [{"name": a, "uri": f"hf://org/{a}"} for a in adapters]}
    if secret:
        spec["auth"] = {"apiKeySecretRef": {"name": secret, "key": "api-key"}}
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec}


def pod(name: str, llm: str, port: int, *, ready: bool = True, sleep_state: str = L.SLEEP_AWAKE,
        adapters: str | None = None, resource_version: str = "1", ip: str | None = "127.0.0.1",
        deleting: bool = False, namespace: str = "default") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "resourceVersion": resource_version,
                            "labels": {L.LLMSERVICE: llm, L.SLEEP_STATE: sleep_state}, "annotations": {}}
    if adapters is not None:
        meta["annotations"][L.ADAPTERS] = adapters
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running" if ready else "Pending",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": status}


# --- the router under test, served for real ----------------------------------------------------

CLIENT_KEY = "client-key"


@dataclass
class RouterUnderTest:
    client: Any  # httpx.AsyncClient with the client key
    app: Any  # the FastAPI app (its .state has registry, proxy, metrics, demand, waker)
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def held(self) -> int:
        return sum(d.held for d in self.app.state.demand.by_service.values())

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@contextlib.asynccontextmanager
async def run_router_for_test(registry: Any, **config: Any) -> AsyncIterator[RouterUnderTest]:
    import httpx

    from tidal_operator.router import RouterConfig, create_app

    app = create_app(registry, RouterConfig(api_keys=(CLIENT_KEY,), **config))
    async with serve(app) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30,
                                     headers={"authorization": f"Bearer {CLIENT_KEY}"}) as client:
            yield RouterUnderTest(client, app, port)


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    """Yield to the loop until `predicate()` holds (a synchronisation point, not a delay)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
