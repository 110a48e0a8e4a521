"""Admin endpoints: sleep, wake, prefix-cache reset, LoRA load/unload. All behind the API key
(unlike vLLM)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tidal_engine.engine.async_engine import EngineClient, EngineDeadError, EngineShuttingDownError
from tidal_engine.lora.adapter import LoRAError
from tidal_engine.server.errors import ENGINE_UNAVAILABLE, NOT_FOUND, APIError, bad_request
from tidal_engine.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tidal_engine.server.serving import parse_model, read_json_body

WAKE_TAGS = ("weights", "kv_cache")


def _engine(request: Request) -> EngineClient:
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

    # vLLM's runtime LoRA routes: 200 with a plain-text message; errors OpenAI-shaped.
    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        serving = request.app.state.serving
        body = parse_model(LoadLoRAAdapterRequest, await read_json_body(request, serving.settings.max_request_body_bytes))
        if body.lora_name in serving.settings.served_model_names:
            raise bad_request(f"The lora adapter '{body.lora_name}' has the base model's name.", "lora_name")
        try:
            await _engine(request).load_lora_adapter(body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise _lora_error(exc, "lora_path") from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise APIError(503, str(exc), ENGINE_UNAVAILABLE) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        serving = request.app.state.serving
        body = parse_model(UnloadLoRAAdapterRequest, await read_json_body(request, serving.settings.max_request_body_bytes))
        try:
            now = await _engine(request).unload_lora_adapter(body.lora_name)
        except LoRAError as exc:
            raise _lora_error(exc, "lora_name") from None
        except (EngineDeadError, EngineShuttingDownError) as exc:
            raise APIError(503, str(exc), ENGINE_UNAVAILABLE) from None
        if now:
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' is no longer accepted and will be removed once its "
            "running requests finish."
        )

    return router


def _lora_error(exc: LoRAError, param: str) -> APIError:
    if exc.status == 404:
        return APIError(404, str(exc), NOT_FOUND, "lora_name")
    return bad_request(str(exc), param)
