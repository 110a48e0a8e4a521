"""Bearer-token auth for every path except the liveness probes.

Unlike vLLM (which guards only /v1/*), this covers /invocations, the admin paths, tokenize
and, unless --no-protect-metrics, /metrics. It is a pure ASGI middleware so it runs before
routing: an unknown path without a key is a 401, which reveals nothing about the routes.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from tidal_engine.server.errors import AUTHENTICATION, error_body

# Probes must work without credentials (kubelet, load balancers).
ALWAYS_OPEN_PATHS = frozenset({"/health", "/ping"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, *, protect_metrics: bool = True) -> None:
        self.app = app
        # Compared as bytes with hmac.compare_digest: the time taken leaks nothing about the key.
        self._expected = f"Bearer {api_key}".encode()
        self._open = set(ALWAYS_OPEN_PATHS)
        if not protect_metrics:
            self._open.add("/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or scope["method"] == "OPTIONS":
            # OPTIONS is a CORS preflight, which browsers send without credentials.
            await self.app(scope, receive, send)
            return
        provided = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                provided = value
                break
        if hmac.compare_digest(provided, self._expected):
            await self.app(scope, receive, send)
            return
        message = "Missing API key" if not provided else "Invalid API key"
        body = json.dumps(
            error_body(401, f"{message}: send 'Authorization: Bearer <key>'.", AUTHENTICATION)
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
