"""The router's in-memory view of models and their replicas.

The state is an immutable value (`RegistryState`) changed only by pure functions of
Kubernetes watch events, so the rules are unit-testable without a cluster. `Registry` holds
the current state for the running process and wakes up anyone waiting for a change
(held requests wait for a replica to become routable). `KubernetesWatcher` feeds it from
the API server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Iterable, Literal, Mapping

from tidal_operator import labels as L
from tidal_operator.secret_refs import secret_value

log = logging.getLogger("tidal.router.registry")

RoutingStrategyName = Literal["leastLoad", "prefixHash"]
DEFAULT_ENGINE_PORT = 8000
DEFAULT_API_KEY_KEY = "api-key"
HTTP_PORT_NAME = "http"

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class SecretRef:
    namespace: str
    name: str
    key: str = DEFAULT_API_KEY_KEY


@dataclass(frozen=True)
class Replica:
    pod_name: str
    namespace: str
    llmservice: str
    url: str | None  # None until the Pod has an IP
    ready: bool
    sleep_state: str = L.SLEEP_AWAKE
    adapters: frozenset[str] = frozenset()
    deleting: bool = False
    # False when the Pod carries no tidal.dev/adapters annotation: nothing is known about
    # what it loaded, so it is assumed to serve every adapter its LLMService lists.
    adapters_announced: bool = False
    resource_version: str = ""
    owner_uid: str | None = None  # the uid of the LLMService that controls the Pod (ownerReferences)

    @property
    def key(self) -> Key:
        return (self.namespace, self.pod_name)

    @property
    def awake(self) -> bool:
        return self.sleep_state == L.SLEEP_AWAKE

    @property
    def routable(self) -> bool:
        """May receive requests now."""
        return self.ready and self.awake and not self.deleting and self.url is not None

    @property
    def wakeable(self) -> bool:
        """Running but asleep: a wake_up makes it routable without a new Pod."""
        return self.ready and not self.awake and not self.deleting and self.url is not None


@dataclass(frozen=True)
class ServiceView:
    """What the router needs from one LLMService."""

    name: str
    namespace: str
    served_name: str
    adapters: frozenset[str] = frozenset()
    routing_strategy: RoutingStrategyName = "leastLoad"
    api_key_secret: SecretRef | None = None
    # "<reason>: <message>" when its status says it cannot become Ready without a change
    # (an invalid spec, a served name another namespace holds): requests fail fast.
    not_servable: str | None = None
    # Adapters whose load failed on every replica: (name, first error) pairs.
    failed_adapters: tuple[tuple[str, str], ...] = ()
    uid: str | None = None  # traffic and the engine key go only to Pods this uid controls
    created: str = ""  # creationTimestamp: the earliest claim on a name keeps it
    gpu_share_group: str | None = None  # spec.gpuShare.group (docs/gpu-sharing.md)
    gpu_share: float = 1.0  # its share of the device while awake

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class ModelEntry:
    """A served model (or one of its adapters) joined with its current replicas."""

    llmservice: str
    namespace: str
    served_name: str
    adapters: frozenset[str]
    routing_strategy: RoutingStrategyName
    api_key_secret: SecretRef | None
    replicas: tuple[Replica, ...]
    adapter: str | None = None  # set when the request named an adapter, not the base model
    not_servable: str | None = None
    failed_adapters: tuple[tuple[str, str], ...] = ()
    gpu_share_group: str | None = None
    gpu_share: float = 1.0

    @property
    def model_name(self) -> str:
        return self.adapter or self.served_name

    def eligible(self) -> tuple[Replica, ...]:
        """Replicas that can serve this model (or adapter), in any readiness/sleep state."""
        if self.adapter is None:
            return self.replicas
        return tuple(r for r in self.replicas
                     if self.adapter in r.adapters or (not r.adapters_announced and self.adapter in self.adapters))

    def routable(self) -> tuple[Replica, ...]:
        return tuple(r for r in self.eligible() if r.routable)

    def failure(self) -> str | None:
        """Why no replica can serve this model until something changes; None if one may."""
        if self.not_servable:
            return f"LLMService {self.namespace}/{self.llmservice} cannot become ready: {self.not_servable}"
        if self.adapter is not None:
            error = dict(self.failed_adapters).get(self.adapter)
            if error is not None:
                return (f"LoRA adapter '{self.adapter}' of LLMService {self.namespace}/{self.llmservice} failed to "
                        f"load on every replica: {error}")
        return None

    def wakeable(self) -> tuple[Replica, ...]:
        return tuple(r for r in self.eligible() if r.wakeable)


def _frozen(d: dict[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(d)


@dataclass(frozen=True)
class RegistryState:
    services: Mapping[Key, ServiceView] = field(default_factory=lambda: _frozen({}))
    pods: Mapping[Key, Replica] = field(default_factory=lambda: _frozen({}))
    # Sleep states the router observed itself (it woke the engine, or the engine answered
    # "sleeping"), by Pod key -> (resourceVersion then, state). An override holds until the
    # Pod object changes again: a wake is routable at once, before any label is updated,
    # and a later change by the idle controller (a new version) wins.
    sleep_overrides: Mapping[Key, tuple[str, str]] = field(default_factory=lambda: _frozen({}))

    # --- queries ---------------------------------------------------------------------

    def replicas_of(self, namespace: str, llmservice: str, uid: str | None = None) -> tuple[Replica, ...]:
        """The LLMService's Pods: its label, and (when its uid is known) controlled by it, so a
        Pod anyone labelled gets neither requests nor the engine key."""
        found = (self._effective(r) for r in self.pods.values()
                 if r.namespace == namespace and r.llmservice == llmservice and (uid is None or r.owner_uid == uid))
        return tuple(sorted(found, key=lambda r: r.pod_name))

    def _effective(self, replica: Replica) -> Replica:
        override = self.sleep_overrides.get(replica.key)
        if override is not None and override[0] == replica.resource_version:
            return replace(replica, sleep_state=override[1])
        return replica

    def lookup(self, model: str) -> ModelEntry | None:
        """Resolve a request's `model`: a served name first, then an adapter name. Two
        LLMServices claiming one name: the earliest created keeps it (the operator marks the
        later one ServedNameConflict), ties by namespace/name."""
        services = sorted(self.services.values(), key=lambda s: (s.created, s.key))
        for svc in services:
            if svc.served_name == model:
                return self._entry(svc, None)
        for svc in services:
            if model in svc.adapters:
                return self._entry(svc, model)
        return None

    def _entry(self, svc: ServiceView, adapter: str | None) -> ModelEntry:
        return ModelEntry(llmservice=svc.name, namespace=svc.namespace, served_name=svc.served_name,
                          adapters=svc.adapters, routing_strategy=svc.routing_strategy,
                          api_key_secret=svc.api_key_secret,
                          replicas=self.replicas_of(svc.namespace, svc.name, svc.uid),
                          adapter=adapter, not_servable=svc.not_servable, failed_adapters=svc.failed_adapters,
                          gpu_share_group=svc.gpu_share_group, gpu_share=svc.gpu_share)

    def model_names(self) -> list[str]:
        names: set[str] = set()
        for svc in self.services.values():
            names.add(svc.served_name)
            names.update(svc.adapters)
        return sorted(names)

    def entries(self) -> list[ModelEntry]:
        return [self._entry(svc, None) for svc in sorted(self.services.values(), key=lambda s: s.key)]


# --- reading objects ------------------------------------------------------------------

# Ready=False reasons that no wait can fix: the spec (or another namespace) must change.
NOT_SERVABLE_REASONS = frozenset({"InvalidSpec", "ServedNameConflict"})


def _not_servable(meta: Mapping[str, Any], status: Mapping[str, Any]) -> str | None:
    for cond in status.get("conditions") or []:
        if not isinstance(cond, Mapping) or cond.get("type") != "Ready" or cond.get("status") != "False":
            continue
        seen = cond.get("observedGeneration")
        if seen is not None and meta.get("generation") is not None and seen != meta["generation"]:
            return None  # written for an older spec: the new one may be fine
        if cond.get("reason") in NOT_SERVABLE_REASONS:
            return f"{cond['reason']}: {cond.get('message') or ''}".rstrip(": ")
    return None


def _failed_adapters(status: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Adapters with an error and no replica that loaded them (status.adapters, written by
    the operator's LoRA sync)."""
    out = []
    for entry in status.get("adapters") or []:
        if not isinstance(entry, Mapping) or not entry.get("name"):
            continue
        replicas = [r for r in entry.get("replicas") or [] if isinstance(r, Mapping)]
        errors = [str(e) for e in entry.get("errors") or []]
        if errors and not entry.get("loadedReplicas") and all(r.get("state") == "Failed" for r in replicas):
            out.append((str(entry["name"]), errors[0]))
    return tuple(sorted(out))


