"""Finding the Pods an LLMService controls, and settling a create that met AlreadyExists."""

from __future__ import annotations

from typing import Any

from ..kube import ApiError, Kube
from ..reconcile.manifests import owner_reference
from .ownership import adoption_patch, controller_ref, owned_by

Obj = dict[str, Any]


async def owned_pods(kube: Kube, namespace: str, uid: str) -> list[Obj]:
    """The Pods this LLMService controls, by ownerReference uid: labels can be edited by anyone,
    and a Pod whose labels changed must still be found (and repaired), not created again."""
    return [p for p in await kube.list_pods(namespace) if owned_by(p, uid)]


async def adopt_existing(kube: Kube, llm: Obj, pod_name_: str) -> bool:
    """A create answered AlreadyExists. Ours already (another pass got there first): nothing to
    do. An orphan of that name: adopt it (the next pass repairs its metadata, or replaces it if
    its container differs). Controlled by something else: say so; it is never touched."""
    namespace = llm["metadata"]["namespace"]
    pod = await kube.get_pod(namespace, pod_name_)
    if pod is None or owned_by(pod, llm["metadata"]["uid"]):
        return False
    patch = adoption_patch(pod, owner_reference(llm))
    if patch is None:
        other = controller_ref(pod) or {}
        await kube.post_event(llm, type_="Warning", reason="PodNameConflict",
                              message=f"pod {pod_name_} exists and is controlled by {other.get('kind', '?')} "
                                      f"{other.get('name', '?')} (or is being deleted): not touched")
        return False
    try:
        await kube.patch_pod(namespace, pod_name_, patch)
    except ApiError as exc:
        if exc.status in (404, 409):
            return False  # changed or gone since it was read: the next pass looks again
        raise
    await kube.post_event(llm, type_="Normal", reason="AdoptedPod", message=f"adopted the orphan pod {pod_name_}")
    return True
