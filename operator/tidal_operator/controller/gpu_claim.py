"""The ResourceClaim of a GPU-share group whose members ask for a GPU: created by the first
member's reconcile, its owners (every live member) kept in line by server-side apply, deleted by
the garbage collector with the last member. What happened is the `GPUShare` condition; a
cluster that doesn't serve resource.k8s.io/v1 is said there, and the member's Pods wait (a Pod
naming a claim on such a cluster would get no GPU at all)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .. import labels as L
from ..api.types import LLMServiceSpec, OperatorConfig
from ..kube import ApiError, Kube
from ..reconcile.gpu_claim import GROUP_LABEL, group_members, gpu_claim_manifest, uses_shared_claim
from .companion_state import CompanionState, covers

CONDITION = "GPUShare"
Obj = dict[str, Any]


def _owner_uids(obj: Mapping[str, Any]) -> list[str]:
    return [str(r.get("uid")) for r in (obj.get("metadata") or {}).get("ownerReferences") or []]


async def ensure_gpu_claim(kube: Kube, config: OperatorConfig, llm: Obj, spec: LLMServiceSpec,
                           others: Iterable[Mapping[str, Any]]) -> CompanionState | None:
    """Create or update the group's claim; None for an LLMService that needs none."""
    if not uses_shared_claim(spec):
        return None
    assert spec.gpu_share is not None
    group, namespace = spec.gpu_share.group, llm["metadata"]["namespace"]
    want = gpu_claim_manifest(namespace, group, group_members(llm, others), config)
    name = want["metadata"]["name"]
    try:
        have = await kube.get_resource_claim(namespace, name)
        if have is None:
            try:
                await kube.create_resource_claim(namespace, want)
                await kube.post_event(llm, type_="Normal", reason="CreatedResourceClaim",
                                      message=f"created resourceclaim {name} for gpu-share group {group}")
            except ApiError as exc:
                if not exc.already_exists:
                    raise
                have = await kube.get_resource_claim(namespace, name)  # another member's pass made it
    except ApiError as exc:
        if not exc.api_missing:
            raise
        return CompanionState(False, "ResourceClaimAPINotServed",
                          "this member asks for a GPU, which a gpu-share group gets through one shared "
                          "ResourceClaim, but resource.k8s.io/v1 is not served (Dynamic Resource Allocation needs "
                          "Kubernetes 1.34+ and a DRA driver for the GPUs): the Pod waits; or drop "
                          "spec.engine.resources.gpu to run the group on CPU")
    device = config.gpu_share_device_class
    if have is not None:
        labels = (have.get("metadata") or {}).get("labels") or {}
        if labels.get(L.MANAGED_BY) != L.MANAGED_BY_VALUE or labels.get(GROUP_LABEL) != group:
            return CompanionState(False, "ResourceClaimConflict", f"ResourceClaim {name} exists and was not made by "
                              f"Tidal for group {group}: it is left alone; delete or rename it")
        if not covers(have.get("spec"), want["spec"]):
            # A claim's spec can't change; a new device class applies once the group's Pods are gone.
            return CompanionState(False, "ResourceClaimOutdated", f"ResourceClaim {name} asks for another device than "
                              f"one of class {device}: delete it when the group's Pods are gone")
        if sorted(_owner_uids(have)) != sorted(_owner_uids(want)) or not covers(labels, want["metadata"]["labels"]):
            await kube.apply_resource_claim(namespace, name, want)
    members = ", ".join(r["name"] for r in want["metadata"]["ownerReferences"])
    return CompanionState(True, "ResourceClaimReady", f"ResourceClaim {name} (one device of class {device}) is shared "
                      f"by {members}")
