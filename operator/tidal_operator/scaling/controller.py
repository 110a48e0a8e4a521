"""The autoscaling and idle loop of one LLMService: scrape → decide → write status → act.

One `ServiceAutoscaler` per LLMService runs `tick()` on an interval; `AutoscalerRuntime.run`
(one task, started by the operator's startup handler) ticks every LLMService that has builtin
autoscaling or a sleep policy. Each tick:

1. reads the LLMService and its engine Pods;
2. scrapes every Ready Pod's /metrics (shared Scraper: bounded, timed out, None = unknown)
   and asks the routers for held demand;
3. builtin mode: `decide.decide_replicas`; every mode with a sleep policy: `idle.plan_idle`;
4. applies `status.desiredReplicas`, `lastScaleTime`, `scalingHistory`, `sleepingReplicas`
   with server-side apply as its own field manager (status only: never `spec`, so Argo CD /
   Flux see no drift) and posts an Event per decision;
5. sleeps / wakes engines through their API and keeps each Pod's `tidal.dev/sleep-state`
   label and `tidal.dev/idle-since` annotation true.

The Pod planner (reconcile/pods.py, run by the reconcile) turns status.desiredReplicas into
Pods and deletes sleeping Pods first when it scales down, so "remove an idle Pod" is a lower
desiredReplicas, not a delete from here. Everything the loop needs after a restart is in
status and on the Pods; only the metric history is in memory, and an empty history blocks
both directions until the windows are observed again (decide.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence
from urllib.parse import quote

import httpx

from .. import labels as L
from ..api.types import LLMServiceSpec
from ..api.validation import parse_spec
from ..engine_client import EngineClient, EngineError, EngineMetrics
from ..kube import MANAGER_AUTOSCALER
from ..loops import run_rounds
from ..reconcile.pods import PodView, parse_time
from ..reconcile.status import desired_replicas, pod_stuck_reason
from ..secret_refs import engine_api_key
from .decide import Decision, Reading, ScalingState, decide_replicas, metric_value
from .idle import IDLE_SINCE_ANNOTATION, LEVEL_OF_STATE, STATE_OF_LEVEL, IdleAction, ReplicaIdleView, plan_idle
from .router_demand import CachedDemand, DemandTotals, LeaseDemandClient, add_held
from .scraper import Scraper, ScrapeTarget

log = logging.getLogger("tidal.scaling")

HISTORY_LIMIT = 10  # status.scalingHistory entries kept


@dataclass(frozen=True)
class ScalingConfig:
    interval_s: float = 5.0  # one tick (scrape + decide) per LLMService
    scrape_timeout_s: float = 3.0
    scrape_concurrency: int = 32  # operator-wide
    drain_timeout_s: float = 300.0  # /sleep?mode=wait waits for requests in flight
    wake_timeout_s: float = 120.0
    # Routers whose /debug/demand is read (http://host:port); empty: no held demand known (0).
    router_urls: tuple[str, ...] = ()
    router_api_key: str | None = None  # only when the routers protect /debug/demand
    # The namespace of the routers' held-demand Leases (every replica's); preferred over router_urls.
    router_demand_namespace: str | None = None
    history_limit: int = HISTORY_LIMIT
    # Readings kept beyond the longest window, so the window start is always covered.
    history_margin_s: float = 60.0


# --- time --------------------------------------------------------------------------------------

def format_ts(t: float, *, fraction: bool = False) -> str:
    dt = datetime.fromtimestamp(t, timezone.utc)
    if fraction:  # the idle-since annotation: short test windows need sub-second precision
        return dt.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: Any) -> float | None:
    try:
        parsed = parse_time(value)
    except (TypeError, ValueError):
        return None
    if parsed is None:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


# --- the Kubernetes side, behind a small interface ----------------------------------------------

class ClusterApi(Protocol):
    """The calls the loop makes: the handlers' `kube.Kube` has all but `read_secret`
    (`KubeClusterApi` adds it)."""

    async def get_llmservice(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def list_llmservices(self, namespace: str | None = None) -> list[dict[str, Any]]: ...
    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...
    async def apply_llmservice_status(self, namespace: str, name: str, status: Mapping[str, Any], *,
                                      manager: str) -> Any: ...
    async def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None: ...
    async def post_event(self, involved: Mapping[str, Any], *, type_: str, reason: str, message: str) -> None: ...
    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class KubeClusterApi:
    """ClusterApi over the handlers' `Kube` (one API client for the whole operator)."""

    def __init__(self, kube: Any) -> None:
        self.kube = kube

    def __getattr__(self, name: str) -> Any:  # get_llmservice, list_pods, patch_pod, post_event, ...
        return getattr(self.kube, name)

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The engine API key's Secret: scraping /metrics and sleep/wake need the key itself
        (RBAC: get on secrets). The value is never logged."""
        from ..kube import ApiError

        try:
            return await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{quote(name, safe='')}")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise


# --- held demand from the routers ----------------------------------------------------------------

class DemandSource(Protocol):
    async def held(self, namespace: str, llmservice: str) -> int | None:
        """Requests the routers hold for the LLMService now; None when unknown."""


class NoDemand:
    """No router configured: nothing is ever held (scale-from-zero then needs a router)."""

    async def held(self, namespace: str, llmservice: str) -> int | None:
        return 0


class RouterDemandClient(CachedDemand):
    """Sums `held` from every router's /debug/demand, cached for `ttl_s` so all LLMServices
    of one tick share one round of requests. Any router failing makes the demand unknown."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, timeout_s: float = 2.0,
                 ttl_s: float = 1.0, http: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ttl_s, clock)
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._api_key = api_key
        self.timeout_s = timeout_s
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def _fetch(self) -> dict[tuple[str, str], int] | None:
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}

        async def one(url: str) -> list[dict[str, Any]] | None:
            try:
                response = await self._http.get(url + "/debug/demand", headers=headers, timeout=self.timeout_s)
                response.raise_for_status()
                return list(response.json().get("demand") or [])
            except (httpx.HTTPError, ValueError) as exc:
                log.info("router demand from %s unknown: %s", url, type(exc).__name__)
                return None

        answers = await asyncio.gather(*(one(u) for u in self.urls))
        if any(a is None for a in answers):
            return None
        totals: DemandTotals = {}
        for answer in answers:
            add_held(totals, answer or [])
        return totals


