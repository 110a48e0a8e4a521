"""Auth matrix (every route × no key / wrong key / right key) and CORS."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import API_KEY, LiveServer, live_server, make_engine  # noqa: E402

from tidal_engine.server.app import ServerSettings, build_app  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]

# Every route the server has, with a body that succeeds when the key is right.
# The admin routes come in an order that keeps the engine usable (sleep, then wake).
ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "/v1/models", {}),
    ("POST", "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 2}}),
    ("POST", "/v1/chat/completions", {"json": {"messages": MSG, "max_tokens": 2}}),
    ("POST", "/invocations", {"json": {"messages": MSG, "max_tokens": 2}}),
    ("POST", "/tokenize", {"json": {"prompt": "Hi"}}),
    ("POST", "/detokenize", {"json": {"tokens": [19556]}}),
    ("GET", "/version", {}),
    ("GET", "/metrics", {}),
    ("POST", "/reset_prefix_cache", {}),
    ("GET", "/is_sleeping", {}),
    ("POST", "/sleep?level=1", {}),
    ("POST", "/wake_up", {}),
    ("GET", "/health", {}),
    ("GET", "/ping", {}),
    ("POST", "/ping", {}),
]
OPEN_PATHS = {"/health", "/ping"}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(api_key=API_KEY) as live:
        yield live


@pytest.mark.parametrize("method, path, kwargs", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("key", ["none", "wrong", "right"])
def test_auth_matrix(server: LiveServer, key: str, method: str, path: str, kwargs: dict[str, Any]) -> None:
    headers = {
        "none": {},
        "wrong": {"Authorization": f"Bearer {API_KEY}x"},
        "right": {"Authorization": f"Bearer {API_KEY}"},
    }[key]
    with server.client() as c:
        response = c.request(method, path, headers=headers, **kwargs)
    if key == "right" or path.split("?")[0] in OPEN_PATHS:
        assert 200 <= response.status_code < 300, response.text
    else:
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == 401
        assert API_KEY not in response.text
        assert response.headers["www-authenticate"] == "Bearer"


def test_unknown_path_is_401_without_key(server: LiveServer) -> None:
    with server.client() as c:
        assert c.get("/v1/secret-route").status_code == 401
        assert c.get("/v1/secret-route", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404


def test_other_auth_schemes_are_refused(server: LiveServer) -> None:
    with server.client() as c:
        for value in (API_KEY, f"Basic {API_KEY}", f"bearer  {API_KEY}", f"Bearer {API_KEY[:-1]}"):
            assert c.get("/v1/models", headers={"Authorization": value}).status_code == 401


def test_key_never_logged(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with server.client() as c:
        c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {API_KEY}"})
        c.get("/v1/models", headers={"Authorization": "Bearer not-the-key"})
    assert API_KEY not in caplog.text


@pytest.fixture(scope="module")
def tiny_engine() -> Any:
    return make_engine()


def _client(engine: Any, **settings: Any) -> TestClient:
    # No lifespan: these routes never reach the engine loop.
    return TestClient(build_app(engine, ServerSettings(**settings)))


def test_metrics_open_with_no_protect_metrics(tiny_engine: Any) -> None:
    client = _client(tiny_engine, api_key=API_KEY, protect_metrics=False)
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 401


def test_cors_allows_no_origin_by_default(tiny_engine: Any) -> None:
    client = _client(tiny_engine)
    preflight = client.options(
        "/v1/models", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    simple = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in simple.headers


def test_cors_allows_named_origin(tiny_engine: Any) -> None:
    client = _client(tiny_engine, api_key=API_KEY, allowed_origins=["https://app.example"])
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
    preflight = client.options("/v1/chat/completions", headers=headers)
    assert preflight.status_code == 200  # preflights carry no credentials
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = client.options("/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"