def service_from_object(obj: Mapping[str, Any]) -> ServiceView:
    """Read an LLMService body leniently: the router must keep routing even if a field it
    doesn't need fails the operator's stricter validation."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name, namespace = meta["name"], meta.get("namespace") or "default"
    model = spec.get("model") or {}
    lora = spec.get("lora") or {}
    adapters = frozenset(a["name"] for a in lora.get("adapters") or [] if isinstance(a, Mapping) and a.get("name"))
    strategy = (spec.get("routing") or {}).get("strategy") or "leastLoad"
    if strategy not in ("leastLoad", "prefixHash"):
        strategy = "leastLoad"
    secret = None
    ref = ((spec.get("auth") or {}).get("apiKeySecretRef")) or None
    if ref and ref.get("name"):
        secret = SecretRef(namespace, ref["name"], ref.get("key") or DEFAULT_API_KEY_KEY)
    status = obj.get("status") or {}
    group, share = _gpu_share(spec)
    return ServiceView(name=name, namespace=namespace, served_name=model.get("servedName") or name,
                       adapters=adapters, routing_strategy=strategy, api_key_secret=secret,
                       not_servable=_not_servable(meta, status), failed_adapters=_failed_adapters(status),
                       uid=meta.get("uid") or None, created=str(meta.get("creationTimestamp") or ""),
                       gpu_share_group=group, gpu_share=share)


def _gpu_share(spec: Mapping[str, Any]) -> tuple[str | None, float]:
    """spec.gpuShare read leniently: (group, share of the device), share as the operator
    derives it (memoryFraction, else engine.gpuMemoryUtilization, else 1)."""
    share_spec = spec.get("gpuShare")
    if not isinstance(share_spec, Mapping) or not share_spec.get("group"):
        return None, 1.0
    engine = spec.get("engine") if isinstance(spec.get("engine"), Mapping) else {}
    for value in (share_spec.get("memoryFraction"), engine.get("gpuMemoryUtilization")):
        if isinstance(value, (int, float)) and 0 < value <= 1:
            return str(share_spec["group"]), float(value)
    return str(share_spec["group"]), 1.0


def parse_adapters_annotation(value: str | None) -> frozenset[str] | None:
    """tidal.dev/adapters: a JSON list of names (or objects with `name`), or a comma-separated
    list. None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return None
        names = (i.get("name") if isinstance(i, Mapping) else i for i in items)
        return frozenset(str(n) for n in names if n)
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def _pod_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == HTTP_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_ENGINE_PORT


