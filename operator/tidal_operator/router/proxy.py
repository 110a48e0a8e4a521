"""Forwarding one OpenAI request to a replica: hold, pick, send, retry, relay.

The endpoint is a plain ASGI app rather than a FastAPI handler so that it can watch for the
client's disconnect during the whole request (holding, waiting for headers, streaming)
and cancel the upstream call at once, whatever it is waiting on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import httpx
from starlette.types import Receive, Scope, Send

from tidal_operator import labels as L
from tidal_operator.router.metrics import RouterMetrics
from tidal_operator.router.picker import LoadTracker, prompt_prefix
from tidal_operator.router.registry import Key, ModelEntry, Registry, Replica
from tidal_operator.router.waker import DemandBook, QueueFull, Waker

log = logging.getLogger("tidal.router.proxy")

# OpenAI-style error types (the engine uses the same strings).
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTHENTICATION = "authentication_error"
UNAVAILABLE = "service_unavailable"
UPSTREAM = "upstream_error"
ENGINE_SLEEPING = "engine_sleeping"  # the engine's error type for requests it refuses while asleep

MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RouterConfig:
    api_keys: tuple[str, ...] = ()  # client-facing keys; any one of them is accepted
    allow_unauthenticated: bool = False  # only with no api_keys: say so explicitly
    hold_timeout_s: float = 300.0  # how long a request may wait for a wake or a new Pod
    max_held_per_model: int = 256  # the per-LLMService queue of held requests
    max_retries: int = 2  # re-sends to other replicas after a failure before the first byte
    cooldown_s: float = 10.0  # a replica that failed is avoided this long
    prefix_chars: int = 256  # prompt characters hashed in prefixHash mode
    bounded_load_epsilon: float = 0.25
    wake_timeout_s: float = 120.0
    wake_poll_interval_s: float = 0.2
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = 600.0  # between bytes; a non-streamed answer comes whole
    retry_after_s: int = 5  # the Retry-After header on 503s
    protect_metrics: bool = True  # /metrics and /debug/* need a key too
    engine_load_interval_s: float = 0.5  # how often each engine's /metrics is read for its load; 0: never
    shutdown_grace_s: int = 30  # on SIGTERM, time for in-flight requests to finish (held ones get a 503 at once)


def error_body(status: int, message: str, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param,
                      "code": status if code is None else code}}


async def send_json(send: Send, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
    body = json.dumps(payload).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Reject(Exception):
    """An error answer decided before any byte went to the client."""

    def __init__(self, status: int, message: str, err_type: str, *, retry_after: int | None = None,
                 code: str | None = None, param: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.retry_after, self.code, self.param, self.reason = retry_after, code, param, reason

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class _Retry(Exception):
    """This replica failed before answering; try another."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


# The only failures that prove no byte of the request reached an engine, so a re-send is
# safe. After the body went out (a reset, a closed connection, a read error) the engine may
# have started on it, and a request that crashed one engine must not crash the next.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _broken_after_send(exc: httpx.TransportError) -> Reject:
    return Reject(502, f"The engine closed the connection after receiving the request ({type(exc).__name__}). "
                       "It was not re-sent, because the engine may have started on it.", UPSTREAM,
                  reason="reset")


def _sse_error_event(message: str) -> bytes:
    payload = error_body(502, message, UPSTREAM)
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


