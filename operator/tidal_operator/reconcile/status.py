"""Pure: from what is observed (the LLMService, its Pods, validation problems) to `status`.

The result holds only the fields and conditions this module owns; the reconcile applies it to
`/status` with its own field manager (server-side apply), so the fields and conditions other
controllers write (scalingHistory, lastScaleTime, adapters, AdaptersReady) are left alone.
A condition keeps its lastTransitionTime while its status doesn't change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from .. import labels as L
from ..api.types import DEFAULT_REPLICAS, LLMServiceSpec, OperatorConfig
from ..api.validation import ValidationProblem, parse_spec
from .manifests import endpoint_url, spec_hash
from .pods import PodView, parse_time

CONDITION_TYPES = ("Validated", "Ready", "Progressing", "Degraded")

# Container waiting reasons that mean a Pod won't get better by itself.
STUCK_WAITING_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})


@dataclass(frozen=True)
class StuckPod:
    pod: str
    reason: str
    message: str


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def desired_replicas(spec: LLMServiceSpec, previous_status: Mapping[str, Any] | None = None) -> int:
    """How many replicas the LLMService wants now.

    Fixed: spec.replicas (default 1). hpa/keda: spec.replicas as the HPA or KEDA wrote it.
    builtin autoscaling: the autoscaler's last decision in status.desiredReplicas, else
    max(minReplicas, 1) so a new model comes up once; clamped to [min, max] either way.
    """
    a = spec.autoscaling
    if a is None:
        return spec.replicas if spec.replicas is not None else DEFAULT_REPLICAS
    if a.mode != "builtin" and spec.replicas is not None:
        wanted = spec.replicas
    else:
        previous = (previous_status or {}).get("desiredReplicas")
        wanted = previous if isinstance(previous, int) else max(a.min_replicas, 1)
    return min(max(wanted, a.min_replicas), a.max_replicas)


def last_words(terminated: Mapping[str, Any], limit: int = 500) -> str:
    """The last line a failed container left in its termination message: the engine's error
    (the Pod's terminationMessagePolicy FallbackToLogsOnError makes that its log's tail)."""
    lines = [line.strip() for line in str(terminated.get("message") or "").splitlines() if line.strip()]
    return lines[-1][-limit:] if lines and terminated.get("exitCode") not in (0, None) else ""


def pod_stuck_reason(pod: Mapping[str, Any], now: datetime, startup_timeout_seconds: int) -> StuckPod | None:
    """Why a Pod is stuck, read from its status as the kubelet and scheduler report it."""
    name = (pod.get("metadata") or {}).get("name", "?")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return StuckPod(name, status.get("reason") or "PodFailed", status.get("message") or "the Pod failed")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return StuckPod(name, cond.get("reason") or "Unschedulable",
                            cond.get("message") or "no node can run this Pod")
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        waiting = state.get("waiting") or {}
        if last.get("reason") == "OOMKilled":
            # More useful than the CrashLoopBackOff it causes: raise engine.resources.memory.
            return StuckPod(name, "OOMKilled", f"container {cs.get('name')} was killed for exceeding its "
                            "memory limit (raise spec.engine.resources.memory or lower the KV cache)")
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            message = waiting.get("message") or waiting["reason"]
            if words := last_words(last):
                # The engine's own reason (e.g. a quantization the checkpoint does not have).
                message = f"the engine exited with code {last.get('exitCode')}: {words} ({message})"
            return StuckPod(name, waiting["reason"], message)
        running = state.get("running") or {}
        started_at = parse_time(running.get("startedAt"))
        if running and cs.get("started") is False and started_at is not None \
                and (now - started_at).total_seconds() > startup_timeout_seconds:
            return StuckPod(name, "StartupProbeFailing",
                            f"the engine is not healthy {startup_timeout_seconds}s after starting "
                            "(raise spec.engine.startupTimeoutSeconds if the model loads slowly)")
        if last and last.get("exitCode") == 137 and cs.get("started") is False and not cs.get("ready"):
            return StuckPod(name, "StartupProbeFailing",
                            "the engine was restarted after its startup probe failed "
                            "(raise spec.engine.startupTimeoutSeconds if the model loads slowly)")
    return None


def stalled_pods(updated: Sequence[PodView], stuck: Sequence[StuckPod], now: datetime,
                 deadline_seconds: int) -> list[StuckPod]:
    """Pods of the current spec that stop the rollout: stuck (CrashLoopBackOff, ImagePullBackOff,
    a failing startup probe, ...), or not Ready `deadline_seconds` after their creation (each
    new Pod gets its own deadline, so a rollout that makes progress is never stuck)."""
    stuck_by_pod = {s.pod: s for s in stuck}
    out = []
    for view in updated:
        if view.ready:
            continue
        if view.name in stuck_by_pod:
            out.append(stuck_by_pod[view.name])
        elif view.created is not None and (now - view.created).total_seconds() > deadline_seconds:
            out.append(StuckPod(view.name, "ProgressDeadlineExceeded",
                                f"not Ready {deadline_seconds}s after its creation "
                                "(spec.rollout.progressDeadlineSeconds)"))
    return out


def extra_condition(previous_status: Mapping[str, Any], type_: str, ok: bool | None, reason: str, message: str,
                    generation: int | None, now: datetime) -> dict[str, Any]:
    """A condition of another type than compute_status's, with the same lastTransitionTime rule."""
    previous = {c.get("type"): c for c in previous_status.get("conditions") or []}
    return _condition(previous, type_, ok, reason, message, generation, now)


