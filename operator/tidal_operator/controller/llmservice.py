"""One reconcile pass for one LLMService: validate, ensure the Service, repair drift, plan and
act on Pods, write status.

`reconcile()` is idempotent and every trigger calls it. State lives only in the cluster: Pod
names are deterministic and a retried create answers AlreadyExists, so an operator killed
mid-pass and restarted recomputes the same plan and creates nothing twice. No finalizer: Pods
and the Service carry ownerReferences and the garbage collector removes them with the
LLMService. See docs/operator.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Mapping

from ..api.types import LLMServiceSpec, OperatorConfig
from ..api.validation import ValidationProblem, parse_spec, validate_spec
from ..kube import MANAGER_RECONCILER, Kube
from ..reconcile.manifests import CONTAINER_NAME, metadata_drift, pod_manifest, spec_hash
from ..reconcile.pods import PodView, plan_pods
from ..reconcile.gpu_share import GPU_SHARE_CONFLICT, gpu_share_conflicts
from ..reconcile.served_names import SERVED_NAME_CONFLICT, served_name_conflicts
from ..reconcile.status import CONDITION_TYPES, compute_status, desired_replicas, extra_condition
from ..secret_refs import referenced_secrets
from .external_autoscaler import CONDITION as EXTERNAL_AUTOSCALER
from .external_autoscaler import ensure_external_autoscaler
from .companions import ensure_disruption_budget, ensure_service_for
from .gpu_claim import CONDITION as GPU_SHARE
from .gpu_claim import ensure_gpu_claim
from .owned_pods import adopt_existing, owned_pods
from .ownership import replica_index

Obj = dict[str, Any]

# `desired_replicas(llm, spec, pods)`: the replica count to reconcile to, or None for the
# default (spec.replicas, or status.desiredReplicas). The builtin autoscaler provides one.
DesiredReplicasFn = Callable[[Obj, LLMServiceSpec, list[Obj]], Awaitable["int | None"]]

# Status fields compute_status owns. One it leaves out this time (the endpoint of a spec
# that became invalid) is removed, so status never shows something stale. desiredReplicas
# is apart: the autoscaler's decision survives an invalid spec.
OWNED_STATUS_FIELDS = ("observedGeneration", "phase", "replicas", "readyReplicas", "updatedReplicas",
                       "sleepingReplicas", "replicasText", "selector", "servedModelName", "parallelism", "specHash",
                       "endpoint", "podEndpoints", "conditions")


# The conditions the reconcile writes (and owns, as its field manager).
RECONCILE_CONDITIONS = (*CONDITION_TYPES, EXTERNAL_AUTOSCALER, GPU_SHARE)


@dataclass(frozen=True)
class Outcome:
    valid: bool
    converged: bool
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()


def spec_drifted(desired: Mapping[str, Any], actual: Mapping[str, Any]) -> bool:
    """A hand-edited engine container (image, command, args): the Pod must be replaced, since
    a Pod's spec can't be put back in place."""
    def engine(pod: Mapping[str, Any]) -> Mapping[str, Any]:
        containers = (pod.get("spec") or {}).get("containers") or []
        return next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
    want, have = engine(desired), engine(actual)
    return any(want.get(k) != have.get(k) for k in ("image", "command", "args"))


def status_to_apply(new: Mapping[str, Any], old: Mapping[str, Any], *,
                    autoscaler_owns_desired: bool = False) -> Obj | None:
    """What the reconcile applies to `/status` (server-side apply, its own field manager): the
    fields compute_status owns and its own conditions; None when that changes nothing, so an
    unchanged pass writes nothing. A field it leaves out (the endpoint of a spec that became
    invalid) is removed by the apply. `status.desiredReplicas` has one writer: the builtin
    autoscaler when it runs for this LLMService (`autoscaler_owns_desired`), else the reconcile
    (spec.replicas, HPA, KEDA)."""
    out: Obj = {k: new[k] for k in OWNED_STATUS_FIELDS if k in new and k != "conditions"}
    out["conditions"] = [c for c in new.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]
    if not autoscaler_owns_desired and "desiredReplicas" in new:
        out["desiredReplicas"] = new["desiredReplicas"]
    old_conditions = [c for c in old.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]
    unchanged = (all(old.get(k) == v for k, v in out.items() if k != "conditions")
                 and old_conditions == out["conditions"]
                 and not any(old.get(k) is not None for k in OWNED_STATUS_FIELDS if k not in out))
    return None if unchanged else out


def owns_status_field(llm: Mapping[str, Any], manager: str, field_name: str) -> bool:
    """Whether `manager`'s server-side applies own `status.<field_name>` (managedFields)."""
    return any(entry.get("manager") == manager and entry.get("subresource") == "status"
               and f"f:{field_name}" in ((entry.get("fieldsV1") or {}).get("f:status") or {})
               for entry in (llm.get("metadata") or {}).get("managedFields") or [])


def condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


