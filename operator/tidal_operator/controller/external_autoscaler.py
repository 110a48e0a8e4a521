"""Modes hpa and keda: the HorizontalPodAutoscaler or KEDA ScaledObject that writes
spec.replicas through the scale subresource, created and kept in line by the reconcile and
owned by the LLMService (garbage-collected with it). The objects are rendered by the pure
scaling.controller.hpa_manifest / keda_scaled_object; one of a mode no longer used is deleted.
What happened is the `ExternalAutoscaler` condition; KEDA's API not being served is said there.
"""

from __future__ import annotations

from typing import Any

from ..api.types import LLMServiceSpec
from ..kube import ApiError, Kube
from ..scaling.controller import hpa_manifest, keda_scaled_object
from .companion_state import CompanionState, covers
from .ownership import owned_by

CONDITION = "ExternalAutoscaler"
Obj = dict[str, Any]


async def ensure_external_autoscaler(kube: Kube, llm: Obj, spec: LLMServiceSpec) -> CompanionState | None:
    """Create, repair or delete the HPA and the ScaledObject for the spec's mode. None when the
    mode is neither hpa nor keda (nothing to report)."""
    mode = spec.autoscaling.mode if spec.autoscaling is not None else None
    meta = llm["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    state: CompanionState | None = None

    try:
        hpa = await kube.get_hpa(namespace, name)
    except ApiError as exc:
        if not exc.api_missing:
            raise
        hpa, state = None, (CompanionState(False, "HPANotServed", "autoscaling/v2 HorizontalPodAutoscalers are not "
                                            "served by this cluster") if mode == "hpa" else None)
    if mode == "hpa" and state is None:
        want = hpa_manifest(llm, spec)
        state = await _ensure(kube, "HorizontalPodAutoscaler", hpa, want, uid, create=kube.create_hpa,
                              patch=kube.patch_hpa)
    elif hpa is not None and owned_by(hpa, uid):
        await kube.delete_hpa(namespace, name)

    try:
        scaled = await kube.get_scaled_object(namespace, name)
    except ApiError as exc:
        if not exc.api_missing:
            raise
        if mode == "keda":
            return CompanionState(False, "KEDANotInstalled", "spec.autoscaling.mode is keda, but KEDA's ScaledObject "
                                   "API (keda.sh/v1alpha1) is not served: install KEDA, or use mode hpa or builtin. "
                                   "Until then the replicas stay at spec.replicas")
        return state
    if mode == "keda":
        want = keda_scaled_object(llm, spec)
        state = await _ensure(kube, "ScaledObject", scaled, want, uid, create=kube.create_scaled_object,
                              patch=kube.patch_scaled_object)
    elif scaled is not None and owned_by(scaled, uid):
        await kube.delete_scaled_object(namespace, name)
    return state


async def _ensure(kube: Kube, kind: str, have: Obj | None, want: Obj, uid: str, *, create: Any,
                  patch: Any) -> CompanionState:
    namespace, name = want["metadata"]["namespace"], want["metadata"]["name"]
    if have is None:
        await create(namespace, want)
    elif not owned_by(have, uid):
        return CompanionState(False, "AutoscalerConflict", f"{kind} {name} exists and is not owned by this "
                               "LLMService: it is left alone; delete or rename it")
    elif not covers(have.get("spec"), want["spec"]):
        await patch(namespace, name, {"spec": want["spec"]})
    a = want["spec"]
    low, high = a.get("minReplicas", a.get("minReplicaCount")), a.get("maxReplicas", a.get("maxReplicaCount"))
    return CompanionState(True, f"{kind}Ready", f"{kind} {name} sets spec.replicas within [{low}, {high}]")
