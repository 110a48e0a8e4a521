"""The LoRA controller: make every running replica serve exactly the adapters in spec.lora.adapters.

For one LLMService, ``AdapterSync.sync(llm)``:

1. lists its engine Pods and asks each Ready one which adapters it has (``GET /v1/models``,
   adapters are the entries with a ``parent``): the engine is the truth, so a replica that
   restarted (empty list) gets everything again, and one that slept keeps what it had;
2. plans each replica (``reconcile.adapters.plan_replica``) and runs the plan through the
   engine API (``/v1/unload_lora_adapter``, ``/v1/load_lora_adapter``), replicas concurrently;
3. writes each Pod's ``tidal.dev/adapters`` annotation (what the router trusts), then
   ``status.adapters`` and the ``AdaptersReady`` condition, and an Event per new failure.

No Pod is restarted: the adapter list is outside the spec hash. ``AdapterSyncLoop`` runs
``sync`` for every LLMService with ``spec.lora`` on an interval (started once, like the
autoscaler's loop), which is also what picks up restarted or woken replicas; a kopf handler
calls ``sync`` when spec.lora changes so a spec change applies at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Mapping

import httpx

from . import labels as L
from .api.types import OperatorConfig
from .api.validation import parse_spec
from .engine_client import EngineClient, EngineError
from .kube import MANAGER_ADAPTERS, ApiError
from .loops import run_rounds
from .reconcile.adapters import (
    AdapterTarget,
    ReplicaObservation,
    ReplicaResult,
    adapters_status,
    annotation_value,
    desired_adapters,
    loaded_after,
    plan_replica,
    pod_annotation,
    pod_is_ready,
    predates_lora,
)
from .scaling.controller import ClusterApi
from .secret_refs import engine_api_key

log = logging.getLogger("tidal.adapters")

ClientFactory = Callable[[str, "str | None"], EngineClient]


@dataclass(frozen=True)
class AdapterSyncConfig:
    interval_s: float = 10.0
    list_timeout_s: float = 5.0
    load_timeout_s: float = 120.0  # reading and validating an adapter from disk


@dataclass
class SyncOutcome:
    """What one sync did (tests and logs)."""

    loaded: dict[str, list[str]]  # pod → adapters loaded this sync
    unloaded: dict[str, list[str]]
    errors: dict[str, dict[str, str]]  # pod → {adapter: message}
    status: dict[str, Any]


class AdapterSync:
    def __init__(self, cluster: ClusterApi, *, operator_config: OperatorConfig | None = None,
                 config: AdapterSyncConfig | None = None, client_factory: ClientFactory | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.cluster = cluster
        self.operator_config = operator_config or OperatorConfig()
        self.config = config or AdapterSyncConfig()
        self.clock = clock
        self._http: httpx.AsyncClient | None = None
        self._client_factory = client_factory

    def _client(self, base_url: str, api_key: str | None) -> EngineClient:
        if self._client_factory is not None:
            return self._client_factory(base_url, api_key)
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.list_timeout_s)
        return EngineClient(base_url, api_key, timeout_s=self.config.list_timeout_s, http=self._http)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def sync(self, llm: Mapping[str, Any]) -> SyncOutcome | None:
        """One pass for one LLMService body. None when it has no (valid) LoRA spec."""
        meta = llm.get("metadata") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace") or "default"
        spec, _ = parse_spec(llm.get("spec") or {})
        if spec is None or spec.lora is None:
            return None
        targets = desired_adapters(spec, self.operator_config)
        pods = [p for p in await self.cluster.list_pods(namespace, L.selector_string(name))
                if not (p.get("metadata") or {}).get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
        rolling_out = [p for p in pods if predates_lora(p, spec, self.operator_config)]
        pods = [p for p in pods if p not in rolling_out]
        for old in rolling_out:  # announce it serves none, so the router sends it no adapter request
            if L.ADAPTERS not in ((old.get("metadata") or {}).get("annotations") or {}):
                await self.cluster.patch_pod(namespace, old["metadata"]["name"],
                                             {"metadata": {"annotations": {L.ADAPTERS: annotation_value({})}}})
        api_key = await engine_api_key(self.cluster.read_secret, namespace, spec)
        port = spec.engine.port
        outcome = SyncOutcome({}, {}, {}, {})
        results = await asyncio.gather(*(self._sync_pod(namespace, pod, port, api_key, targets, outcome)
                                         for pod in pods))
        status = llm.get("status") or {}
        previous_entries = list(status.get("adapters") or [])  # copied: the patch may update `llm` in place
        entries, condition = adapters_status(targets, results, status.get("conditions"),
                                             meta.get("generation"), self.clock())
        # Server-side apply with its own field manager: only `adapters` and the AdaptersReady
        # condition are this controller's; the reconcile's conditions are never written here.
        outcome.status = {"adapters": entries, "conditions": [condition]}
        try:
            await self.cluster.apply_llmservice_status(namespace, name, outcome.status, manager=MANAGER_ADAPTERS)
        except ApiError as exc:
            if exc.not_found:
                return None  # deleted meanwhile
            raise
        await self._events(llm, previous_entries, entries, outcome)
        return outcome

    async def _sync_pod(self, namespace: str, pod: Mapping[str, Any], port: int, api_key: str | None,
                        targets: list[AdapterTarget], outcome: SyncOutcome) -> ReplicaResult:
        pod_name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        ready = pod_is_ready(pod) and bool(ip)
        annotated = pod_annotation(pod)
        engine_adapters: frozenset[str] | None = None
        client = self._client(f"http://{ip}:{port}", api_key) if ready else None
        errors: dict[str, str] = {}
        unloaded: list[str] = []
        loaded: list[str] = []
        try:
            if client is not None:
                try:
                    engine_adapters = await _list_adapters(client, self.config.list_timeout_s)
                except EngineError as exc:
                    log.warning("adapters: cannot list the adapters of %s/%s: %s", namespace, pod_name, exc)
            observed = ReplicaObservation(pod_name, ready, engine_adapters, annotated)
            plan = plan_replica(targets, observed)
            assert client is not None or not (plan.load or plan.unload)
            for adapter in plan.unload:
                try:
                    await client.unload_lora(adapter, timeout_s=self.config.load_timeout_s)  # type: ignore[union-attr]
                    unloaded.append(adapter)
                except EngineError as exc:
                    if exc.status == 404:
                        unloaded.append(adapter)  # gone already: what we wanted
                    else:
                        errors[adapter] = f"unload failed: {exc}"
            for target in plan.load:
                if target.name in errors:
                    continue  # its old version could not be unloaded
                try:
                    await client.load_lora(target.name, target.engine_path or "",  # type: ignore[union-attr]
                                           timeout_s=self.config.load_timeout_s)
                    loaded.append(target.name)
                except EngineError as exc:
                    errors[target.name] = _engine_message(exc)
            now_loaded = loaded_after(targets, observed, plan, unloaded, loaded)
        finally:
            if client is not None and self._client_factory is not None:
                await client.aclose()
        if now_loaded != annotated or L.ADAPTERS not in ((pod.get("metadata") or {}).get("annotations") or {}):
            await self.cluster.patch_pod(namespace, pod_name,
                                         {"metadata": {"annotations": {L.ADAPTERS: annotation_value(now_loaded)}}})
        if loaded:
            outcome.loaded[pod_name] = loaded
        if unloaded:
            outcome.unloaded[pod_name] = unloaded
        if errors:
            outcome.errors[pod_name] = errors
        if loaded or unloaded or errors:
            log.info("adapters: %s/%s loaded %s, unloaded %s, errors %s", namespace, pod_name, loaded, unloaded,
                     errors)
        return ReplicaResult(pod_name, ready and engine_adapters is not None, now_loaded, errors)

    async def _events(self, llm: Mapping[str, Any], previous: list[Mapping[str, Any]],
                      entries: list[dict[str, Any]], outcome: SyncOutcome) -> None:
        # One Warning per error not reported last time (status carries it until it clears).
        before = {e.get("name"): set(e.get("errors") or []) for e in previous if isinstance(e, Mapping)}
        for entry in entries:
            for error in entry["errors"]:
                if error not in before.get(entry["name"], set()):
                    await self.cluster.post_event(llm, type_="Warning", reason="AdapterLoadFailed",
                                                  message=f"adapter {entry['name']}: {error}"[:1000])
        for pod, names in outcome.loaded.items():
            await self.cluster.post_event(llm, type_="Normal", reason="AdaptersLoaded",
                                          message=f"pod {pod}: loaded {', '.join(names)}")
        for pod, names in outcome.unloaded.items():
            await self.cluster.post_event(llm, type_="Normal", reason="AdaptersUnloaded",
                                          message=f"pod {pod}: unloaded {', '.join(names)}")


async def _list_adapters(client: EngineClient, timeout_s: float) -> frozenset[str]:
    """The adapter names an engine serves: /v1/models entries that name a parent."""
    response = await client._request("GET", "/v1/models", timeout_s=timeout_s)  # noqa: SLF001 - no public list call yet
    try:
        data = response.json().get("data") or []
    except (ValueError, AttributeError):
        raise EngineError(f"GET {client.base_url}/v1/models: not a model list") from None
    return frozenset(m["id"] for m in data if isinstance(m, Mapping) and m.get("parent") and isinstance(m.get("id"), str))


def _engine_message(exc: EngineError) -> str:
    # "POST http://ip:port/v1/load_lora_adapter: HTTP 400: <engine's message>" → the message.
    text = str(exc)
    marker = f"HTTP {exc.status}: " if exc.status else ""
    return text.split(marker, 1)[1] if marker and marker in text else text


class AdapterSyncLoop:
    """Every interval, sync every LLMService that has spec.lora (one task for the operator)."""

    def __init__(self, sync: AdapterSync) -> None:
        self.sync = sync

    async def sync_all(self, namespace: str | None = None) -> None:
        for llm in await self.sync.cluster.list_llmservices(namespace):
            if not isinstance((llm.get("spec") or {}).get("lora"), Mapping):
                continue
            if (llm.get("metadata") or {}).get("deletionTimestamp"):
                continue
            try:
                await self.sync.sync(llm)
            except Exception:  # one broken LLMService must not stop the others
                log.exception("adapters: sync of %s failed", (llm.get("metadata") or {}).get("name"))

    async def run(self, namespace: str | None = None, active: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Sync forever (cancel to stop). `active`: skip rounds while another operator leads."""
        await run_rounds(lambda: self.sync_all(namespace), self.sync.config.interval_s, what="adapter sync",
                         active=active)