def replica_from_pod(pod: Mapping[str, Any]) -> Replica | None:
    """None for Pods that aren't engine Pods of an LLMService."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    llm = labels.get(L.LLMSERVICE)
    if not llm:
        return None
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    adapters = parse_adapters_annotation(annotations.get(L.ADAPTERS))
    sleep_state = labels.get(L.SLEEP_STATE, L.SLEEP_AWAKE)
    if sleep_state not in L.SLEEP_STATES:
        sleep_state = L.SLEEP_AWAKE
    owner = next((o.get("uid") for o in meta.get("ownerReferences") or []
                  if o.get("controller") and o.get("kind") == L.KIND), None)
    return Replica(pod_name=meta["name"], namespace=meta.get("namespace") or "default", llmservice=llm,
                   url=f"http://{ip}:{_pod_port(pod)}" if ip else None, ready=ready, sleep_state=sleep_state,
                   adapters=adapters or frozenset(), deleting=bool(meta.get("deletionTimestamp")),
                   adapters_announced=adapters is not None, resource_version=str(meta.get("resourceVersion") or ""),
                   owner_uid=owner)


def _obj_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "default", meta["name"])


# --- pure updates ---------------------------------------------------------------------

def apply_llmservice_event(state: RegistryState, event: Mapping[str, Any]) -> RegistryState:
    """Apply one watch event ({"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": {...}})."""
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind not in ("ADDED", "MODIFIED", "DELETED"):
        return state
    services = dict(state.services)
    key = _obj_key(obj)
    if kind == "DELETED":
        services.pop(key, None)
    else:
        services[key] = service_from_object(obj)
    return replace(state, services=_frozen(services))


def apply_pod_event(state: RegistryState, event: Mapping[str, Any]) -> RegistryState:
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind not in ("ADDED", "MODIFIED", "DELETED"):
        return state
    pods = dict(state.pods)
    overrides = dict(state.sleep_overrides)
    key = _obj_key(obj)
    replica = replica_from_pod(obj) if kind != "DELETED" else None
    if replica is None:
        pods.pop(key, None)
        overrides.pop(key, None)
    else:
        pods[key] = replica
        if key in overrides and overrides[key][0] != replica.resource_version:
            del overrides[key]  # the Pod moved on; its labels are the truth again
    return replace(state, pods=_frozen(pods), sleep_overrides=_frozen(overrides))


def replace_llmservices(state: RegistryState, objects: Iterable[Mapping[str, Any]]) -> RegistryState:
    """A fresh list (after a restart or 410 Gone) replaces everything known before."""
    services = {_obj_key(o): service_from_object(o) for o in objects}
    return replace(state, services=_frozen(services))


def replace_pods(state: RegistryState, objects: Iterable[Mapping[str, Any]]) -> RegistryState:
    fresh = RegistryState()
    for obj in objects:
        fresh = apply_pod_event(fresh, {"type": "ADDED", "object": obj})
    overrides = {k: v for k, v in state.sleep_overrides.items()
                 if k in fresh.pods and fresh.pods[k].resource_version == v[0]}
    return replace(state, pods=fresh.pods, sleep_overrides=_frozen(overrides))


def observe_sleep_state(state: RegistryState, replica: Replica, sleep_state: str) -> RegistryState:
    """The router learnt a replica's sleep state from the engine itself (`is_sleeping`, or a
    503 engine_sleeping): believe it until the Pod object changes."""
    current = state.pods.get(replica.key)
    if current is None:
        return state
    overrides = dict(state.sleep_overrides)
    if current.sleep_state == sleep_state:
        overrides.pop(replica.key, None)
    else:
        overrides[replica.key] = (current.resource_version, sleep_state)
    return replace(state, sleep_overrides=_frozen(overrides))


# --- the live registry ------------------------------------------------------------------

class Registry:
    """The current state plus change notification and engine API keys.

    Engine keys live beside the state, never in it, so they can't end up in a repr or log.
    """

    def __init__(self, state: RegistryState | None = None) -> None:
        self._state = state or RegistryState()
        self._changed = asyncio.Event()
        self.version = 0
        self._secrets: dict[SecretRef, str] = {}

    @property
    def state(self) -> RegistryState:
        return self._state

    def update(self, fn: Callable[[RegistryState], RegistryState]) -> None:
        new = fn(self._state)
        if new is self._state:
            return
        self._state = new
        self.version += 1
        # Swap in a fresh Event so waiters of this version all wake, later ones block.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def apply_llmservice_event(self, event: Mapping[str, Any]) -> None:
        self.update(lambda s: apply_llmservice_event(s, event))

    def apply_pod_event(self, event: Mapping[str, Any]) -> None:
        self.update(lambda s: apply_pod_event(s, event))

    def observe_sleep_state(self, replica: Replica, sleep_state: str) -> None:
        self.update(lambda s: observe_sleep_state(s, replica, sleep_state))

    async def wait_changed(self, since_version: int) -> None:
        """Return once the state is newer than `since_version` (immediately if it already is)."""
        while self.version <= since_version:
            await self._changed.wait()

    def lookup(self, model: str) -> ModelEntry | None:
        return self._state.lookup(model)

    # engine API keys ----------------------------------------------------------------
    def secret_refs(self) -> set[SecretRef]:
        return set(self._secrets)

    def set_secret(self, ref: SecretRef, value: str | None) -> None:
        if value is None:
            self._secrets.pop(ref, None)
        else:
            self._secrets[ref] = value

    def engine_api_key(self, entry: ModelEntry) -> str | None:
        if entry.api_key_secret is None:
            return None
        return self._secrets.get(entry.api_key_secret)


# --- feeding it from Kubernetes -----------------------------------------------------------

ROUTER_SECRET = "tidal.dev/router-secret"  # the operator's key copies (controller/router_secrets.py)
SOURCE_SECRET = "tidal.dev/source-secret"
SOURCE_KEY = "tidal.dev/source-key"
NAMESPACE_ANNOTATION = "tidal.dev/namespace"
ClientKeysSink = Callable[[str, list[str]], None]  # (namespace, keys): ApiKeys.set_namespace


class KeyCopies:
    """The operator's copies of engine keys and namespace client keys, as watched in the
    router's own namespace, applied to the registry and the client-key set."""

    def __init__(self, registry: Registry, client_keys: ClientKeysSink | None) -> None:
        self.registry = registry
        self.client_keys = client_keys
        self._copies: dict[str, Mapping[str, Any]] = {}

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        self._apply({(o.get("metadata") or {}).get("name", ""): o for o in items})

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        copies = dict(self._copies)
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "DELETED":
            copies.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            copies[name] = obj
        self._apply(copies)

    def _apply(self, copies: dict[str, Mapping[str, Any]]) -> None:
        engine: dict[SecretRef, str] = {}
        tenants: dict[str, list[str]] = {}
        for obj in copies.values():
            meta = obj.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            kind = (meta.get("labels") or {}).get(ROUTER_SECRET)
            if kind == "engine-key" and SOURCE_SECRET in annotations:
                namespace, _, name = annotations[SOURCE_SECRET].partition("/")
                value = secret_value(obj, "api-key")
                if value:
                    engine[SecretRef(namespace, name, annotations.get(SOURCE_KEY) or DEFAULT_API_KEY_KEY)] = value
            elif kind == "client-keys" and annotations.get(NAMESPACE_ANNOTATION):
                # Several Secrets may hold one namespace's keys; each opens that namespace only.
                values = [secret_value(obj, k) for k in sorted((obj.get("data") or {}))]
                tenants.setdefault(annotations[NAMESPACE_ANNOTATION], []).extend(v for v in values if v)
        for ref in self.registry.secret_refs() - engine.keys():
            self.registry.set_secret(ref, None)
        for ref, value in engine.items():
            self.registry.set_secret(ref, value)
        if self.client_keys is not None:
            before = {self._namespace_of(o) for o in self._copies.values()} - {None}
            for namespace in before - tenants.keys():
                self.client_keys(str(namespace), [])
            for namespace, keys in tenants.items():
                self.client_keys(namespace, keys)
        self._copies = copies

    @staticmethod
    def _namespace_of(obj: Mapping[str, Any]) -> str | None:
        return ((obj.get("metadata") or {}).get("annotations") or {}).get(NAMESPACE_ANNOTATION)


