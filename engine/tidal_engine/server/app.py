"""The FastAPI application: routes, middleware, lifespan, and the uvicorn runner."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tidal_engine.engine.async_engine import EngineClient
from tidal_engine.engine.collector import freeze_heap, unfreeze_heap
from tidal_engine.server.admin import build_admin_router
from tidal_engine.server.base_app import create_base_app
from tidal_engine.server.errors import bad_request
from tidal_engine.server.metrics import CONTENT_TYPE, METRICS_PREFIXES, ServerMetrics
from tidal_engine.server.request_log import RequestLogger
from tidal_engine.server.responses import ResponsesServing
from tidal_engine.server.serving import OpenAIServing, ServingSettings, read_json_body

logger = logging.getLogger(__name__)

# The pooling server's endpoints (server/pooling.py): a generative model answers them with 400.
POOLING_PATHS = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model_name
    model_source: str = ""
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    protect_metrics: bool = True
    max_request_body_bytes: int = 8 * 1024 * 1024
    log_requests: bool = True
    log_prompts: bool = False
    shutdown_timeout_s: float = 30.0
    # Chat output (docs/engine-api.md): tool calls, reasoning, template, sampling defaults.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    generation_config: str = "vllm"  # auto | vllm | PATH: read into default_sampling when the server starts
    default_sampling: dict[str, Any] = field(default_factory=dict)
    metrics_prefix: str = "tidal"  # tidal | vllm (docs/metrics.md)


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """An app around `engine`. The lifespan starts the engine loop and drains it on shutdown."""
    names = settings.served_model_names or [engine.model_name]
    serving = OpenAIServing(
        engine,
        ServingSettings(names, settings.model_source or names[0], settings.max_request_body_bytes,
                        enable_auto_tool_choice=settings.enable_auto_tool_choice,
                        tool_call_parser=settings.tool_call_parser, reasoning_parser=settings.reasoning_parser,
                        chat_template=settings.chat_template, default_sampling=dict(settings.default_sampling)),
    )
    responses_serving = ResponsesServing(serving)
    metrics = ServerMetrics(engine, names[0], engine.max_model_len, METRICS_PREFIXES[settings.metrics_prefix])
    if settings.log_requests:
        engine.add_finished_listener(RequestLogger(log_prompts=settings.log_prompts))

    app = create_base_app("Tidal engine", engine, settings, stopped_message="The engine loop has stopped.",
                          render_metrics=metrics.render, metrics_content_type=CONTENT_TYPE,
                          list_models=lambda: serving.list_models().model_dump())
    app.state.serving = serving
    app.state.metrics = metrics
    limit = settings.max_request_body_bytes

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.create_completion(await read_json_body(request, limit), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.create_chat_completion(await read_json_body(request, limit), request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await responses_serving.create(await read_json_body(request, limit), request)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        # SageMaker's single entry point: the body's shape says which API it is.
        data = await read_json_body(request, limit)
        if "messages" in data:
            return await serving.create_chat_completion(data, request)
        if "prompt" in data:
            return await serving.create_completion(data, request)
        raise bad_request("An /invocations body needs `messages` (chat) or `prompt` (completions).")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse((await serving.tokenize(await read_json_body(request, limit))).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse((await serving.detokenize(await read_json_body(request, limit))).model_dump())

    async def not_pooling(_: Request) -> Response:
        raise bad_request(f"`{names[0]}` is a generative model; embeddings, scores and reranking need a pooling "
                          "model (tidal-engine serve MODEL --runner pooling).")

    for path in POOLING_PATHS:
        app.add_api_route(path, not_pooling, methods=["POST"])
    app.include_router(build_admin_router())
    return app


def curl_hint(host: str, port: int, model_name: str, with_key: bool) -> str:
    """The copy-paste line printed at start-up (never contains the key itself)."""
    shown_host = "localhost" if host in ("0.0.0.0", "::", "") else host
    auth = ' -H "Authorization: Bearer $TIDAL_API_KEY"' if with_key else ""
    body = f'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    return (
        f"curl -s http://{shown_host}:{port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'"
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn, minus re-raising SIGTERM after the graceful drain (which would make a clean
    shutdown look like a kill: exit status -15 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled in the main thread
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_server(engine: EngineClient, settings: ServerSettings, *, reuse_port: bool = False,
               app: FastAPI | None = None, hint: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM (then stop accepting, drain up to the timeout) or until the
    engine core dies. Returns the exit status: 0 after a drain, 1 after an engine death.
    ``reuse_port``: several API server processes share the port (SO_REUSEPORT).
    ``app``: another app around the engine (the pooling server's); default: build_app's.
    ``hint``: the copy-paste line logged at start-up; default: a chat request."""
    app = app or build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # the request log line replaces it (and never shows headers)
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_s)),
        lifespan="on",
    )
    server = _DrainingServer(config)
    names = settings.served_model_names or [engine.model_name]

    def stop_on_engine_death(error: BaseException) -> None:
        server.should_exit = True  # /health fails until the process is gone; Kubernetes restarts it

    if hasattr(engine, "on_dead"):
        engine.on_dead = stop_on_engine_death
    sockets = [_shared_socket(settings.host, settings.port)] if reuse_port else None
    logger.info("starting the server for %s on http://%s:%d", names[0], settings.host, settings.port)
    logger.info("try: %s", hint or curl_hint(settings.host, settings.port, names[0], bool(settings.api_key)))
    # The start-up heap (FastAPI, the tokenizer, transformers) is never garbage: frozen, a full
    # collection no longer walks it and stalls every stream (engine/collector.py).
    freeze_heap()
    try:
        # uvloop's event loop (and httptools' parser, which uvicorn picks when installed): the
        # API server streams every token of every request, so its per-chunk cost bounds it.
        uvloop.run(server.serve(sockets=sockets))
    finally:
        unfreeze_heap()
    if engine.dead_error is not None:
        logger.error("exiting because the engine core died: %s", engine.dead_error)
        return 1
    return 0


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other API server processes bind too; the kernel spreads
    connections among them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
