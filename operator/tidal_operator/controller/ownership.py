"""Which Pods an LLMService controls: its controller ownerReference, never the labels (which
anyone may edit)."""

from __future__ import annotations

from typing import Any, Mapping

from .. import labels as L
from ..reconcile.manifests import pod_name


def owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


def controller_ref(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((ref for ref in (obj.get("metadata") or {}).get("ownerReferences") or [] if ref.get("controller")),
                None)


def adoption_patch(pod: Mapping[str, Any], owner_ref: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes `owner_ref` the controller of an orphan Pod (one with no
    controller), keeping its other ownerReferences; None when the Pod can't be adopted (it
    has a controller, or is going). The resourceVersion makes the patch fail if the Pod
    changed since it was read, as controller-runtime's adoption does."""
    meta = pod.get("metadata") or {}
    if controller_ref(pod) is not None or meta.get("deletionTimestamp"):
        return None
    refs = [dict(r) for r in meta.get("ownerReferences") or []] + [dict(owner_ref)]
    return {"metadata": {"ownerReferences": refs, "resourceVersion": meta.get("resourceVersion")}}


def owner_name(pod: Mapping[str, Any]) -> str | None:
    """The LLMService that controls this Pod, from its ownerReferences."""
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
