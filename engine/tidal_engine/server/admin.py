"""Admin endpoints: sleep, wake, prefix-cache reset. All behind the API key (unlike vLLM)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from tidal_engine.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineShuttingDownError
from tidal_engine.server.errors import ENGINE_UNAVAILABLE, APIError, bad_request

WAKE_TAGS = ("weights", "kv_cache")


def _engine(request: Request) -> AsyncLLMEngine:
    return request.app.state.engine


def build_admin_router() -> APIRouter:
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(
        request: Request,
        level: int = Query(1, description="1: weights to host memory, KV freed; 2: both freed"),
        mode: Literal["wait", "abort"] = Query("wait", description="drain in-flight requests, or abort them"),
    ) -> JSONResponse:
        if level not in (1, 2):
            raise bad_request(f"level must be 1 or 2, got {level}", "level")
        engine = _engine(request)
        try:
            await engine.sleep(level, mode)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise APIError(503, str(exc), ENGINE_UNAVAILABLE) from None
        return JSONResponse({"is_sleeping": await engine.is_sleeping(), "level": engine.snapshot.sleep_level})

    @router.post("/wake_up")
    async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> JSONResponse:
        if tags:
            unknown = [t for t in tags if t not in WAKE_TAGS]
            if unknown:
                raise bad_request(f"unknown wake_up tags {unknown}; use {list(WAKE_TAGS)}", "tags")
        engine = _engine(request)
        try:
            await engine.wake_up(tags or None)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise APIError(503, str(exc), ENGINE_UNAVAILABLE) from None
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": await _engine(request).is_sleeping()})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        try:
            reset = await _engine(request).reset_prefix_cache()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), ENGINE_UNAVAILABLE) from None
        return JSONResponse({"reset": reset})

    return router
