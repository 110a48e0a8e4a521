"""What every Tidal engine server has, generative or pooling: the lifespan, error handlers,
API-key and CORS middleware, the probes, /version, /metrics and /v1/models."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from tidal_engine import __version__
from tidal_engine.server.auth import APIKeyMiddleware
from tidal_engine.server.errors import ENGINE_UNAVAILABLE, error_response, install_error_handlers


class ServedEngine(Protocol):
    @property
    def is_healthy(self) -> bool: ...

    def start(self) -> None: ...

    async def shutdown(self, timeout_s: float) -> None: ...


def create_base_app(title: str, engine: ServedEngine, settings: Any, *, stopped_message: str,
                    render_metrics: Callable[[], bytes], metrics_content_type: str,
                    list_models: Callable[[], dict[str, Any]]) -> FastAPI:
    """An app with the shared routes; the caller adds its endpoints. `settings` is a ServerSettings."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(settings.shutdown_timeout_s)

    app = FastAPI(title=title, version=__version__, lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)

    # Middleware added last runs first: CORS must see preflights before auth refuses them.
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, protect_metrics=settings.protect_metrics)
    if settings.allowed_origins:  # none allowed (the default): no middleware in every stream's send path
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, stopped_message, ENGINE_UNAVAILABLE)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(render_metrics(), media_type=metrics_content_type)

    @app.get("/v1/models")
    async def list_models_route() -> JSONResponse:
        return JSONResponse(list_models())

    return app
