"""The router's FastAPI app and its `tidal router` entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from typing import Any, AsyncIterator, Callable, Sequence

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from tidal_operator.router.auth import ApiKeyMiddleware, ApiKeys, allowed_namespaces
from tidal_operator.router.demand_lease import DemandLeasePublisher
from tidal_operator.router.engine_load import EngineLoadPoller
from tidal_operator.router.group_switch import GroupSwitcher
from tidal_operator.router.metrics import RouterMetrics
from tidal_operator.router.proxy import Proxy, RouterConfig
from tidal_operator.router.registry import KubernetesWatcher, Registry
from tidal_operator.router.waker import DemandBook, WakeLease, Waker
from tidal_operator.secret_refs import secret_value

log = logging.getLogger("tidal.router")

API_KEY_ENV = "TIDAL_ROUTER_API_KEY"
# Routed by the body's `model`; the pooling paths reach LLMServices with task embed or score.
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/pooling", "/score",
                "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
OPEN_PATHS = frozenset({"/health", "/ready"})  # probes come without credentials
TENANT_PATHS = frozenset({*OPENAI_PATHS, "/v1/models"})  # what a namespace-scoped key may call


def models_payload(registry: Registry, namespaces: frozenset[str] | None = None) -> dict[str, Any]:
    """GET /v1/models in OpenAI form; adapters name their base model in `parent`. `namespaces`:
    only those (a namespace-scoped key sees its own models only)."""
    data: list[dict[str, Any]] = []

    def owns(entry: Any, name: str) -> bool:  # a name two LLMServices claim is listed once, for its owner
        found = registry.lookup(name)
        return found is not None and (found.namespace, found.llmservice) == (entry.namespace, entry.llmservice)

    for entry in registry.state.entries():
        if namespaces is not None and entry.namespace not in namespaces:
            continue
        ready = sum(1 for r in entry.replicas if r.ready and not r.deleting)
        awake = sum(1 for r in entry.replicas if r.routable)
        base = {"object": "model", "created": 0, "owned_by": "tidal", "root": entry.served_name,
                "tidal": {"llmservice": entry.llmservice, "namespace": entry.namespace,
                          "replicas": len(entry.replicas), "ready": ready, "awake": awake}}
        if owns(entry, entry.served_name):
            data.append({"id": entry.served_name, "parent": None, **base})
        failed = dict(entry.failed_adapters)
        for adapter in sorted(entry.adapters - failed.keys()):  # a failed adapter is not served
            if owns(entry, adapter):
                data.append({"id": adapter, "parent": entry.served_name, **base})
    return {"object": "list", "data": data}


def default_http_client(config: RouterConfig) -> httpx.AsyncClient:
    # No connection cap: each streamed request holds one connection for its whole life.
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                             timeout=httpx.Timeout(config.connect_timeout_s, read=config.read_timeout_s))


def create_app(registry: Registry, config: RouterConfig, http_client: httpx.AsyncClient | None = None, *,
               wake_lease: WakeLease | None = None, api_keys: ApiKeys | None = None,
               synced: Callable[[], bool] | None = None) -> FastAPI:
    """The router app. `api_keys` overrides config.api_keys (for keys rotated from a Secret);
    `synced` says whether every watch has listed once (default: always, for an injected registry)."""
    if api_keys is None:
        if not config.api_keys and not config.allow_unauthenticated:
            raise ValueError("the router needs at least one API key (or allow_unauthenticated=True)")
        api_keys = ApiKeys(config.api_keys, allow_empty=config.allow_unauthenticated)
    keys = api_keys
    owns_client = http_client is None
    http = http_client or default_http_client(config)
    metrics = RouterMetrics()
    waker = Waker(registry, http, metrics, lease=wake_lease, wake_timeout_s=config.wake_timeout_s,
                  poll_interval_s=config.wake_poll_interval_s)
    demand = DemandBook(metrics, config.max_held_per_model)
    proxy = Proxy(registry, config, http, metrics, waker, demand)
    # GPU-share groups: the proxy wakes through the switcher, which hands other models to the Waker.
    switcher = GroupSwitcher(registry, http, waker, proxy.loads, demand)
    proxy.waker = switcher  # type: ignore[assignment]
    if synced is not None:
        proxy.synced = synced

    poller = EngineLoadPoller(registry, http, proxy.loads, interval_s=config.engine_load_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        polling = asyncio.create_task(poller.run()) if config.engine_load_interval_s > 0 else None
        yield
        if polling is not None:
            polling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await polling
        await switcher.close()
        await waker.close()
        if owns_client:
            await http.aclose()

    app = FastAPI(title="Tidal router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry
    app.state.proxy = proxy
    app.state.metrics = metrics
    app.state.waker = waker
    app.state.switcher = switcher
    app.state.demand = demand
    app.state.api_keys = keys

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: every watch has listed once (so no model is missing) and not shutting down."""
        if proxy.draining.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        if not proxy.synced():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse(models_payload(registry, allowed_namespaces(request.scope)))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/debug/demand")
    async def debug_demand() -> JSONResponse:
        """Held requests per LLMService: what the autoscaler treats as demand at zero replicas."""
        return JSONResponse({"demand": demand.snapshot(), "wakeCalls": waker.wake_calls})

    @app.get("/debug/replicas")
    async def debug_replicas() -> JSONResponse:
        out = []
        for entry in registry.state.entries():
            for r in entry.replicas:
                out.append({"llmservice": r.llmservice, "namespace": r.namespace, "pod": r.pod_name, "url": r.url,
                            "ready": r.ready, "sleepState": r.sleep_state, "deleting": r.deleting,
                            "adapters": sorted(r.adapters), "outstanding": proxy.loads.outstanding.get(r.key, 0),
                            "estimatedQueue": proxy.loads.estimated_loads([r])[r.key],
                            "coolingDown": r.key in proxy.loads.cooling()})
        return JSONResponse({"replicas": out})

    for path in OPENAI_PATHS:
        app.router.routes.append(Route(path, endpoint=proxy.endpoint(path), methods=["POST"]))

    open_paths = OPEN_PATHS if config.protect_metrics else OPEN_PATHS | {"/metrics", "/debug/demand"}
    app.add_middleware(ApiKeyMiddleware, keys=keys, open_paths=open_paths, tenant_paths=TENANT_PATHS)
    return app