async def reconcile(kube: Kube, config: OperatorConfig, namespace: str, name: str, *,
                    ensure_service: bool = True, now: datetime | None = None,
                    desired_replicas_fn: DesiredReplicasFn | None = None) -> Outcome | None:
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
    # A model name an earlier LLMService serves (any namespace the operator sees) is not ours.
    others = [o for o in await kube.list_llmservices(config.namespace) if o["metadata"].get("uid") != uid]
    problems += served_name_conflicts(llm, others)
    problems += gpu_share_conflicts(llm, others)
    pods = await owned_pods(kube, namespace, uid)
    if problems:
        await write_invalid_status(kube, config, llm, pods, problems, generation, now)
        return Outcome(valid=False, converged=False)
    if condition(old_status, "Validated").get("status") == "False":
        await kube.post_event(llm, type_="Normal", reason="Validated", message="the spec is valid again: reconciling")
    spec, _ = parse_spec(raw_spec)
    assert spec is not None

    # 2. The headless Service (read on every pass, so a Service someone else owns stays reported).
    service_conflict = await ensure_service_for(kube, config, llm, repair=ensure_service)

    # 2b. The PodDisruptionBudget (garbage-collected with the LLMService, like the Service).
    await ensure_disruption_budget(kube, config, llm)

    # 2c. Modes hpa and keda: the HPA or ScaledObject that writes spec.replicas.
    autoscaler = await ensure_external_autoscaler(kube, llm, spec)

    # 2d. A GPU-share member that asks for a GPU: the group's shared ResourceClaim.
    claim = await ensure_gpu_claim(kube, config, llm, spec, others)

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
    desired = await desired_replicas_fn(llm, spec, pods) if desired_replicas_fn else None
    want = desired if desired is not None else desired_replicas(spec, old_status)
    plan = plan_pods(want, hash_, views, llm_name=name, max_surge=spec.rollout.max_surge,
                     max_unavailable=spec.rollout.max_unavailable)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    deleted = [n for n in plan.delete if await kube.delete_pod(namespace, n, uids.get(n))]
    created, adopted = [], []
    # Without its claim a member's Pod would not get the group's device: it waits.
    for c in plan.create if claim is None or claim.ok else ():
        if await kube.create_pod(namespace, pod_manifest(llm, c.index, config)):
            created.append(c.name)
        elif await adopt_existing(kube, llm, c.name):
            adopted.append(c.name)
    for n in deleted:
        why = "rolling update" if plan.rolling else "not wanted"
        await kube.post_event(llm, type_="Normal", reason="DeletedPod", message=f"deleted pod {n} ({why})")
    for n in created:
        await kube.post_event(llm, type_="Normal", reason="CreatedPod", message=f"created pod {n}")
    if not plan.empty:
        pods = await owned_pods(kube, namespace, uid)

    # 5. Status: what is true now.
    status = compute_status(llm, pods, [], generation, now, config=config, desired=want,
                            service_conflict=service_conflict)
    if autoscaler is not None:
        status["conditions"].append(extra_condition(old_status, EXTERNAL_AUTOSCALER, autoscaler.ok, autoscaler.reason,
                                                    autoscaler.message, generation, now))
    if claim is not None:
        status["conditions"].append(extra_condition(old_status, GPU_SHARE, claim.ok, claim.reason, claim.message,
                                                    generation, now))
    builtin = spec.autoscaling is not None and spec.autoscaling.mode == "builtin"
    applied = status_to_apply(status, old_status,
                              autoscaler_owns_desired=builtin and desired_replicas_fn is not None)
    if applied:
        await kube.apply_llmservice_status(namespace, name, applied, manager=MANAGER_RECONCILER)
    degraded, was_degraded = condition(status, "Degraded"), condition(old_status, "Degraded")
    if degraded.get("status") == "True" and (was_degraded.get("status") != "True"
                                              or was_degraded.get("reason") != degraded.get("reason")):
        await kube.post_event(llm, type_="Warning", reason=str(degraded.get("reason")), message=str(degraded.get("message")))
    converged = plan.empty and status.get("phase") == "Ready" and (claim is None or claim.ok)
    return Outcome(valid=True, converged=converged, created=tuple(created), deleted=tuple(deleted),
                   repaired=tuple(repaired), adopted=tuple(adopted))


async def write_invalid_status(kube: Kube, config: OperatorConfig, llm: Obj, pods: list[Obj],
                               problems: list[ValidationProblem], generation: int | None, now: datetime) -> None:
    """Validated=False and one Warning Event per distinct message. Existing Pods keep
    running: a typo in an edit must not take a serving model down."""
    meta = llm["metadata"]
    old_status = llm.get("status") or {}
    status = compute_status(llm, pods, problems, generation, now, config=config)
    applied = status_to_apply(status, old_status, autoscaler_owns_desired=True)
    if applied and "desiredReplicas" in old_status and owns_status_field(llm, MANAGER_RECONCILER, "desiredReplicas"):
        # Keep the count it wrote (applying without it would remove it): an invalid edit
        # changes no replica count.
        applied["desiredReplicas"] = old_status["desiredReplicas"]
    if applied:
        await kube.apply_llmservice_status(meta["namespace"], meta["name"], applied, manager=MANAGER_RECONCILER)
    before, after = condition(old_status, "Validated"), condition(status, "Validated")
    if before.get("status") != "False" or before.get("message") != after.get("message"):
        reason = after.get("reason") if after.get("reason") in (SERVED_NAME_CONFLICT, GPU_SHARE_CONFLICT) else "InvalidSpec"
        await kube.post_event(llm, type_="Warning", reason=reason, message=str(after.get("message")))
