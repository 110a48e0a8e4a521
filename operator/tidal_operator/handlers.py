"""The operator: kopf handlers that reconcile each LLMService into engine Pods and a Service.

    kopf run -m tidal_operator.handlers --all-namespaces     # or: tidal operator

One idempotent function, `reconcile()`, does everything for one LLMService; every trigger
calls it:
- the LLMService is created, its spec changes, or the operator starts (`on.create/update/resume`);
- one of its Pods changes or goes (`on.event` for Pods owned by an LLMService);
- a resync loop, as a safety net for what no event announces (a Secret that appears later,
  a Pod stuck for longer than its startup budget).

State lives only in the cluster: Pod names are deterministic and a retried create answers
AlreadyExists, so an operator killed mid-reconcile and restarted recomputes the same plan and
creates nothing twice. No finalizer: Pods and the Service carry ownerReferences and the
garbage collector removes them with the LLMService (kopf adds its finalizer only for
on.delete handlers, timers and daemons, none of which are used here; hence the resync loop
instead of a kopf timer). See docs/operator.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, Mapping

import kopf

from . import labels as L
from .api.types import LLMServiceSpec, OperatorConfig
from .api.validation import ValidationProblem, parse_spec, validate_spec
from .kube import Kube
from .reconcile.manifests import CONTAINER_NAME, metadata_drift, pod_manifest, pod_name, service_manifest, spec_hash
from .reconcile.pods import PodView, plan_pods
from .reconcile.status import compute_status, desired_replicas

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name) of an LLMService

# Status fields compute_status owns. One it leaves out this time (the endpoint of a spec
# that became invalid) is removed, so status never shows something stale. desiredReplicas
# is left alone: the autoscaler's decision survives an invalid spec.
OWNED_STATUS_FIELDS = ("observedGeneration", "phase", "replicas", "readyReplicas", "updatedReplicas",
                       "sleepingReplicas", "replicasText", "selector", "servedModelName", "specHash",
                       "endpoint", "podEndpoints", "conditions")


# --- configuration ------------------------------------------------------------------------------

ENV_DEFAULT_IMAGE = "TIDAL_DEFAULT_ENGINE_IMAGE"
ENV_ADAPTER_PREFIXES = "TIDAL_ALLOWED_ADAPTER_URI_PREFIXES"
ENV_FILE_ROOTS = "TIDAL_ALLOWED_FILE_ROOTS"
ENV_NAMESPACE = "TIDAL_NAMESPACE"
ENV_RESYNC = "TIDAL_RESYNC_SECONDS"
ENV_KUBECONFIG = "KUBECONFIG"


def _csv(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(x.strip() for x in value.split(",") if x.strip())


def config_from_env(env: Mapping[str, str] | None = None) -> OperatorConfig:
    """OperatorConfig from TIDAL_* variables (`tidal operator` sets them from its flags)."""
    env = os.environ if env is None else env
    base = OperatorConfig()
    return OperatorConfig(
        default_engine_image=env.get(ENV_DEFAULT_IMAGE) or base.default_engine_image,
        allowed_adapter_uri_prefixes=_csv(env.get(ENV_ADAPTER_PREFIXES)) or base.allowed_adapter_uri_prefixes,
        allowed_file_roots=_csv(env.get(ENV_FILE_ROOTS)) or base.allowed_file_roots,
        namespace=env.get(ENV_NAMESPACE) or None,
    )


# --- hooks: where autoscaling (operator/tidal_operator/scaling/) plugs in ---------------------

DesiredReplicasFn = Callable[[Obj, LLMServiceSpec, list[Obj]], Awaitable["int | None"]]


@dataclass
class Hooks:
    """Extension points for other controllers. `desired_replicas(llm, spec, pods)` returns the
    replica count to reconcile to, or None for the default (spec.replicas, or the builtin
    autoscaler's status.desiredReplicas). Set `handlers.HOOKS.desired_replicas = ...`."""

    desired_replicas: DesiredReplicasFn | None = None


HOOKS = Hooks()


# --- one reconcile pass ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    valid: bool
    converged: bool
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()


def referenced_secrets(spec: Mapping[str, Any]) -> list[str]:
    """Names of the Secrets a raw spec refers to (read leniently: it may be invalid)."""
    names = []
    for parent, ref in (("auth", "apiKeySecretRef"), ("model", "hfTokenSecretRef")):
        section = spec.get(parent)
        target = section.get(ref) if isinstance(section, Mapping) else None
        if isinstance(target, Mapping) and isinstance(target.get("name"), str) and target["name"]:
            names.append(target["name"])
    return names


def owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


def owner_name(pod: Mapping[str, Any]) -> str | None:
    """The LLMService that controls this Pod, from its ownerReferences (not its labels, which
    someone may have edited)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == L.KIND and str(ref.get("apiVersion", "")).startswith(
                L.GROUP + "/"):
            return str(ref.get("name"))
    return None


def replica_index(pod_name_: str, llm_name: str, hash_: str) -> int | None:
    """The index in `<llm>-<hash>-<index>`, if the name is one the operator gives."""
    head, _, tail = pod_name_.rpartition("-")
    if not tail.isdigit() or pod_name(llm_name, hash_, int(tail)) != pod_name_:
        return None
    return int(tail)


def spec_drifted(desired: Mapping[str, Any], actual: Mapping[str, Any]) -> bool:
    """A hand-edited engine container (image, command, args): the Pod must be replaced, since
    a Pod's spec can't be put back in place."""
    def engine(pod: Mapping[str, Any]) -> Mapping[str, Any]:
        containers = (pod.get("spec") or {}).get("containers") or []
        return next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
    want, have = engine(desired), engine(actual)
    return any(want.get(k) != have.get(k) for k in ("image", "command", "args"))


def status_patch(new: Mapping[str, Any], old: Mapping[str, Any], *, autoscaler_owns_desired: bool = False) -> Obj | None:
    """The merge patch from `old` to `new` over the fields compute_status owns; None if equal.
    `status.desiredReplicas` has one writer: the builtin autoscaler when it runs for this
    LLMService (`autoscaler_owns_desired`), else the reconcile (spec.replicas, HPA, KEDA)."""
    patch: Obj = {}
    for key in OWNED_STATUS_FIELDS:
        if key in new:
            if old.get(key) != new[key]:
                patch[key] = new[key]
        elif old.get(key) is not None:
            patch[key] = None
    if not autoscaler_owns_desired and "desiredReplicas" in new and old.get("desiredReplicas") != new["desiredReplicas"]:
        patch["desiredReplicas"] = new["desiredReplicas"]
    return patch or None


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


async def reconcile(kube: Kube, config: OperatorConfig, namespace: str, name: str, *,
                    ensure_service: bool = True, now: datetime | None = None, hooks: Hooks = HOOKS) -> Outcome | None:
    """Make the cluster match one LLMService, then say so in its status. Idempotent; safe to
    call at any time, any number of times. Returns None if the LLMService is gone or going."""
    llm = await kube.get_llmservice(namespace, name)
    if llm is None or llm["metadata"].get("deletionTimestamp"):
        return None  # the garbage collector removes what it owned
    now = now or datetime.now(timezone.utc)
    meta, raw_spec = llm["metadata"], llm.get("spec") or {}
    uid, generation = meta["uid"], meta.get("generation")
    old_status = llm.get("status") or {}

    # 1. Validate, Secrets included (existence only).
    existing = {s: await kube.secret_exists(namespace, s) for s in referenced_secrets(raw_spec)}
    problems = validate_spec(raw_spec, name=name, namespace=namespace,
                             secret_lookup=lambda secret: existing.get(secret, True), config=config)
    pods = [p for p in await kube.list_pods(namespace, L.selector_string(name)) if owned_by(p, uid)]
    if problems:
        await _write_invalid_status(kube, config, llm, pods, problems, generation, now)
        return Outcome(valid=False, converged=False)
    if _condition(old_status, "Validated").get("status") == "False":
        await kube.post_event(llm, type_="Normal", reason="Validated", message="the spec is valid again: reconciling")
    spec, _ = parse_spec(raw_spec)
    assert spec is not None

    # 2. The headless Service.
    if ensure_service:
        await _ensure_service(kube, config, llm)

    # 3. Drift: restore operator-owned labels/annotations; a hand-edited container is replaced.
    hash_ = spec_hash(spec, config)
    views: list[PodView] = []
    repaired: list[str] = []
    for pod in pods:
        view = PodView.from_pod(pod)
        index = replica_index(view.name, name, hash_) if view.spec_hash == hash_ else None
        if index is not None and not view.deleting:
            desired_pod = pod_manifest(llm, index, config)
            patch = metadata_drift(desired_pod, pod).patch()
            if patch:
                await kube.patch_pod(namespace, view.name, patch)
                repaired.append(view.name)
            if spec_drifted(desired_pod, pod):
                view = PodView(**{**view.__dict__, "spec_hash": ""})  # rolled like an old Pod
        views.append(view)
    if repaired:
        await kube.post_event(llm, type_="Normal", reason="RepairedPodMetadata",
                              message=f"restored operator-owned labels/annotations on {', '.join(repaired)}")

    # 4. Plan and act: deletes first (they free surge room), then creates.
    desired = await hooks.desired_replicas(llm, spec, pods) if hooks.desired_replicas else None
    want = desired if desired is not None else desired_replicas(spec, old_status)
    plan = plan_pods(want, hash_, views, llm_name=name)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    deleted = [n for n in plan.delete if await kube.delete_pod(namespace, n, uids.get(n))]
    created = [c.name for c in plan.create if await kube.create_pod(namespace, pod_manifest(llm, c.index, config))]
    for n in deleted:
        why = "rolling update" if plan.rolling else "not wanted"
        await kube.post_event(llm, type_="Normal", reason="DeletedPod", message=f"deleted pod {n} ({why})")
    for n in created:
        await kube.post_event(llm, type_="Normal", reason="CreatedPod", message=f"created pod {n}")
    if not plan.empty:
        pods = [p for p in await kube.list_pods(namespace, L.selector_string(name)) if owned_by(p, uid)]

    # 5. Status: what is true now.
    status = compute_status(llm, pods, [], generation, now, config=config, desired=want)
    builtin = spec.autoscaling is not None and spec.autoscaling.mode == "builtin"
    patch = status_patch(status, old_status, autoscaler_owns_desired=builtin and hooks.desired_replicas is not None)
    if patch:
        await kube.patch_llmservice_status(namespace, name, patch)
    degraded, was_degraded = _condition(status, "Degraded"), _condition(old_status, "Degraded")
    if degraded.get("status") == "True" and (was_degraded.get("status") != "True"
                                              or was_degraded.get("reason") != degraded.get("reason")):
        await kube.post_event(llm, type_="Warning", reason=str(degraded.get("reason")), message=str(degraded.get("message")))
    converged = plan.empty and status.get("phase") == "Ready"
    return Outcome(valid=True, converged=converged, created=tuple(created), deleted=tuple(deleted),
                   repaired=tuple(repaired))


async def _write_invalid_status(kube: Kube, config: OperatorConfig, llm: Obj, pods: list[Obj],
                                problems: list[ValidationProblem], generation: int | None, now: datetime) -> None:
    """Validated=False and one Warning Event per distinct message. Existing Pods keep
    running: a typo in an edit must not take a serving model down."""
    meta = llm["metadata"]
    old_status = llm.get("status") or {}
    status = compute_status(llm, pods, problems, generation, now, config=config)
    patch = status_patch(status, old_status)
    if patch:
        await kube.patch_llmservice_status(meta["namespace"], meta["name"], patch)
    before, after = _condition(old_status, "Validated"), _condition(status, "Validated")
    if before.get("status") != "False" or before.get("message") != after.get("message"):
        await kube.post_event(llm, type_="Warning", reason="InvalidSpec", message=str(after.get("message")))


async def _ensure_service(kube: Kube, config: OperatorConfig, llm: Obj) -> None:
    desired = service_manifest(llm, config)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = await kube.get_service(namespace, name)
    if current is None:
        if await kube.create_service(namespace, desired):
            await kube.post_event(llm, type_="Normal", reason="CreatedService", message=f"created service {name}")
        return
    have, want = current.get("spec") or {}, desired["spec"]
    if have.get("selector") != want["selector"] or have.get("ports") != want["ports"]:
        # Selector and ports only: clusterIP is immutable, and other fields may be defaulted.
        await kube.patch_service(namespace, name, {"spec": {"selector": want["selector"], "ports": want["ports"]}})


# --- serialising and coalescing the triggers ----------------------------------------------------

@dataclass
class Reconciler:
    """Runs `reconcile()` for one LLMService at a time, and coalesces bursts of triggers: a
    trigger that finds another one already queued for the same LLMService returns at once,
    because the queued pass starts later and reads everything fresh."""

    kube: Kube
    config: OperatorConfig
    hooks: Hooks = field(default_factory=lambda: HOOKS)
    # LLMServices not yet Ready or invalid: the resync loop revisits them often.
    unsettled: set[Key] = field(default_factory=set)
    _locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    _queued: set[Key] = field(default_factory=set)

    async def run(self, namespace: str, name: str, *, ensure_service: bool = True) -> Outcome | None:
        key = (namespace, name)
        if key in self._queued:
            return None
        self._queued.add(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                self._queued.discard(key)
                outcome = await reconcile(self.kube, self.config, namespace, name,
                                          ensure_service=ensure_service, hooks=self.hooks)
                if outcome is None or outcome.converged:
                    self.unsettled.discard(key)
                else:
                    self.unsettled.add(key)
                return outcome
        finally:
            self._queued.discard(key)


@dataclass
class PeeringGate:
    """Whether this operator is the active one, read from kopf's peering object the way kopf
    decides it (a live peer with a higher or equal priority pauses us). kopf pauses its own
    watches by itself; this only gates the resync loop, which kopf does not know about."""

    kube: Kube
    settings: kopf.OperatorSettings
    identity: str | None

    async def active(self) -> bool:
        peering = self.settings.peering
        if peering.standalone:
            return True
        namespace = None if peering.clusterwide else os.environ.get(ENV_NAMESPACE)
        if not peering.clusterwide and namespace is None:
            return True
        try:
            obj = await self.kube.get_peering(peering.name, namespace)
        except Exception:  # noqa: BLE001 - no peering CRDs: kopf runs standalone, and so do we
            return True
        now = datetime.now(timezone.utc)
        for ident, info in ((obj or {}).get("status") or {}).items():
            if ident == self.identity or not isinstance(info, Mapping):
                continue
            try:
                seen = datetime.fromisoformat(str(info.get("lastseen")))
                seen = seen if seen.tzinfo else seen.replace(tzinfo=timezone.utc)
                alive = seen + timedelta(seconds=int(info.get("lifetime", 60))) > now
                priority = int(info.get("priority", 0))
            except (TypeError, ValueError):
                continue
            # Without our own identity, an equal priority may be ourselves: only yield to higher.
            if alive and (priority > peering.priority or (priority == peering.priority and self.identity)):
                return False
        return True


async def resync_loop(reconciler: Reconciler, gate: PeeringGate, *, full_every_s: float, unsettled_every_s: float,
                      namespace: str | None) -> None:
    """The safety net: every LLMService each `full_every_s`, the unsettled ones (invalid, or
    not Ready yet) each `unsettled_every_s`, so fixing a missing Secret takes effect soon."""
    loop = asyncio.get_running_loop()
    next_full = loop.time() + full_every_s
    while True:
        await asyncio.sleep(unsettled_every_s)
        try:
            if not await gate.active():
                continue
            if loop.time() >= next_full:
                next_full = loop.time() + full_every_s
                keys = {(o["metadata"]["namespace"], o["metadata"]["name"])
                        for o in await reconciler.kube.list_llmservices(namespace)}
                reconciler.unsettled &= keys
            else:
                keys = set(reconciler.unsettled)
            for ns, name in sorted(keys):
                await reconciler.run(ns, name)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - keep the safety net alive through API hiccups
            log.exception("resync failed; retrying at the next tick")


# --- kopf wiring ---------------------------------------------------------------------------------

# Set by `tidal operator` before kopf starts (kopf's identity, for the peering gate).
OPERATOR_IDENTITY: str | None = os.environ.get("POD_ID")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """An explicit $KUBECONFIG (what `tidal operator --kubeconfig` sets) is read now; the
    official client would have read it at import time. Otherwise kopf's usual login:
    in-cluster service account, or ~/.kube/config through the client library."""
    if os.environ.get(ENV_KUBECONFIG):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Watch only engine Pods: the label every operator-made Pod has. A Pod whose label is
    # edited away leaves the selection, which the watch reports (DELETED), so it is still seen.
    settings.watching.label_selectors["v1", "pods"] = L.LLMSERVICE
    # kopf's own per-handler events: only failures (ours are posted by reconcile()).
    settings.posting.level = logging.WARNING
    # Handlers block on API calls only; keep the retry of a failed reconcile quick.
    settings.batching.error_delays = (1, 2, 5, 10, 30, 60)
    config = config_from_env()
    kube = await Kube.connect(os.environ.get(ENV_KUBECONFIG) or None)
    memo.config = config
    memo.kube = kube
    memo.reconciler = Reconciler(kube, config)
    resync = float(os.environ.get(ENV_RESYNC, "60"))
    memo.resync = asyncio.create_task(resync_loop(
        memo.reconciler, PeeringGate(kube, settings, OPERATOR_IDENTITY), full_every_s=resync,
        unsettled_every_s=min(5.0, resync), namespace=config.namespace))
    logger.info("tidal operator: default image %s, resync every %ss", config.default_engine_image, resync)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "resync", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()


@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL)
async def llmservice_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Created, spec changed, or found at start-up: reconcile it. An API error raises, and
    kopf retries the handler with backoff."""
    await memo.reconciler.run(namespace, name)


def _owned_by_llmservice(body: kopf.Body, **_: Any) -> bool:
    return owner_name(body) is not None


@kopf.on.event("", "v1", "pods", when=_owned_by_llmservice)
async def engine_pod_event(body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Any change to an engine Pod (it became Ready, failed, was deleted or edited): reconcile
    its LLMService, found through the ownerReference."""
    owner = owner_name(body)
    assert owner is not None
    if (body.metadata.labels or {}).get(L.LLMSERVICE) != owner and not body.metadata.get("deletionTimestamp"):
        # The selector label was edited: put it back first, or the Pod would be invisible to
        # the Pod list in reconcile() (and to the Service and the router).
        try:
            await memo.kube.patch_pod(namespace, body.metadata.name, {"metadata": {"labels": {L.LLMSERVICE: owner}}})
        except Exception as exc:  # noqa: BLE001 - gone meanwhile: reconcile sees that
            log.debug("could not restore the %s label on %s/%s: %s", L.LLMSERVICE, namespace, body.metadata.name, exc)
    await memo.reconciler.run(namespace, owner, ensure_service=False)


# --- autoscaling hook (issue 7: operator/tidal_operator/scaling/controller.py) ----------------
# Builtin autoscaling and the idle policy run as one operator-wide task (not a kopf daemon:
# no finalizer). The reconcile reads the autoscaler's latest decision through HOOKS, and a
# new decision re-plans the Pods at once instead of at the next resync.

@kopf.on.startup()
async def start_autoscaler(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    from .scaling.controller import AutoscalerRuntime, KubeClusterApi, scaling_config_from_env

    if getattr(memo, "reconciler", None) is None:
        raise kopf.TemporaryError("waiting for the operator's startup", delay=1)
    reconciler: Reconciler = memo.reconciler
    runtime = AutoscalerRuntime(KubeClusterApi(memo.kube), scaling_config_from_env(),
                                on_change=lambda ns, name: reconciler.run(ns, name, ensure_service=False))
    HOOKS.desired_replicas = runtime.desired_replicas
    memo.autoscaler = runtime
    memo.autoscaling = asyncio.create_task(runtime.run(
        namespace=memo.config.namespace, active=PeeringGate(memo.kube, settings, OPERATOR_IDENTITY).active))


@kopf.on.cleanup()
async def stop_autoscaler(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "autoscaling", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    runtime = getattr(memo, "autoscaler", None)
    if runtime is not None:
        HOOKS.desired_replicas = None
        await runtime.aclose()
# --- end of the autoscaling hook ---------------------------------------------------------------


# --- LoRA adapters hook (issue 6: operator/tidal_operator/adapters_sync.py) -------------------
# One operator-wide task syncs spec.lora.adapters into every replica's engine on an interval
# (which also reloads replicas that restarted); a change of spec.lora syncs that LLMService
# at once. No Pod is restarted: the adapter list is outside the spec hash.

@kopf.on.startup()
async def start_adapter_sync(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    from .adapters_sync import AdapterSync, AdapterSyncLoop
    from .scaling.controller import KubeClusterApi

    if getattr(memo, "reconciler", None) is None:
        raise kopf.TemporaryError("waiting for the operator's startup", delay=1)
    loop = AdapterSyncLoop(AdapterSync(KubeClusterApi(memo.kube), operator_config=memo.config))
    memo.adapter_sync_loop = loop
    memo.adapter_sync_task = asyncio.create_task(loop.run(
        namespace=memo.config.namespace, active=PeeringGate(memo.kube, settings, OPERATOR_IDENTITY).active))


@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL, field="spec.lora")
async def lora_spec_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    loop = getattr(memo, "adapter_sync_loop", None)
    llm = await memo.kube.get_llmservice(namespace, name) if loop is not None else None
    if loop is None or llm is None:
        return
    try:
        await loop.sync.sync(llm)
    except Exception as exc:  # noqa: BLE001 - the interval loop retries; never block kopf's handler
        log.warning("adapter sync of %s/%s failed: %r", namespace, name, exc)


@kopf.on.cleanup()
async def stop_adapter_sync(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "adapter_sync_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    loop = getattr(memo, "adapter_sync_loop", None)
    if loop is not None:
        await loop.sync.aclose()
# --- end of the LoRA adapters hook ---------------------------------------------------------------
