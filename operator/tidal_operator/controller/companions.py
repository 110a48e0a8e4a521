"""The objects an LLMService owns besides its Pods: the headless Service and the
PodDisruptionBudget. Each is created if missing and put back if edited; one of that name that
the LLMService doesn't control is never changed. Garbage collection deletes them with it."""

from __future__ import annotations

from typing import Any

from ..api.types import OperatorConfig
from ..kube import Kube
from ..reconcile.manifests import disruption_budget_manifest, service_manifest
from .ownership import controller_ref, owned_by

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
    if not owned_by(current, llm["metadata"]["uid"]):
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
    if not owned_by(current, llm["metadata"]["uid"]):
        return
    have, want = current.get("spec") or {}, desired["spec"]
    if have.get("maxUnavailable") != want["maxUnavailable"] or have.get("selector") != want["selector"]:
        await kube.patch_pdb(namespace, name, {"spec": want})