class Proxy:
    """Everything a proxied request needs, shared by the three OpenAI endpoints."""

    def __init__(self, registry: Registry, config: RouterConfig, http: httpx.AsyncClient, metrics: RouterMetrics,
                 waker: Waker, demand: DemandBook) -> None:
        self.registry = registry
        self.config = config
        self.http = http
        self.metrics = metrics
        self.waker = waker
        self.demand = demand
        self.loads = LoadTracker(cooldown_s=config.cooldown_s)
        # False until every watch has listed once: until then an unknown model may just not
        # be loaded yet, so it is a retryable 503, not a 404.
        self.synced: Callable[[], bool] = lambda: True
        # Set when the server begins to shut down: held requests are handed back at once
        # with a retryable 503 (another router replica takes the retry); in-flight ones finish.
        self.draining = asyncio.Event()

    def drain(self) -> None:
        self.draining.set()

    def _shutting_down(self, model: str) -> Reject:
        self.metrics.rejected.labels(model, "shutdown").inc()
        return Reject(503, f"This router is shutting down while model '{model}' has no available replica; "
                           "retry (another router replica will take the request).", UNAVAILABLE,
                      retry_after=1, reason="shutdown")

    def endpoint(self, path: str) -> "ProxyEndpoint":
        return ProxyEndpoint(self, path)

    # --- holding ------------------------------------------------------------------------
    async def wait_routable(self, model: str, deadline: float,
                            namespaces: frozenset[str] | None = None) -> ModelEntry:
        """The model's entry once it has a routable replica, holding the request (and waking a
        sleeper, and recording demand) while it has none. `namespaces`: the models the
        client's key opens (None: all)."""
        entry = self._lookup(model, namespaces)
        if entry.routable() and self.waker.fits(entry):
            return entry
        self._fail_fast(entry)
        if self.draining.is_set():
            raise self._shutting_down(model)
        try:
            self.demand.hold(entry)
        except QueueFull as exc:
            self.metrics.rejected.labels(model, "queue_full").inc()
            raise Reject(503, f"Model '{model}' is starting and its queue is full ({exc}); retry later.",
                         UNAVAILABLE, retry_after=self.config.retry_after_s, reason="queue_full") from None
        held = entry
        try:
            while True:
                version = self.registry.version
                entry = self._lookup(model, namespaces)
                if entry.routable() and self.waker.fits(entry):
                    return entry
                self._fail_fast(entry)
                if self.draining.is_set():
                    raise self._shutting_down(model)
                waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(self.registry.wait_changed(version)),
                                                     asyncio.ensure_future(self.draining.wait())}
                wake = self.waker.ensure_waking(entry)
                if wake is not None:
                    waiters.add(wake)  # wake the loop when the wake ends, even if it failed
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    done, _ = await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                    if not done:
                        raise asyncio.TimeoutError
                finally:
                    for waiter in waiters:
                        if waiter is not wake:  # the wake task is shared; never cancel it here
                            waiter.cancel()
        except asyncio.TimeoutError:
            self.metrics.rejected.labels(model, "timeout").inc()
            what = "waking" if entry.wakeable() else "starting"
            raise Reject(503, f"Model '{model}' is {what} and no replica became available within "
                              f"{self.config.hold_timeout_s:g}s; retry later.", UNAVAILABLE,
                         retry_after=self.config.retry_after_s, reason="timeout") from None
        finally:
            self.demand.release(held)

    def _fail_fast(self, entry: ModelEntry) -> None:
        """No holding for what cannot get a replica without a change: answer now, with why."""
        why = entry.failure()
        if why is not None:
            self.metrics.rejected.labels(entry.model_name, "not_servable").inc()
            raise Reject(503, f"Model '{entry.model_name}' is unavailable: {why}", UNAVAILABLE,
                         code="model_not_servable", reason="not_servable")

    def _lookup(self, model: str, namespaces: frozenset[str] | None = None) -> ModelEntry:
        entry = self.registry.lookup(model)
        if entry is not None and namespaces is not None and entry.namespace not in namespaces:
            entry = None  # another tenant's model: as if it did not exist
        if entry is None:
            if not self.synced():
                raise Reject(503, f"The router is still loading its model list; retry (model '{model}').",
                             UNAVAILABLE, retry_after=1, reason="loading")
            available = [m for m in self.registry.state.model_names()
                         if namespaces is None or self._namespace_of(m) in namespaces]
            raise Reject(404, f"The model '{model}' does not exist. Available models: "
                              f"{', '.join(available) if available else '(none)'}.", NOT_FOUND,
                         code="model_not_found", param="model")
        return entry

    def _namespace_of(self, model: str) -> str | None:
        entry = self.registry.lookup(model)
        return entry.namespace if entry is not None else None

    # --- sending ------------------------------------------------------------------------
    def _upstream_headers(self, entry: ModelEntry, scope: Scope) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        for name, value in scope.get("headers", []):
            if name in (b"accept", b"x-request-id"):
                headers[name.decode()] = value.decode("latin-1")
        key = self.registry.engine_api_key(entry)
        if key:
            headers["authorization"] = f"Bearer {key}"  # never the client's key
        return headers

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.config.connect_timeout_s, read=self.config.read_timeout_s,
                             write=self.config.read_timeout_s, pool=None)


