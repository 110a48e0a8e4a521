"""Thin async access to the Kubernetes API for the operator (controller/, handlers.py).

Plain dicts in and out (the JSON the API speaks), no model classes: the reconcile functions
work on dicts, and skipping the client's deserialisation keeps 100 LLMServices cheap.
Built on kubernetes_asyncio's ApiClient for configuration and auth (kubeconfig or
in-cluster), with every call made through one small `request()`.

Every write the operator makes goes through here; the verbs used are listed in
docs/operator.md (RBAC).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import datetime, timezone
from typing import Any, Mapping
from urllib.parse import quote

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from . import labels as L

log = logging.getLogger(__name__)
Obj = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON
COMPONENT = "tidal-operator"
# Server-side apply field managers: one per controller that writes an LLMService's status, so
# each owns its own fields and conditions (the CRD lists conditions as a map keyed by type).
MANAGER_RECONCILER = "tidal-operator"
MANAGER_ADAPTERS = "tidal-operator-adapters"
MANAGER_AUTOSCALER = "tidal-operator-autoscaler"


class ApiError(Exception):
    """A non-2xx answer. `reason` is the Status reason (NotFound, AlreadyExists, Conflict...)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def api_missing(self) -> bool:
        """The resource type itself isn't served (its CRD is not installed), not one object."""
        return self.status == 404 and "could not find the requested resource" in self.message

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"


async def load_configuration(kubeconfig: str | None = None) -> k8s.Configuration:
    """In-cluster when running in a Pod (and no kubeconfig is named), else the kubeconfig
    ($KUBECONFIG or ~/.kube/config)."""
    configuration = k8s.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return configuration


