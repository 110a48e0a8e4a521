"""The one ResourceClaim a GPU-share group shares (docs/gpu-sharing.md): Dynamic Resource
Allocation gives the claim one device of a DeviceClass, and every member's Pod that names it
runs on that node with that device. Only members that ask for a GPU use it; a CPU group has none.

Pure: from the group's members to the claim, and from a member to what its Pod says.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .. import labels as L
from ..api.types import LLMServiceSpec, OperatorConfig

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceClaim"
# The name a member's Pod gives the claim (spec.resourceClaims[].name, container resources.claims).
POD_CLAIM = "gpu"
# The label that names the group on its claim.
GROUP_LABEL = f"{L.GROUP}/gpu-share-group"


def claim_name(group: str) -> str:
    """Per namespace and group; the group is a DNS label, so this is a valid object name."""
    return f"tidal-gpu-share-{group}"


def uses_shared_claim(spec: LLMServiceSpec) -> bool:
    """A member that asks for a GPU takes the group's device through the claim instead of an
    extended resource of its own."""
    return spec.gpu_share is not None and spec.gpu_count > 0


def pod_resource_claims(spec: LLMServiceSpec) -> list[dict[str, str]]:
    """`spec.resourceClaims` of a member's Pod (empty outside a GPU group)."""
    if not uses_shared_claim(spec):
        return []
    assert spec.gpu_share is not None
    return [{"name": POD_CLAIM, "resourceClaimName": claim_name(spec.gpu_share.group)}]


def group_members(llm: Mapping[str, Any], all_llms: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The live LLMServices of `llm`'s namespace and group that ask for a GPU, `llm` included,
    by name (a stable owner order, so an unchanged group writes nothing)."""
    spec = llm.get("spec") or {}
    group = (spec.get("gpuShare") or {}).get("group")
    namespace = (llm.get("metadata") or {}).get("namespace")
    uid = (llm.get("metadata") or {}).get("uid")
    out = {uid: llm}
    for other in all_llms:
        meta, s = other.get("metadata") or {}, other.get("spec") or {}
        if (meta.get("namespace") != namespace or meta.get("deletionTimestamp")
                or (s.get("gpuShare") or {}).get("group") != group):
            continue
        resources = ((s.get("engine") or {}).get("resources") or {})
        if int(resources.get("gpu") or 0) > 0:
            out[meta.get("uid")] = other
    return sorted(out.values(), key=lambda o: str(o["metadata"]["name"]))


def gpu_claim_manifest(namespace: str, group: str, members: Iterable[Mapping[str, Any]],
                       config: OperatorConfig) -> dict[str, Any]:
    """One device of `config.gpu_share_device_class`, owned by every member but controlled by
    none (no member's deletion may take the device from the others): the garbage collector
    deletes it when the last owner is gone."""
    owners = [{"apiVersion": L.API_VERSION, "kind": L.KIND, "name": m["metadata"]["name"],
               "uid": m["metadata"]["uid"], "controller": False} for m in members]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": claim_name(group), "namespace": namespace,
                     "labels": {L.MANAGED_BY: L.MANAGED_BY_VALUE, GROUP_LABEL: group},
                     "ownerReferences": owners},
        "spec": {"devices": {"requests": [{
            "name": POD_CLAIM,
            "exactly": {"deviceClassName": config.gpu_share_device_class, "allocationMode": "ExactCount",
                        "count": 1}}]}},
    }