class ProxyEndpoint:
    """The ASGI app for one OpenAI path (e.g. /v1/chat/completions)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self.proxy = proxy
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        outcome: dict[str, Any] = {"model": "", "status": 0}
        tracked_send = self._tracking(send, outcome)
        try:
            raw = await self._read_body(receive)
        except Reject as rej:
            await send_json(tracked_send, rej.status, error_body(rej.status, rej.message, rej.err_type))
            return
        if raw is None:
            return  # the client left before sending its body
        handler = asyncio.create_task(self._handle(scope, raw, tracked_send, outcome))
        disconnect = asyncio.create_task(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({handler, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if handler not in done:
                # The client left: cancelling the handler closes the upstream connection,
                # which is how the engine learns to abort the generation.
                handler.cancel()
                outcome["status"] = outcome["status"] or 499
            try:
                await handler
            except asyncio.CancelledError:
                if not disconnect.done():
                    raise  # we are being cancelled ourselves
        finally:
            disconnect.cancel()
            handler.cancel()
            model = outcome["model"] or "(none)"
            status = str(outcome["status"] or 499)
            self.proxy.metrics.requests.labels(model, self.path, status).inc()
            self.proxy.metrics.latency.labels(model, self.path).observe(time.perf_counter() - started)

    @staticmethod
    def _tracking(send: Send, outcome: dict[str, Any]) -> Send:
        async def tracked(message: Any) -> None:
            if message["type"] == "http.response.start":
                outcome["status"] = message["status"]
            await send(message)
        return tracked

    @staticmethod
    async def _read_body(receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise Reject(413, f"Request body larger than {MAX_BODY_BYTES} bytes.", INVALID_REQUEST)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _handle(self, scope: Scope, raw: bytes, send: Send, outcome: dict[str, Any]) -> None:
        proxy = self.proxy
        try:
            body = self._parse(raw)
            model = body["model"]
            outcome["model"] = model
            namespaces = scope.get("tidal.namespaces")  # set by the auth middleware for a tenant key
            proxy._lookup(model, namespaces)  # 404 before any holding
            await self._route(scope, raw, body, model, send, namespaces)
        except Reject as rej:
            await send_json(send, rej.status, error_body(rej.status, rej.message, rej.err_type, rej.param, rej.code),
                            rej.headers)
        except Exception:
            log.exception("router error on %s", self.path)
            if not outcome["status"]:  # nothing sent yet: the client still gets an OpenAI-style error
                await send_json(send, 500, error_body(500, "Internal router error.", "internal_error"))

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Reject(400, f"The request body is not valid JSON: {exc}", INVALID_REQUEST) from None
        if not isinstance(body, dict):
            raise Reject(400, "The request body must be a JSON object.", INVALID_REQUEST)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise Reject(400, "The request needs a 'model' (a string).", INVALID_REQUEST, param="model")
        return body

    async def _route(self, scope: Scope, raw: bytes, body: dict[str, Any], model: str, send: Send,
                     namespaces: frozenset[str] | None = None) -> None:
        proxy = self.proxy
        config = proxy.config
        deadline = asyncio.get_running_loop().time() + config.hold_timeout_s
        tried: set[Key] = set()
        failures = 0
        sleep_bounces = 0
        while True:
            entry = await proxy.wait_routable(model, deadline, namespaces)
            candidates = [r for r in entry.routable() if r.key not in tried]
            prefix = prompt_prefix(body, config.prefix_chars) if entry.routing_strategy == "prefixHash" else None
            replica = proxy.loads.pick(candidates, strategy=entry.routing_strategy, prefix_key=prefix,
                                       epsilon=config.bounded_load_epsilon)
            if replica is None:
                raise Reject(503, f"Every replica of model '{model}' failed; retry later.", UNAVAILABLE,
                             retry_after=config.retry_after_s)
            try:
                await self._forward(scope, raw, entry, replica, send)
                return
            except _Retry as failure:
                if failure.kind == "sleeping" and sleep_bounces < config.max_retries + 1:
                    # Not a failure: the hold loop wakes it (or another replica takes it), and
                    # it must stay eligible for this request once awake.
                    sleep_bounces += 1
                    continue
                tried.add(replica.key)
                failures += 1
                if failures > config.max_retries:
                    raise Reject(503, f"Model '{model}' is unavailable: {failures} attempts failed "
                                      f"(last: {failure.kind}); retry later.", UNAVAILABLE,
                                 retry_after=config.retry_after_s) from None
                proxy.metrics.retries.labels(model).inc()

    async def _forward(self, scope: Scope, raw: bytes, entry: ModelEntry, replica: Replica, send: Send) -> None:
        proxy = self.proxy
        model = entry.model_name
        loads = proxy.loads
        loads.acquire(replica)
        proxy.metrics.replica_requests.labels(model, replica.namespace, replica.pod_name).inc()
        gauge = proxy.metrics.outstanding.labels(replica.namespace, replica.pod_name)
        gauge.inc()
        try:
            request = proxy.http.build_request("POST", f"{replica.url}{self.path}", content=raw,
                                               headers=proxy._upstream_headers(entry, scope), timeout=proxy._timeout())
            try:
                upstream = await proxy.http.send(request, stream=True)
            except NOT_SENT:
                self._failed(replica, model, "connect")
                raise _Retry("connect") from None
            except httpx.TimeoutException:
                proxy.metrics.upstream_errors.labels(model, "timeout").inc()
                raise Reject(504, f"The engine did not answer within {proxy.config.read_timeout_s}s.",
                             UPSTREAM) from None
            except httpx.TransportError as exc:
                self._failed(replica, model, "reset")
                raise _broken_after_send(exc) from None
            try:
                await self._relay(upstream, entry, replica, send)
            finally:
                await upstream.aclose()
        finally:
            loads.release(replica)
            gauge.dec()

    def _failed(self, replica: Replica, model: str, kind: str) -> None:
        self.proxy.loads.mark_failed(replica)
        self.proxy.metrics.upstream_errors.labels(model, kind).inc()
        log.warning("replica %s/%s failed (%s) for model %s", replica.namespace, replica.pod_name, kind, model)

    async def _relay(self, upstream: httpx.Response, entry: ModelEntry, replica: Replica, send: Send) -> None:
        proxy = self.proxy
        model = entry.model_name
        content_type = upstream.headers.get("content-type", "application/json")
        if upstream.status_code == 503:
            # Sleeping (its label lags) or draining: nothing was done, so another replica may
            # take it. A sleeper is noted so the hold loop wakes it if it is the last one.
            payload = await self._read_small(upstream)
            if payload.get("error", {}).get("type") == ENGINE_SLEEPING:
                proxy.registry.observe_sleep_state(replica, L.SLEEP_LEVEL_1)
                raise _Retry("sleeping")
            self._failed(replica, model, "unavailable")
            raise _Retry("unavailable")
        headers = [(b"content-type", content_type.encode()), (b"x-tidal-replica", replica.pod_name.encode())]
        for name in ("x-request-id", "retry-after"):
            if name in upstream.headers:
                headers.append((name.encode(), upstream.headers[name].encode()))
        if not content_type.startswith("text/event-stream"):
            try:
                body = await upstream.aread()
            except httpx.TimeoutException:  # the engine may still be working
                proxy.metrics.upstream_errors.labels(model, "timeout").inc()
                raise Reject(504, "The engine stopped answering mid-response.", UPSTREAM) from None
            except httpx.TransportError as exc:  # died while answering: it had the request
                self._failed(replica, model, "reset")
                raise _broken_after_send(exc) from None
            proxy.loads.mark_ok(replica)
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        # Streaming: each chunk goes out as it arrives. `send` blocks while the client's
        # socket buffer is full, so we read upstream no faster than the client reads.
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
        tail = b"\n\n"
        try:
            async for chunk in upstream.aiter_raw():
                if chunk:
                    tail = (tail + chunk)[-2:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            self._failed(replica, model, "midstream")
            separator = b"" if tail == b"\n\n" else b"\n\n"  # close a half-sent event first
            await send({"type": "http.response.body", "more_body": True,
                        "body": separator + _sse_error_event(f"The engine failed mid-stream ({type(exc).__name__}); "
                                                             "the response is incomplete.")})
        else:
            proxy.loads.mark_ok(replica)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _read_small(upstream: httpx.Response) -> dict[str, Any]:
        try:
            data = json.loads(await upstream.aread())
            return data if isinstance(data, dict) else {}
        except (ValueError, httpx.TransportError):
            return {}