class Kube:
    """The operator's API calls. Create with `await Kube.connect()`; `await close()` at the end."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.api = api_client
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> "Kube":
        return cls(k8s.ApiClient(await load_configuration(kubeconfig)))

    async def close(self) -> None:
        await self.api.close()

    # --- the one request function ------------------------------------------------------------

    async def request(self, method: str, path: str, *, body: Any = None, query: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        response = await self.api.call_api(
            path, method, query_params=list((query or {}).items()), header_params=headers,
            body=body, auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        try:
            raw = await response.read()
            status = response.status
        finally:
            response.release()
        data = json.loads(raw) if raw else {}
        if not 200 <= status <= 299:
            raise ApiError(status, str(data.get("reason") or "Error"), str(data.get("message") or raw[:200]))
        return data

    # --- LLMServices ---------------------------------------------------------------------------

    @staticmethod
    def _llm_path(namespace: str | None, name: str | None = None) -> str:
        base = f"/apis/{L.GROUP}/{L.VERSION}"
        base += f"/namespaces/{namespace}/{L.PLURAL}" if namespace else f"/{L.PLURAL}"
        return f"{base}/{name}" if name else base

    async def get_llmservice(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", self._llm_path(namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list_llmservices(self, namespace: str | None = None) -> list[Obj]:
        return list((await self.request("GET", self._llm_path(namespace))).get("items") or [])

    async def apply_llmservice_status(self, namespace: str, name: str, status: Mapping[str, Any], *,
                                      manager: str) -> Obj:
        """Server-side apply of `/status` as `manager`: the fields it sends are its own, the ones
        it sent before and leaves out now are removed, other managers' fields stay. Forced: each
        field has one writing controller by design, so taking it over is never a surprise."""
        body = {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": name, "namespace": namespace},
                "status": dict(status)}
        return await self.request("PATCH", self._llm_path(namespace, name) + "/status", body=body,
                                  query={"fieldManager": manager, "force": "true"}, content_type=APPLY_PATCH)

    async def patch_llmservice_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> Obj:
        """Merge-patch `/status` only: the operator never writes spec."""
        return await self.request("PATCH", self._llm_path(namespace, name) + "/status",
                                  body={"status": dict(status)}, content_type=MERGE_PATCH)

    # --- Pods ----------------------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list_pods(self, namespace: str, label_selector: str | None = None) -> list[Obj]:
        listing = await self.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                                     query={"labelSelector": label_selector} if label_selector else None)
        return list(listing.get("items") or [])

    async def create_pod(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """True if created; False if a Pod of that name exists already (a retried create)."""
        try:
            await self.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=dict(body))
            return True
        except ApiError as exc:
            if exc.already_exists:
                return False
            raise

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> bool:
        """True if the delete was accepted; False if the Pod (with that uid) is gone already."""
        options: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid:
            # Never delete a same-named successor by accident.
            options["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body=options)
            return True
        except ApiError as exc:
            if exc.not_found or exc.status == 409:
                return False
            raise

    async def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", body=dict(patch),
                           content_type=MERGE_PATCH)

    # --- Services ------------------------------------------------------------------------------

    async def get_service(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", f"/api/v1/namespaces/{namespace}/services/{name}")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def create_service(self, namespace: str, body: Mapping[str, Any]) -> bool:
        try:
            await self.request("POST", f"/api/v1/namespaces/{namespace}/services", body=dict(body))
            return True
        except ApiError as exc:
            if exc.already_exists:
                return False
            raise

    async def patch_service(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.request("PATCH", f"/api/v1/namespaces/{namespace}/services/{name}", body=dict(patch),
                           content_type=MERGE_PATCH)

    # --- PodDisruptionBudgets ------------------------------------------------------------------

    async def get_pdb(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def create_pdb(self, namespace: str, body: Mapping[str, Any]) -> bool:
        try:
            await self.request("POST", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", body=dict(body))
            return True
        except ApiError as exc:
            if exc.already_exists:
                return False
            raise

    async def patch_pdb(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.request("PATCH", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
                           body=dict(patch), content_type=MERGE_PATCH)

    # --- the external autoscalers of modes hpa and keda ----------------------------------------
    # An HPA (autoscaling/v2) or a KEDA ScaledObject per LLMService, owned like its Pods.

    async def get_hpa(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/{name}")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def create_hpa(self, namespace: str, body: Mapping[str, Any]) -> None:
        await self.request("POST", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers",
                           body=dict(body))

    async def patch_hpa(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.request("PATCH", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/{name}",
                           body=dict(patch), content_type=MERGE_PATCH)

    async def delete_hpa(self, namespace: str, name: str) -> None:
        await self.request("DELETE", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/{name}")

    async def get_scaled_object(self, namespace: str, name: str) -> Obj | None:
        """None if absent. Raises ApiError with `api_missing` when KEDA is not installed."""
        try:
            return await self.request("GET", f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{name}")
        except ApiError as exc:
            if exc.not_found and not exc.api_missing:
                return None
            raise

    async def create_scaled_object(self, namespace: str, body: Mapping[str, Any]) -> None:
        await self.request("POST", f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects", body=dict(body))

    async def patch_scaled_object(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.request("PATCH", f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{name}",
                           body=dict(patch), content_type=MERGE_PATCH)

    async def delete_scaled_object(self, namespace: str, name: str) -> None:
        await self.request("DELETE", f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{name}")

    # --- the ResourceClaim a GPU-share group shares (resource.k8s.io/v1, Dynamic Resource Allocation)

    async def get_resource_claim(self, namespace: str, name: str) -> Obj | None:
        """None if absent. Raises ApiError with `api_missing` when the cluster doesn't serve
        resource.k8s.io/v1 (DRA off, or Kubernetes before 1.34)."""
        try:
            return await self.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
        except ApiError as exc:
            if exc.not_found and not exc.api_missing:
                return None
            raise

    async def create_resource_claim(self, namespace: str, body: Mapping[str, Any]) -> None:
        await self.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", body=dict(body))

    async def apply_resource_claim(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """Server-side apply as the reconciler: its owners and labels follow the group."""
        await self.request("PATCH", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
                           body=dict(body), query={"fieldManager": MANAGER_RECONCILER, "force": "true"},
                           content_type=APPLY_PATCH)

    # --- Secrets: existence only ---------------------------------------------------------------

    async def secret_exists(self, namespace: str, name: str) -> bool:
        """Whether the Secret exists. The operator never reads or logs the value; it only
        checks that an engine referring to it can start."""
        try:
            await self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{quote(name, safe='')}")
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            raise

    # --- Events --------------------------------------------------------------------------------

    async def post_event(self, involved: Mapping[str, Any], *, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about `involved` (an object body). Best effort: an Event that
        can't be posted must not fail a reconcile."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        now_micro = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": namespace},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": namespace, "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self.instance[:128],
            "action": reason, "firstTimestamp": now, "lastTimestamp": now, "eventTime": now_micro, "count": 1,
        }
        try:
            await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=event)
        except Exception as exc:  # noqa: BLE001 - events are advisory
            log.warning("could not post event %s for %s/%s: %s", reason, namespace, meta.get("name"), exc)

    # --- kopf peering (read only) --------------------------------------------------------------

    async def get_peering(self, name: str, namespace: str | None) -> Obj | None:
        """The kopf peering object (KopfPeering in `namespace`, else ClusterKopfPeering)."""
        path = (f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{name}" if namespace
                else f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}")
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