def _condition(previous: Mapping[str, Mapping[str, Any]], type_: str, ok: bool | None, reason: str, message: str,
               generation: int | None, now: datetime) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = previous.get(type_)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    cond: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": since or format_time(now)}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def compute_status(
    llm: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    validation_problems: Iterable[ValidationProblem],
    generation: int | None,
    now: datetime,
    *,
    config: OperatorConfig | None = None,
    desired: int | None = None,
    service_conflict: str | None = None,
) -> dict[str, Any]:
    """The LLMService's status from observation. `pods` are its engine Pod objects;
    `desired` overrides desired_replicas() (the autoscaler's decision, when it has one);
    `service_conflict`: why the Service of this name isn't ours (then there is no endpoint)."""
    config = config or OperatorConfig()
    meta = llm.get("metadata") or {}
    name = meta.get("name", "")
    namespace = meta.get("namespace") or config.namespace or "default"
    previous_status = llm.get("status") or {}
    previous = {c.get("type"): c for c in previous_status.get("conditions") or []}
    problems = list(validation_problems)
    parsed, parse_problems = parse_spec(llm.get("spec") or {})
    if parsed is None and not problems:
        problems = parse_problems

    views = [PodView.from_pod(p) for p in pods]
    live = {v.name for v in views if not v.deleting and not v.terminal}
    alive_pods = [p for p, v in zip(pods, views) if v.name in live]
    alive = [v for v in views if v.name in live]
    ready = [v for v in alive if v.ready]
    sleeping = [v for v in alive if v.asleep]

    out: dict[str, Any] = {"observedGeneration": generation} if generation is not None else {}

    def cond(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
        return _condition(previous, type_, ok, reason, message, generation, now)

    if parsed is None or problems:
        message = "; ".join(str(p) for p in problems) or "the spec is invalid"
        reason = problems[0].reason if problems else "InvalidSpec"
        out.update(phase="Failed", replicas=len(alive), readyReplicas=len(ready), updatedReplicas=0,
                   sleepingReplicas=len(sleeping), replicasText=f"{len(ready)}/0",
                   selector=L.selector_string(name))
        out["conditions"] = [
            cond("Validated", False, reason, message),
            # A served-name conflict keeps its own reason (the router answers it with a 503 at once).
            cond("Ready", False, reason if reason == "ServedNameConflict" else "InvalidSpec", "fix the spec: " + message),
            cond("Progressing", False, "InvalidSpec", "nothing is reconciled until the spec is valid"),
            cond("Degraded", False, "InvalidSpec", "no Pods are managed while the spec is invalid"),
        ]
        return out

    want = desired if desired is not None else desired_replicas(parsed, previous_status)
    hash_ = spec_hash(parsed, config)
    updated = [v for v in alive if v.spec_hash == hash_]
    updated_ready = [v for v in updated if v.ready]
    old = [v for v in alive if v.spec_hash != hash_]
    stuck = [s for p in alive_pods if (s := pod_stuck_reason(p, now, parsed.engine.startup_timeout_seconds))]
    stalled = stalled_pods(updated, stuck, now, parsed.rollout.progress_deadline_seconds)
    port = parsed.engine.port

    out.update(
        replicas=len(alive), readyReplicas=len(ready), updatedReplicas=len(updated), desiredReplicas=want,
        sleepingReplicas=len(sleeping), replicasText=f"{len(ready)}/{want}", selector=L.selector_string(name),
        servedModelName=parsed.served_name(name), specHash=hash_,
        parallelism=f"tp={parsed.parallelism.tensor} pp={parsed.parallelism.pipeline}",
        endpoint=endpoint_url(name, namespace, port, config.cluster_domain),
        podEndpoints=[{"name": p["metadata"]["name"], "url": f"http://{p['status']['podIP']}:{port}/v1",
                       "ready": v.ready, "sleepState": v.sleep_state}
                      for p, v in zip(alive_pods, alive) if (p.get("status") or {}).get("podIP")],
    )

    converged = not old and len(updated) == want and len(updated_ready) == want
    # Stuck Pods matter when replicas are missing, and a stuck new Pod matters even while old
    # Pods serve: otherwise a rollout that can never finish looks healthy.
    pod_problems = stalled + [s for s in stuck if s not in stalled] if stalled or (stuck and len(ready) < want) else []
    degraded = bool(pod_problems) or service_conflict is not None
    if service_conflict is not None:
        out.pop("endpoint")  # the Service of that name is someone else's
    if pod_problems:
        degraded_cond = cond("Degraded", True, pod_problems[0].reason,
                             "; ".join(f"pod {s.pod}: {s.reason}: {s.message}" for s in pod_problems))
    elif service_conflict is not None:
        degraded_cond = cond("Degraded", True, "ServiceConflict", service_conflict)
    else:
        degraded_cond = cond("Degraded", False, "AsExpected", "no Pod is stuck")

    if want == 0:
        ready_cond = cond("Ready", False, "ScaledToZero",
                          "no replicas: a request through the router brings one up" if parsed.autoscaling
                          else "spec.replicas is 0")
    elif len(ready) >= want:
        ready_cond = cond("Ready", True, "ReplicasReady", f"{len(ready)}/{want} replicas ready")
    elif pod_problems:
        ready_cond = cond("Ready", False, pod_problems[0].reason,
                          f"{len(ready)}/{want} replicas ready; {pod_problems[0].message}")
    else:
        ready_cond = cond("Ready", False, "WaitingForReplicas", f"{len(ready)}/{want} replicas ready")

    if converged:
        progressing_cond = cond("Progressing", False, "Complete", f"{want} replicas up to date")
    elif stalled:
        serving = f"; {len(ready)} Ready Pod(s) keep serving" if ready else ""
        progressing_cond = cond("Progressing", False, "RolloutStuck",
                                f"pod {stalled[0].pod}: {stalled[0].reason}: {stalled[0].message}{serving}")
    elif old:
        progressing_cond = cond("Progressing", True, "RollingUpdate",
                                f"{len(updated_ready)}/{want} replicas updated and ready, {len(old)} old left")
    elif len(updated) > want:
        progressing_cond = cond("Progressing", True, "ScalingDown", f"{len(updated)} -> {want} replicas")
    elif len(updated) < want:
        progressing_cond = cond("Progressing", True, "ScalingUp", f"{len(updated)} -> {want} replicas")
    else:
        progressing_cond = cond("Progressing", True, "PodsStarting", f"{len(updated_ready)}/{want} replicas ready")

    if degraded:
        phase = "Degraded"
    elif want == 0:
        phase = "Progressing" if alive else "Sleeping"
    elif converged:
        phase = "Sleeping" if ready and all(v.asleep for v in ready) else "Ready"
    elif not ready:
        phase = "Pending"
    else:
        phase = "Progressing"

    out["phase"] = phase
    out["conditions"] = [cond("Validated", True, "Valid", "the spec is valid"),
                         ready_cond, progressing_cond, degraded_cond]
    return out