# --- pure helpers: status, history, events ------------------------------------------------------

def history_entry(decision: Decision, now: float) -> dict[str, Any]:
    return {"time": format_ts(now), "from": decision.previous, "to": decision.desired, "reason": decision.reason}


def append_history(history: Sequence[Mapping[str, Any]] | None, entry: Mapping[str, Any],
                   limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
    """The last `limit` entries, newest last."""
    kept = [dict(e) for e in (history or [])][-(limit - 1):] if limit > 1 else []
    return kept + [dict(entry)]


def autoscaler_status(status: Mapping[str, Any], decision: Decision | None, sleeping: int, now: float,
                      limit: int = HISTORY_LIMIT) -> dict[str, Any] | None:
    """The autoscaler's status fields, all of them, for a server-side apply (a field a manager
    owns and leaves out is removed); None when none of them changes. desiredReplicas only with
    a decision (builtin mode): otherwise the reconcile owns it."""
    out: dict[str, Any] = {"sleepingReplicas": sleeping}
    out.update({k: status[k] for k in ("lastScaleTime", "scalingHistory") if k in status})
    if decision is not None:
        out["desiredReplicas"] = decision.desired
        if decision.changed:
            out["lastScaleTime"] = format_ts(now)
            out["scalingHistory"] = append_history(status.get("scalingHistory"), history_entry(decision, now), limit)
    return None if all(status.get(k) == v for k, v in out.items()) else out


@dataclass
class TickResult:
    """What one tick saw and did (for tests and logs)."""

    decision: Decision | None = None
    actions: list[IdleAction] = field(default_factory=list)
    metrics: dict[str, EngineMetrics | None] = field(default_factory=dict)
    demand: int | None = 0
    status_patch: dict[str, Any] | None = None


# --- one LLMService ---------------------------------------------------------------------------------

OnChange = Callable[[str, str], Awaitable[Any]]


class ServiceAutoscaler:
    def __init__(self, namespace: str, name: str, cluster: ClusterApi, scraper: Scraper,
                 demand: DemandSource | None = None, config: ScalingConfig | None = None, *,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.time,
                 on_change: OnChange | None = None) -> None:
        self.namespace = namespace
        self.name = name
        self.cluster = cluster
        self.scraper = scraper
        self.demand = demand or NoDemand()
        self.config = config or ScalingConfig()
        self.clock = clock
        self.on_change = on_change  # called after desiredReplicas changed (the reconciler re-plans Pods)
        self._http = http  # for engine admin calls; None: one client per call
        self.history: deque[Reading] = deque()
        self.desired: int | None = None  # what this loop last wrote to status.desiredReplicas
        self._activity: dict[str, float] = {}  # last token counter per Pod, to see work between scrapes
        self._levels: dict[str, int] = {}  # sleep level per Pod at the end of the previous round

    # -- reading the world --

    def _busy(self, pod: str, metrics: EngineMetrics | None) -> bool | None:
        if metrics is None or metrics.in_flight is None:
            return None
        previous = self._activity.get(pod)
        if metrics.activity is not None:
            self._activity[pod] = metrics.activity
        moved = previous is not None and metrics.activity is not None and metrics.activity != previous
        return metrics.in_flight > 0 or moved

    def _trim(self, now: float, spec: LLMServiceSpec) -> None:
        a = spec.autoscaling
        longest = max(a.scale_up_stabilization_seconds, a.scale_down_delay_seconds) if a else 0
        keep_from = now - longest - self.config.history_margin_s
        # Keep one reading at or before the window start: it proves the window is covered.
        while len(self.history) > 1 and self.history[1].time <= keep_from:
            self.history.popleft()

    # -- one round --

    async def tick(self) -> TickResult:
        result = TickResult()
        llm = await self.cluster.get_llmservice(self.namespace, self.name)
        if llm is None or (llm.get("metadata") or {}).get("deletionTimestamp"):
            return result
        spec, problems = parse_spec(llm.get("spec") or {})
        if spec is None or problems:
            return result  # status.py reports the problems; nothing to scale
        a = spec.autoscaling
        builtin = a is not None and a.mode == "builtin"
        if not builtin:
            self.desired = None
            self.history.clear()
            if spec.sleep is None:
                return result  # fixed replicas, or the HPA/KEDA owns them: nothing to do here
        status = llm.get("status") or {}
        now = self.clock()

        pod_objs = await self.cluster.list_pods(self.namespace, L.selector_string(self.name))
        alive: list[tuple[dict[str, Any], PodView]] = []
        for p in pod_objs:
            v = PodView.from_pod(p)
            if not v.deleting and not v.terminal:
                alive.append((p, v))
        ready = [(p, v) for p, v in alive if v.ready and (p.get("status") or {}).get("podIP")]

        api_key = await engine_api_key(self.cluster.read_secret, self.namespace, spec)
        port = spec.engine.port
        urls = {v.name: f"http://{p['status']['podIP']}:{port}" for p, v in ready}
        result.metrics = await self.scraper.scrape(ScrapeTarget(name, url, api_key) for name, url in urls.items())
        try:
            result.demand = await self.demand.held(self.namespace, self.name)
        except Exception as exc:  # a broken router must not stop the loop
            log.warning("reading demand for %s/%s failed: %r", self.namespace, self.name, exc)
            result.demand = None

        # -- decide --
        current = desired_replicas(spec, status)
        if builtin and self.desired is not None and status.get("desiredReplicas") != self.desired:
            # Another writer put back an older value: this loop's last decision stands.
            current = self.desired
        load = 1 if (result.demand or 0) > 0 else 0
        if builtin:
            assert a is not None
            self.history.append(Reading(now, {n: metric_value(m, a.metric) for n, m in result.metrics.items()},
                                        result.demand))
            self._trim(now, spec)
            current_hash = status.get("specHash") or ""
            counted = [v for _, v in alive if not current_hash or v.spec_hash == current_hash]
            wall = datetime.fromtimestamp(now, timezone.utc)
            starting = sum(1 for p, v in alive if not v.ready
                           and pod_stuck_reason(p, wall, spec.engine.startup_timeout_seconds) is None)
            state = ScalingState(current=current, loading=max(0, current - len(counted)) + starting,
                                 last_scale_time=parse_ts(status.get("lastScaleTime")),
                                 idle_floor=spec.sleep is not None)
            result.decision = decide_replicas(list(self.history), a, state, now)
            load = result.decision.load

        # -- idle --
        removable = max(0, current - a.min_replicas) if builtin and a is not None else 0
        if result.decision is not None and result.decision.desired > current:
            removable = 0  # growing: nothing idle leaves now
        views = []
        for p, v in ready:
            m = result.metrics.get(v.name)
            engine_level = m.sleep_level if m is not None else None
            level_now = engine_level if engine_level is not None else LEVEL_OF_STATE.get(v.sleep_state, 0)
            views.append(ReplicaIdleView(
                pod=v.name, ready=True, sleep_state=v.sleep_state,
                idle_since=parse_ts(((p.get("metadata") or {}).get("annotations") or {}).get(IDLE_SINCE_ANNOTATION)),
                busy=self._busy(v.name, m), engine_level=engine_level,
                woken=self._levels.get(v.name, 0) > 0 and level_now == 0))
        result.actions = plan_idle(views, spec.sleep, now, result.demand, awake_wanted=load, removable=removable)
        if spec.gpu_share is not None:
            # A GPU-share member wakes only through the router's group switch, which first puts
            # others to sleep to make room (docs/gpu-sharing.md); a wake from here could overfill the device.
            result.actions = [x for x in result.actions if x.kind != "wake"]
        for gone in set(self._activity) - {v.name for _, v in alive}:
            del self._activity[gone]

        # -- status: desiredReplicas first, the planner acts on it --
        removes = [x for x in result.actions if x.kind == "remove"]
        decision = result.decision
        if decision is not None and removes and a is not None:
            down_to = max(a.min_replicas, min(decision.desired, current - len(removes)))
            if down_to < decision.desired:
                decision = Decision(down_to, "idle for removeAfterSeconds: "
                                    + ", ".join(f"{x.pod} ({x.reason})" for x in removes), current, decision.load)
                result.decision = decision
        levels = {v.name: LEVEL_OF_STATE.get(v.sleep_state, 0) for _, v in alive}
        for x in result.actions:
            if x.kind == "set_sleep_state":
                levels[x.pod] = LEVEL_OF_STATE.get(x.state, 0)
            elif x.kind == "sleep":
                levels[x.pod] = x.level
            elif x.kind == "wake":
                levels[x.pod] = 0
            elif x.kind == "remove":
                levels.pop(x.pod, None)
        self._levels = dict(levels)
        sleeping = sum(1 for level in levels.values() if level > 0)
        applied = autoscaler_status(status, decision, sleeping, now, self.config.history_limit)
        if decision is not None:
            # Before the write: a reconcile running meanwhile asks for it (Reconciler.desired_replicas).
            self.desired = decision.desired
        if applied:
            await self.cluster.apply_llmservice_status(self.namespace, self.name, applied, manager=MANAGER_AUTOSCALER)
            result.status_patch = applied
        if decision is not None and decision.changed:
            verb = "ScaledUp" if decision.desired > decision.previous else "ScaledDown"
            log.info("%s/%s: %d -> %d: %s", self.namespace, self.name, decision.previous, decision.desired,
                     decision.reason)
            await self._event(llm, verb, f"{decision.previous} -> {decision.desired}: {decision.reason}")
        desired_written = decision is not None and (decision.changed
                                                    or status.get("desiredReplicas") != decision.desired)
        if desired_written and self.on_change is not None:
            try:
                await self.on_change(self.namespace, self.name)
            except Exception as exc:  # the resync catches up
                log.warning("re-planning %s/%s after scaling failed: %r", self.namespace, self.name, exc)

        # -- act on the engines --
        await self._apply(llm, result.actions, urls, api_key)
        return result

    async def _event(self, llm: Mapping[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
        try:
            await self.cluster.post_event(llm, type_=type_, reason=reason, message=message)
        except Exception as exc:  # events are best effort
            log.warning("event %s for %s/%s not posted: %r", reason, self.namespace, self.name, exc)

    async def _label(self, pod: str, state: str | None = None, *, since: float | None | str = "keep") -> None:
        meta: dict[str, Any] = {}
        if state is not None:
            meta["labels"] = {L.SLEEP_STATE: state}
        if since != "keep":
            meta["annotations"] = {IDLE_SINCE_ANNOTATION: None if since is None else format_ts(float(since),
                                                                                               fraction=True)}
        await self.cluster.patch_pod(self.namespace, pod, {"metadata": meta})

    def _engine(self, url: str, api_key: str | None, timeout_s: float) -> EngineClient:
        return EngineClient(url, api_key, timeout_s=timeout_s, http=self._http)

    async def _apply(self, llm: Mapping[str, Any], actions: Sequence[IdleAction], urls: Mapping[str, str],
                     api_key: str | None) -> None:
        async def guarded(what: str, pod: str, step: Awaitable[None]) -> None:
            try:
                await step
            except Exception as exc:  # one Pod's trouble must not stop the others
                log.warning("%s %s/%s failed: %s", what, self.namespace, pod, exc)

        for x in actions:
            if x.kind == "set_idle_since":
                await guarded("marking idle time of", x.pod, self._label(x.pod, since=x.since))
            elif x.kind == "set_sleep_state":
                await guarded("relabelling", x.pod, self._label(x.pod, x.state))
        # Engines sleep and wake concurrently: a long drain on one must not delay a wake.
        await asyncio.gather(*(guarded(x.kind, x.pod, (self._sleep if x.kind == "sleep" else self._wake)(
            llm, x, urls[x.pod], api_key)) for x in actions if x.kind in ("sleep", "wake")))
        for x in actions:
            if x.kind == "remove":
                await self._event(llm, "RemovingIdleReplica", f"pod {x.pod}: {x.reason}")

    async def _sleep(self, llm: Mapping[str, Any], action: IdleAction, url: str, api_key: str | None) -> None:
        # Label first: the routers stop picking the Pod, then the engine drains (mode=wait)
        # what it still has and sleeps. A request that slips in between is refused by the
        # engine with engine_sleeping, which the router retries elsewhere or holds and wakes.
        await self._label(action.pod, STATE_OF_LEVEL[action.level])
        try:
            async with self._engine(url, api_key, self.config.drain_timeout_s) as engine:
                await engine.sleep(action.level, "wait", timeout_s=self.config.drain_timeout_s)
        except EngineError as exc:
            # The engine stays awake: say so, so the routers use it again.
            await self._label(action.pod, L.SLEEP_AWAKE)
            await self._event(llm, "SleepFailed", f"pod {action.pod}: {exc}", "Warning")
            raise
        await self._event(llm, "ReplicaSleeping", f"pod {action.pod} asleep at level {action.level}: {action.reason}")

    async def _wake(self, llm: Mapping[str, Any], action: IdleAction, url: str, api_key: str | None) -> None:
        async with self._engine(url, api_key, self.config.wake_timeout_s) as engine:
            await engine.wake_up(timeout_s=self.config.wake_timeout_s)
        await self._label(action.pod, L.SLEEP_AWAKE, since=None)
        await self._event(llm, "ReplicaWoken", f"pod {action.pod}: {action.reason}")


# --- operator-wide runtime (composed in controller/runtime.py) ---------------------------------------

def wants_loop(llm: Mapping[str, Any]) -> bool:
    """Whether an LLMService needs the loop: builtin autoscaling, or a sleep policy. Read
    leniently (the spec may be invalid; tick() re-parses it)."""
    spec = llm.get("spec") or {}
    autoscaling = spec.get("autoscaling")
    builtin = isinstance(autoscaling, Mapping) and autoscaling.get("mode", "builtin") == "builtin"
    return builtin or isinstance(spec.get("sleep"), Mapping)


class AutoscalerRuntime:
    """One loop for the whole operator: each interval, every LLMService that wants it gets a
    tick (concurrently; the shared Scraper bounds the scrapes). A task, not a kopf daemon:
    daemons would put kopf's finalizer on every LLMService."""

    def __init__(self, cluster: ClusterApi, config: ScalingConfig | None = None, *,
                 demand: DemandSource | None = None, on_change: OnChange | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cluster = cluster
        self.config = config or ScalingConfig()
        self.clock = clock
        self.on_change = on_change
        self.http = httpx.AsyncClient(timeout=self.config.scrape_timeout_s)
        self.scraper = Scraper(timeout_s=self.config.scrape_timeout_s, concurrency=self.config.scrape_concurrency,
                               http=self.http)
        if demand is None and self.config.router_demand_namespace:
            demand = LeaseDemandClient(cluster.request, self.config.router_demand_namespace,  # type: ignore[attr-defined]
                                       ttl_s=self.config.interval_s / 2)
        if demand is None and self.config.router_urls:
            demand = RouterDemandClient(self.config.router_urls, api_key=self.config.router_api_key,
                                        ttl_s=self.config.interval_s / 2, http=self.http)
        self.demand: DemandSource = demand or NoDemand()
        self.services: dict[tuple[str, str], ServiceAutoscaler] = {}

    def service(self, namespace: str, name: str) -> ServiceAutoscaler:
        key = (namespace, name)
        if key not in self.services:
            self.services[key] = ServiceAutoscaler(namespace, name, self.cluster, self.scraper, self.demand,
                                                   self.config, http=self.http, clock=self.clock,
                                                   on_change=self.on_change)
        return self.services[key]

    async def desired_replicas(self, llm: Mapping[str, Any], spec: LLMServiceSpec, pods: Any) -> int | None:
        """For Reconciler.desired_replicas: this loop's latest decision (builtin mode), so
        a reconcile that read an older status never writes an older desiredReplicas back."""
        if spec.autoscaling is None or spec.autoscaling.mode != "builtin":
            return None
        meta = llm.get("metadata") or {}
        scaler = self.services.get((meta.get("namespace", ""), meta.get("name", "")))
        return scaler.desired if scaler is not None else None

    async def tick_all(self, namespace: str | None = None) -> None:
        llms = [o for o in await self.cluster.list_llmservices(namespace) if wants_loop(o)]
        keys = {(o["metadata"].get("namespace") or "default", o["metadata"]["name"]) for o in llms}
        for gone in set(self.services) - keys:
            del self.services[gone]  # deleted, or no longer autoscaled: its history goes too

        async def one(key: tuple[str, str]) -> None:
            try:
                await self.service(*key).tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("autoscaling %s/%s: tick failed: %r", key[0], key[1], exc)

        await asyncio.gather(*(one(k) for k in sorted(keys)))

    async def run(self, namespace: str | None = None, active: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Tick forever (cancel to stop). `active`: skip ticks while another operator leads."""
        await run_rounds(lambda: self.tick_all(namespace), self.config.interval_s, what="autoscaling",
                         active=active)

    async def aclose(self) -> None:
        await self.http.aclose()


def scaling_config_from_env(env: Mapping[str, str] | None = None) -> ScalingConfig:
    """TIDAL_AUTOSCALE_INTERVAL_SECONDS, TIDAL_ROUTER_DEMAND_NAMESPACE (the routers' demand
    Leases), TIDAL_ROUTER_URLS (comma-separated), TIDAL_ROUTER_API_KEY, TIDAL_SCRAPE_TIMEOUT_SECONDS, TIDAL_SCRAPE_CONCURRENCY."""
    env = os.environ if env is None else env
    base = ScalingConfig()
    return ScalingConfig(
        interval_s=float(env.get("TIDAL_AUTOSCALE_INTERVAL_SECONDS") or base.interval_s),
        scrape_timeout_s=float(env.get("TIDAL_SCRAPE_TIMEOUT_SECONDS") or base.scrape_timeout_s),
        scrape_concurrency=int(env.get("TIDAL_SCRAPE_CONCURRENCY") or base.scrape_concurrency),
        router_urls=tuple(u.strip() for u in (env.get("TIDAL_ROUTER_URLS") or "").split(",") if u.strip()),
        router_api_key=env.get("TIDAL_ROUTER_API_KEY") or None,
        router_demand_namespace=env.get("TIDAL_ROUTER_DEMAND_NAMESPACE") or None,
    )


# --- mode hpa | keda: the objects an external autoscaler needs (pure) --------------------------

# prometheus-adapter turns `tidal:num_requests_waiting` into a Pods metric; its default rules
# replace ':' and keep the name otherwise. docs/autoscaling.md has the adapter rule.
PROMETHEUS_METRIC = {
    "requestsWaiting": "tidal:num_requests_waiting",
    "requestsInFlight": "tidal:num_requests_in_flight",  # a recording rule: running + waiting
    "kvCacheUsage": "tidal:kv_cache_usage_perc",
}
# The adapter rule (docs/autoscaling.md) exposes either engine prefix under these names.
ADAPTER_METRIC = {
    "requestsWaiting": "tidal_num_requests_waiting",
    "requestsInFlight": "tidal_num_requests_in_flight",
    "kvCacheUsage": "tidal_kv_cache_usage_perc",
}


def engine_metrics_prefix(engine_args: Sequence[str]) -> str:
    """The prefix the engines' metric families carry: `vllm` when `spec.engine.args` pass
    `--metrics-prefix vllm` (the last one wins, as in argparse), else `tidal`."""
    prefix = "tidal"
    for i, arg in enumerate(engine_args):
        if arg == "--metrics-prefix" and i + 1 < len(engine_args):
            prefix = engine_args[i + 1]
        elif arg.startswith("--metrics-prefix="):
            prefix = arg.split("=", 1)[1]
    return "vllm" if prefix == "vllm" else "tidal"


def _owner(llm: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = llm.get("metadata") or {}
    if not meta.get("uid"):
        return []
    return [{"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"], "uid": meta["uid"],
             "controller": True, "blockOwnerDeletion": True}]


def _meta(llm: Mapping[str, Any], suffix: str = "") -> dict[str, Any]:
    meta = llm.get("metadata") or {}
    out: dict[str, Any] = {"name": meta["name"] + suffix, "namespace": meta.get("namespace") or "default",
                           "labels": {L.LLMSERVICE: meta["name"], L.MANAGED_BY: L.MANAGED_BY_VALUE}}
    owners = _owner(llm)
    if owners:
        out["ownerReferences"] = owners
    return out


def _target_quantity(metric: str, target: float) -> str:
    # Quantities: a fraction as milli-units ("800m"), whole numbers plain.
    if float(target).is_integer():
        return str(int(target))
    return f"{int(round(target * 1000))}m"


def hpa_manifest(llm: Mapping[str, Any], spec: LLMServiceSpec) -> dict[str, Any]:
    """autoscaling/v2 HPA that scales the LLMService through its scale subresource."""
    a = spec.autoscaling
    if a is None:
        raise ValueError("spec.autoscaling is required")
    behavior: dict[str, Any] = {
        "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": a.scale_down_delay_seconds},
    }
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(llm),
        "spec": {
            "scaleTargetRef": {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": llm["metadata"]["name"]},
            # The HPA can't scale to 0 without the HPAScaleToZero feature gate: min 1 here.
            "minReplicas": max(1, a.min_replicas), "maxReplicas": a.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": ADAPTER_METRIC[a.metric]},
                "target": {"type": "AverageValue", "averageValue": _target_quantity(a.metric, a.target)}}}],
            "behavior": behavior,
        },
    }


def keda_scaled_object(llm: Mapping[str, Any], spec: LLMServiceSpec, *,
                       prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090") -> dict[str, Any]:
    """keda.sh/v1alpha1 ScaledObject with a prometheus trigger (KEDA can scale to zero)."""
    a = spec.autoscaling
    if a is None:
        raise ValueError("spec.autoscaling is required")
    meta = llm["metadata"]
    namespace = meta.get("namespace") or "default"
    prefix = engine_metrics_prefix(spec.engine.args)
    selector = f'namespace="{namespace}",{L.LLMSERVICE.replace(".", "_").replace("/", "_")}="{meta["name"]}"'
    if a.metric == "requestsInFlight":
        query = (f"sum({prefix}:num_requests_running{{{selector}}}) + sum({prefix}:num_requests_waiting{{{selector}}})")
    else:
        series = PROMETHEUS_METRIC[a.metric].replace("tidal:", f"{prefix}:", 1)
        query = f"sum({series}{{{selector}}})"
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(llm),
        "spec": {
            "scaleTargetRef": {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"]},
            "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
            "pollingInterval": 15, "cooldownPeriod": max(a.scale_down_delay_seconds, 1),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_delay_seconds}}}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": prometheus_url, "query": query, "threshold": f"{a.target:g}"}}],
        },
    }


def pod_monitor(llm: Mapping[str, Any], spec: LLMServiceSpec) -> dict[str, Any]:
    """monitoring.coreos.com/v1 PodMonitor scraping the engines (with their API key)."""
    meta = llm["metadata"]
    endpoint: dict[str, Any] = {"port": "http", "path": "/metrics", "interval": "15s",
                                # Keep the LLMService's name on every series (the KEDA query uses it).
                                "relabelings": [{"sourceLabels": [f"__meta_kubernetes_pod_label_"
                                                                  f"{L.LLMSERVICE.replace('.', '_').replace('/', '_')}"],
                                                 "targetLabel": L.LLMSERVICE.replace(".", "_").replace("/", "_")}]}
    if spec.auth is not None:
        ref = spec.auth.api_key_secret_ref
        endpoint["authorization"] = {"type": "Bearer", "credentials": {"name": ref.name, "key": ref.key}}
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": _meta(llm, "-engines"),
        "spec": {"selector": {"matchLabels": L.selector_labels(meta["name"])}, "podMetricsEndpoints": [endpoint]},
    }