# --- running it against a cluster ------------------------------------------------------------

async def _load_api_client(kubeconfig: str | None, in_cluster: bool) -> Any:
    from kubernetes_asyncio import client, config as k8s_config

    if in_cluster:
        k8s_config.load_incluster_config()
        return client.ApiClient()
    configuration = client.Configuration()
    await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


async def _refresh_router_keys(api_client: Any, secret: str, keys: ApiKeys, static: Sequence[str],
                               interval_s: float) -> None:
    """Keep `keys` = static keys + every value in the router-wide Secret ("namespace/name")."""
    from kubernetes_asyncio import client

    namespace, _, name = secret.rpartition("/")
    core = client.CoreV1Api(api_client)
    while True:
        try:
            obj = await core.read_namespaced_secret(name, namespace or "default")
            secret = {"data": obj.data or {}}
            values = [v for k in sorted(secret["data"]) if (v := secret_value(secret, k))]
            keys.set([*static, *values])
        except Exception as exc:  # keep the last good keys
            log.warning("cannot read router API key Secret %s: %s", secret, type(exc).__name__)
        await asyncio.sleep(interval_s)


class DrainingServer(uvicorn.Server):
    """uvicorn, but on shutdown (SIGTERM) the held requests are handed back with a retryable
    503 first; requests already on an engine get `timeout_graceful_shutdown` to finish."""

    def __init__(self, proxy: Proxy, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.proxy = proxy

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.proxy.drain()
        await super().shutdown(sockets)


async def run_router(*, kubeconfig: str | None = None, in_cluster: bool = False, host: str = "0.0.0.0",
                     port: int = 8080, namespace: str | None = None, config: RouterConfig | None = None,
                     api_keys_secret: str | None = None, wake_lease: str = "kubernetes",
                     log_level: str = "info", ready: asyncio.Event | None = None,
                     demand_leases: str | None = None, router_id: str | None = None,
                     keys_namespace: str | None = None) -> None:
    """Serve the router until cancelled: watch the cluster, answer on host:port.

    demand_leases: the namespace where this router keeps its held-demand Lease (the
    autoscaler reads every router's there); None: no Lease (demand only on /debug/demand).
    router_id: this replica's name in it (default: hostname-port).
    keys_namespace: where the operator keeps its copies of engine keys and namespace client keys
    (the router's own namespace); None: no engine keys and no namespace keys.

    api_keys_secret: "namespace/name" of a Secret whose every value is a client key.
    wake_lease: "kubernetes" (annotation lease on the Pod) or "none" (rely on idempotency).
    """
    from tidal_operator.router.waker import KubernetesWakeLease

    config = config or RouterConfig()
    api_client = await _load_api_client(kubeconfig, in_cluster)
    registry = Registry()
    if not config.api_keys and not api_keys_secret and not config.allow_unauthenticated:
        raise ValueError(f"give --api-key, ${API_KEY_ENV} or --api-keys-secret (or --allow-unauthenticated)")
    # With a Secret, requests are refused (not let through) until its keys are read.
    keys = ApiKeys(config.api_keys, allow_empty=config.allow_unauthenticated and not api_keys_secret)
    tasks: list[asyncio.Task[None]] = []
    if api_keys_secret:
        tasks.append(asyncio.create_task(_refresh_router_keys(api_client, api_keys_secret, keys,
                                                              config.api_keys, 30.0)))
    lease = KubernetesWakeLease(api_client) if wake_lease == "kubernetes" else None
    watcher = KubernetesWatcher(registry, api_client, namespace=namespace, keys_namespace=keys_namespace,
                                client_keys=keys.set_namespace)
    await watcher.start()
    app = create_app(registry, config, wake_lease=lease, api_keys=keys, synced=watcher.synced.is_set)
    publisher = None
    if demand_leases:
        # In a Pod (the chart's downward API): named after it, and garbage-collected with it.
        pod_name, pod_uid = os.environ.get("POD_NAME"), os.environ.get("POD_UID")
        publisher = DemandLeasePublisher(api_client, demand_leases,
                                         router_id or pod_name or f"{socket.gethostname()}-{port}", app.state.demand,
                                         owner_pod=(pod_name, pod_uid) if pod_name and pod_uid else None)
        tasks.append(asyncio.create_task(publisher.run()))
    server = DrainingServer(app.state.proxy, uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=config.shutdown_grace_s))
    try:
        serve = asyncio.create_task(server.serve())
        while not server.started and not serve.done():
            await asyncio.sleep(0.05)
        if ready is not None:
            ready.set()
        await serve
    finally:
        server.should_exit = True
        for task in tasks:
            task.cancel()
        if publisher is not None:
            await publisher.withdraw()
        await watcher.stop()
        await api_client.close()


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="tidal router", description="Tidal's OpenAI-compatible router.")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config")
    p.add_argument("--in-cluster", action="store_true")
    p.add_argument("--namespace", default=None, help="watch one namespace (default: all)")
    p.add_argument("--api-key", action="append", default=[],
                   help=f"a client API key (repeatable; also ${API_KEY_ENV}, comma-separated)")
    p.add_argument("--api-keys-secret", default=None, help="namespace/name of a Secret whose values are client keys")
    p.add_argument("--allow-unauthenticated", action="store_true", help="serve without any client key (dev only)")
    p.add_argument("--hold-timeout", type=float, default=RouterConfig.hold_timeout_s)
    p.add_argument("--max-held", type=int, default=RouterConfig.max_held_per_model)
    p.add_argument("--retries", type=int, default=RouterConfig.max_retries)
    p.add_argument("--cooldown", type=float, default=RouterConfig.cooldown_s)
    p.add_argument("--prefix-chars", type=int, default=RouterConfig.prefix_chars)
    p.add_argument("--engine-load-interval", type=float, default=RouterConfig.engine_load_interval_s,
                   help="seconds between reads of each engine's /metrics for its load (0: use only this router's counts)")
    p.add_argument("--shutdown-grace", type=int, default=RouterConfig.shutdown_grace_s,
                   help="seconds in-flight requests get to finish after SIGTERM (held ones get a 503 at once)")
    p.add_argument("--demand-leases", default=None, metavar="NAMESPACE",
                   help="keep this router's held-demand Lease in NAMESPACE (what the autoscaler reads)")
    p.add_argument("--keys-namespace", default=None, metavar="NAMESPACE",
                   help="watch the operator's copies of engine keys and namespace client keys in NAMESPACE")
    p.add_argument("--router-id", default=None, help="this replica's name in its Lease (default: hostname-port)")
    p.add_argument("--wake-lease", choices=["kubernetes", "none"], default="kubernetes")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env_keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    config = RouterConfig(api_keys=tuple(args.api_key) + tuple(env_keys),
                          allow_unauthenticated=args.allow_unauthenticated, hold_timeout_s=args.hold_timeout,
                          max_held_per_model=args.max_held, max_retries=args.retries, cooldown_s=args.cooldown,
                          prefix_chars=args.prefix_chars, shutdown_grace_s=args.shutdown_grace,
                          engine_load_interval_s=args.engine_load_interval)
    asyncio.run(run_router(kubeconfig=args.kubeconfig, in_cluster=args.in_cluster, host=args.host, port=args.port,
                           namespace=args.namespace, config=config, api_keys_secret=args.api_keys_secret,
                           wake_lease=args.wake_lease, log_level=args.log_level,
                           demand_leases=args.demand_leases, router_id=args.router_id,
                           keys_namespace=args.keys_namespace))


if __name__ == "__main__":
    main()
