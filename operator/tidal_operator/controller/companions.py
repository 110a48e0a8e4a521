"""The objects an LLMService owns besides its Pods: the headless Service and the
PodDisruptionBudget. Each is created if missing and put back if edited; one of that name that
the LLMService doesn't control is never changed, except an orphan its earlier incarnation left
(`kubectl delete --cascade=orphan`, then applied again), which is adopted, as its Pods are.
Garbage collection deletes them with it."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping

from .. import labels as L
from ..api.types import OperatorConfig
from ..kube import ApiError, Kube
from ..reconcile.manifests import disruption_budget_manifest, owner_reference, service_manifest
from .ownership import adoption_patch, controller_ref, owned_by

Obj = dict[str, Any]


async def ensure_service_for(kube: Kube, config: OperatorConfig, llm: Obj, *, repair: bool = True) -> str | None:
    """Create the headless Service, or put its selector and ports back (`repair`). A Service of
    that name this LLMService doesn't control (a user's) is never changed: the returned message
    says so, for the ServiceConflict condition."""
    desired = service_manifest(llm, config)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = await kube.get_service(namespace, name)
    if current is None:
        if repair and await kube.create_service(namespace, desired):
            await kube.post_event(llm, type_="Normal", reason="CreatedService", message=f"created service {name}")
        return None
    ours = owned_by(current, llm["metadata"]["uid"])
    if not ours and not (repair and await adopt_if_left_by(kube, kube.patch_service, llm, current)):
        other = controller_ref(current)
        by = f"controlled by {other.get('kind')} {other.get('name')}" if other else "not created by this LLMService"
        return (f"Service {name} exists and is {by}: it is left alone and the LLMService has no "
                "Service endpoint; delete or rename that Service, or rename the LLMService")
    have, want = current.get("spec") or {}, desired["spec"]
    if repair and (have.get("selector") != want["selector"] or have.get("ports") != want["ports"]):
        # Selector and ports only: clusterIP is immutable, and other fields may be defaulted.
        await kube.patch_service(namespace, name, {"spec": {"selector": want["selector"], "ports": want["ports"]}})
    return None


async def ensure_disruption_budget(kube: Kube, config: OperatorConfig, llm: Obj) -> None:
    """Create the PodDisruptionBudget, or put its maxUnavailable and selector back. One of that
    name this LLMService doesn't control is left alone."""
    desired = disruption_budget_manifest(llm, config)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = await kube.get_pdb(namespace, name)
    if current is None:
        if await kube.create_pdb(namespace, desired):
            await kube.post_event(llm, type_="Normal", reason="CreatedPodDisruptionBudget",
                                  message=f"created poddisruptionbudget {name}")
        return
    if not owned_by(current, llm["metadata"]["uid"]) and not await adopt_if_left_by(kube, kube.patch_pdb, llm, current):
        return
    have, want = current.get("spec") or {}, desired["spec"]
    if have.get("maxUnavailable") != want["maxUnavailable"] or have.get("selector") != want["selector"]:
        await kube.patch_pdb(namespace, name, {"spec": want})


def left_by(llm: Mapping[str, Any], obj: Mapping[str, Any]) -> bool:
    """An orphan the operator made for an LLMService of this name: no controller, and the
    operator's labels for that name (a user's object of the same name has neither)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return (controller_ref(obj) is None and labels.get(L.MANAGED_BY) == L.MANAGED_BY_VALUE
            and labels.get(L.LLMSERVICE) == llm["metadata"]["name"])


async def adopt_if_left_by(kube: Kube, patch: Callable[[str, str, Mapping[str, Any]], Awaitable[None]], llm: Obj,
                           obj: Obj) -> bool:
    """Make `llm` the controller of an orphan it left (see `left_by`); whether it now is."""
    change = adoption_patch(obj, owner_reference(llm)) if left_by(llm, obj) else None
    if change is None:
        return False
    meta = obj["metadata"]
    try:
        await patch(meta["namespace"], meta["name"], change)
    except ApiError as exc:
        if exc.status in (404, 409):
            return False  # changed or gone since it was read: the next pass looks again
        raise
    kind = str(obj.get("kind") or "object")
    await kube.post_event(llm, type_="Normal", reason=f"Adopted{kind}",
                          message=f"adopted the orphan {kind.lower()} {meta['name']}")
    return True
