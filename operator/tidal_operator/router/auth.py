"""Client keys: router-wide ones (platform admins: every model, every path) and namespace-scoped
ones (a tenant: only the models of its namespace, only the OpenAI paths and /v1/models).

A namespace's keys are every value of every Secret labelled `tidal.dev/client-keys: "true"` in
that namespace (deprecated: also the Secret named `tidal-client-keys`). The router never reads
them there: the operator copies them into the router's namespace, annotated with their source
namespace (controller/router_secrets.py), where the router watches the copies (registry.KeyCopies).
"""

from __future__ import annotations

import hmac
from typing import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from tidal_operator.router.proxy import AUTHENTICATION, error_body, send_json

SCOPE_KEY = "tidal.namespaces"  # in the ASGI scope: the namespaces a tenant key opens (absent: all)


def _bearer(keys: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(f"Bearer {k}".encode() for k in keys if k)


class ApiKeys:
    """The client-facing keys. Mutable so Secrets can rotate them live."""

    def __init__(self, keys: Iterable[str] = (), *, allow_empty: bool = False) -> None:
        self.allow_empty = allow_empty  # no keys configured: open (dev) or closed (keys pending)
        self._tenants: dict[str, tuple[bytes, ...]] = {}
        self.set(keys)

    def set(self, keys: Iterable[str]) -> None:
        self._expected = _bearer(keys)

    def set_namespace(self, namespace: str, keys: Iterable[str]) -> None:
        """The keys that open `namespace`'s models only (empty: none)."""
        bearer = _bearer(keys)
        if bearer:
            self._tenants[namespace] = bearer
        else:
            self._tenants.pop(namespace, None)

    def __bool__(self) -> bool:
        return bool(self._expected)

    def accepts(self, authorization: bytes) -> bool:
        """A router-wide key."""
        if not self._expected:
            return self.allow_empty
        # Compare against every key, without stopping early: the time taken reveals nothing.
        ok = False
        for expected in self._expected:
            ok |= hmac.compare_digest(authorization, expected)
        return ok

    def namespaces(self, authorization: bytes) -> frozenset[str]:
        """The namespaces whose keys include this one (every key compared, no early exit)."""
        found = set()
        for namespace, keys in self._tenants.items():
            match = False
            for expected in keys:
                match |= hmac.compare_digest(authorization, expected)
            if match:
                found.add(namespace)
        return frozenset(found)


def allowed_namespaces(scope: Scope) -> frozenset[str] | None:
    """None: every namespace (a router-wide key); else the tenant key's namespaces."""
    return scope.get(SCOPE_KEY)


class ApiKeyMiddleware:
    """Bearer auth before routing, so unknown paths without a key get 401 too."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: frozenset[str], tenant_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.tenant_paths = tenant_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        provided = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        admin = self.keys.accepts(provided)
        tenant = self.keys.namespaces(provided)
        if admin:
            await self.app(scope, receive, send)
            return
        if tenant and scope["path"] in self.tenant_paths:
            await self.app({**scope, SCOPE_KEY: tenant}, receive, send)
            return
        if tenant:
            await send_json(send, 403, error_body(403, "A namespace key opens only the OpenAI endpoints and "
                                                       "/v1/models.", "permission_error", code="forbidden"))
            return
        message = "Missing API key" if not provided else "Invalid API key"
        await send_json(send, 401, error_body(401, f"{message}: send 'Authorization: Bearer <key>'.", AUTHENTICATION,
                                              code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
