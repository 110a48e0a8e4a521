"""OpenAI-style error bodies and the exception handlers that make every failure one.

Every error the server sends looks like
``{"error": {"message": ..., "type": ..., "param": ..., "code": <HTTP status>}}``
(``code`` carries the status, as vLLM does). Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Error types (the `type` field). Clients and the router branch on these strings.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTHENTICATION = "authentication_error"
REQUEST_TOO_LARGE = "request_too_large"
ENGINE_SLEEPING = "engine_sleeping"
ENGINE_UNAVAILABLE = "engine_unavailable"
INTERNAL = "internal_error"

# How long a client should wait before retrying a request refused because the engine sleeps.
SLEEP_RETRY_AFTER_S = 5


class APIError(Exception):
    """An error that maps one-to-one onto an HTTP response."""

    def __init__(
        self,
        status_code: int,
        message: str,
        err_type: str = INVALID_REQUEST,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.err_type = err_type
        self.param = param
        self.headers = headers


def error_body(status_code: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status_code}}


def error_response(
    status_code: int,
    message: str,
    err_type: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, err_type, param), status_code=status_code, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param)


def engine_sleeping_error() -> APIError:
    return APIError(
        503,
        "The engine is sleeping; wake it with POST /wake_up and retry.",
        ENGINE_SLEEPING,
        headers={"Retry-After": str(SLEEP_RETRY_AFTER_S)},
    )


def validation_error_to_api_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic errors become 400s (vLLM's choice), naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    # Drop FastAPI's location prefix ("body"/"query") and pydantic's union-branch names so
    # `param` reads like the JSON field a client sent.
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(p for p in loc if not _is_union_tag(p)) or None
    msg = first.get("msg", "invalid value")
    where = f" ({param})" if param else ""
    extra = f"; {len(errors) - 1} more error(s)" if len(errors) > 1 else ""
    return bad_request(f"Invalid request{where}: {msg}{extra}", param)


def _is_union_tag(part: str) -> bool:
    # pydantic names union branches like "str", "list[int]", "function-after[...]".
    return any(ch in part for ch in "[]") or part in ("str", "int", "float", "bool", "list", "dict", "none")


_STATUS_TYPES = {
    400: INVALID_REQUEST,
    401: AUTHENTICATION,
    404: NOT_FOUND,
    405: INVALID_REQUEST,
    413: REQUEST_TOO_LARGE,
    415: INVALID_REQUEST,
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.err_type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error_to_api_error(exc)
        return error_response(err.status_code, err.message, err.err_type, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = _STATUS_TYPES.get(exc.status_code, INTERNAL if exc.status_code >= 500 else INVALID_REQUEST)
        message = str(exc.detail) if exc.detail else "error"
        return error_response(exc.status_code, message, err_type, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: log it with the traceback, answer without internals.
        logger.exception("unhandled error while serving a request")
        return error_response(500, f"Internal server error: {type(exc).__name__}", INTERNAL)