class KubernetesWatcher:
    """List+watch LLMServices and engine Pods into a Registry, forever, and (with
    `keys_namespace`) the operator's copies of engine and client keys in that one namespace:
    the router reads no Secret anywhere else.

    Each watch resumes from the last resourceVersion; on 410 Gone or any error it relists
    (which replaces the state, so objects deleted during the gap disappear) after a jittered,
    growing backoff.
    """

    def __init__(self, registry: Registry, api_client: Any, *, namespace: str | None = None,
                 watch_timeout_s: int = 300, max_backoff_s: float = 30.0, keys_namespace: str | None = None,
                 client_keys: ClientKeysSink | None = None) -> None:
        from kubernetes_asyncio import client as k8s

        self.registry = registry
        self.namespace = namespace
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s
        self._api_client = api_client
        self._custom = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self.synced = asyncio.Event()  # every list done at least once
        self._synced_kinds: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.keys_namespace = keys_namespace
        self.kinds = ("llmservices", "pods") + (("secrets",) if keys_namespace else ())
        self.copies = KeyCopies(registry, client_keys)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(kind), name=f"router-watch-{kind}") for kind in self.kinds]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    # list / watch calls -------------------------------------------------------------
    def _list_call(self, kind: str) -> tuple[Callable[..., Any], dict[str, Any]]:
        if kind == "llmservices":
            if self.namespace:
                return self._custom.list_namespaced_custom_object, dict(
                    group=L.GROUP, version=L.VERSION, namespace=self.namespace, plural=L.PLURAL)
            return self._custom.list_cluster_custom_object, dict(group=L.GROUP, version=L.VERSION, plural=L.PLURAL)
        if kind == "secrets":
            return self._core.list_namespaced_secret, dict(namespace=self.keys_namespace, label_selector=ROUTER_SECRET)
        selector = dict(label_selector=L.LLMSERVICE)
        if self.namespace:
            return self._core.list_namespaced_pod, dict(namespace=self.namespace, **selector)
        return self._core.list_pod_for_all_namespaces, selector

    def _to_dict(self, obj: Any) -> dict[str, Any]:
        return obj if isinstance(obj, dict) else self._api_client.sanitize_for_serialization(obj)

    async def _run(self, kind: str) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        backoff = 0.5
        while True:
            try:
                func, kwargs = self._list_call(kind)
                listing = self._to_dict(await func(**kwargs))
                items = listing.get("items") or []
                await self._replace(kind, items)
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                self._synced_kinds.add(kind)
                if len(self._synced_kinds) == len(self.kinds):
                    self.synced.set()
                backoff = 0.5
                while True:  # each round ends at timeout_seconds; resume from the last version
                    w = watch.Watch()
                    async with w.stream(func, resource_version=rv, timeout_seconds=self.watch_timeout_s,
                                        allow_watch_bookmarks=True, **kwargs) as stream:
                        async for event in stream:
                            obj = self._to_dict(event["object"])
                            await self._apply(kind, {"type": event["type"], "object": obj})
                            rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    log.info("%s watch expired (410 Gone); relisting", kind)
                    continue
                log.warning("%s watch failed: %s %s; retrying in %.1fs", kind, exc.status, exc.reason, backoff)
            except Exception as exc:  # network errors, API server restarts
                log.warning("%s watch failed: %r; retrying in %.1fs", kind, exc, backoff)
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        if kind == "llmservices":
            self.registry.update(lambda s: replace_llmservices(s, items))
        elif kind == "secrets":
            self.copies.replace(items)
        else:
            self.registry.update(lambda s: replace_pods(s, items))

    async def _apply(self, kind: str, event: dict[str, Any]) -> None:
        if kind == "llmservices":
            self.registry.apply_llmservice_event(event)
        elif kind == "secrets":
            self.copies.event(event["type"], event["object"])
        else:
            self.registry.apply_pod_event(event)
