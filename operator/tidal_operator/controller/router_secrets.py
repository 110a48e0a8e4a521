"""Copies of the keys the router needs, in the router's own namespace, so the router reads no
Secret anywhere else (least privilege: list/watch on Secrets in one namespace).

Each round the operator writes, in `router_namespace`, Secrets labelled
`tidal.dev/router-secret`:
- `tidal-engine-key-<LLMService uid>` (value `engine-key`): the engine API key of an
  LLMService with `spec.auth.apiKeySecretRef`, under `api-key`; annotation
  `tidal.dev/llmservice-uid` (the router sends it only to Pods that uid controls);
- `tidal-client-keys-<hash of namespace/name>` (value `client-keys`): a copy of one Secret
  labelled `tidal.dev/client-keys: "true"` in a namespace the operator serves (that namespace's
  client keys); annotations `tidal.dev/namespace` (the source's own namespace: the only one the
  router lets these keys open) and `tidal.dev/source-secret`. Deprecated: a Secret named
  `tidal-client-keys` without the label, in a namespace with LLMServices, is still copied.
Copies whose source is gone (deleted, or its label removed) are deleted: that revokes the keys.
Finding the labelled Secrets takes `list` on Secrets where the operator already has `get`.
Values are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from typing import Any, Mapping
from urllib.parse import quote

from .. import labels as L
from ..api.validation import parse_spec
from ..kube import ApiError, Kube
from ..secret_refs import engine_api_key

log = logging.getLogger("tidal.router_secrets")

ROUTER_SECRET = "tidal.dev/router-secret"  # label: engine-key | client-keys
LLMSERVICE_UID = "tidal.dev/llmservice-uid"
NAMESPACE_ANNOTATION = "tidal.dev/namespace"
SOURCE_SECRET = "tidal.dev/source-secret"  # namespace/name of the engine-key Secret copied
SOURCE_KEY = "tidal.dev/source-key"
CLIENT_KEYS_LABEL = "tidal.dev/client-keys"  # "true" on a tenant's Secret: its values are client keys
CLIENT_KEYS_SELECTOR = f"{CLIENT_KEYS_LABEL}=true"
TENANT_KEYS_SECRET = "tidal-client-keys"  # deprecated: found by this name without the label


def engine_key_copy(llm: Mapping[str, Any], secret_name: str, secret_key: str, value: str) -> dict[str, Any]:
    """The copy of one LLMService's engine key; annotated with where it came from (the router
    looks keys up by the LLMService's apiKeySecretRef)."""
    meta = llm["metadata"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"tidal-engine-key-{meta['uid']}", "labels": {ROUTER_SECRET: "engine-key"},
                         "annotations": {LLMSERVICE_UID: meta["uid"],
                                         L.LLMSERVICE: f"{meta.get('namespace')}/{meta['name']}",
                                         SOURCE_SECRET: f"{meta.get('namespace')}/{secret_name}",
                                         SOURCE_KEY: secret_key}},
            "data": {"api-key": base64.b64encode(value.encode()).decode()}}


def client_keys_copy(namespace: str, name: str, data: Mapping[str, str]) -> dict[str, Any]:
    """The copy of one tenant Secret. Named by a hash (namespace and name together can be
    longer than a Secret name may be); it carries no `tidal.dev/client-keys` label, so it is
    never copied again when the router's namespace is also a tenant's."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:16]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"tidal-client-keys-{digest}", "labels": {ROUTER_SECRET: "client-keys"},
                         "annotations": {NAMESPACE_ANNOTATION: namespace, SOURCE_SECRET: f"{namespace}/{name}"}},
            "data": dict(data)}


async def tenant_key_secrets(kube: Kube, watch_namespace: str | None,
                             llm_namespaces: set[str]) -> list[dict[str, Any]]:
    """The Secrets that hold namespace client keys: every one labelled `tidal.dev/client-keys=true`
    in the served namespace(s), plus (deprecated) one named `tidal-client-keys` in each namespace
    with LLMServices."""
    path = f"/api/v1/namespaces/{watch_namespace}/secrets" if watch_namespace else "/api/v1/secrets"
    listing = await kube.request("GET", path, query={"labelSelector": CLIENT_KEYS_SELECTOR})
    found = [s for s in listing.get("items") or [] if ROUTER_SECRET not in (s["metadata"].get("labels") or {})]
    labelled = {(s["metadata"].get("namespace"), s["metadata"]["name"]) for s in found}
    for namespace in sorted(llm_namespaces):
        if (namespace, TENANT_KEYS_SECRET) not in labelled:
            secret = await read_secret(kube, namespace, TENANT_KEYS_SECRET)
            if secret:
                found.append(secret)
    return found


async def desired_copies(kube: Kube, llms: list[dict[str, Any]],
                         watch_namespace: str | None = None) -> dict[str, dict[str, Any]]:
    """name → Secret body, for every key the router should have now."""
    out: dict[str, dict[str, Any]] = {}
    for llm in llms:
        namespace = llm["metadata"].get("namespace") or "default"
        spec, _ = parse_spec(llm.get("spec") or {})
        if spec is None or spec.auth is None or llm["metadata"].get("deletionTimestamp"):
            continue
        value = await engine_api_key(lambda ns, n: read_secret(kube, ns, n), namespace, spec)
        if value:
            ref = spec.auth.api_key_secret_ref
            body = engine_key_copy(llm, ref.name, ref.key, value)
            out[body["metadata"]["name"]] = body
    llm_namespaces = {o["metadata"].get("namespace") or "default" for o in llms}
    for secret in await tenant_key_secrets(kube, watch_namespace, llm_namespaces):
        meta = secret["metadata"]
        if secret.get("data") and not meta.get("deletionTimestamp"):
            body = client_keys_copy(meta.get("namespace") or "default", meta["name"], secret["data"])
            out[body["metadata"]["name"]] = body
    return out


async def read_secret(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await kube.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{quote(name, safe='')}")
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def sync_router_secrets(kube: Kube, router_namespace: str, watch_namespace: str | None) -> None:
    """One round: create, update and delete the copies in `router_namespace`."""
    desired = await desired_copies(kube, await kube.list_llmservices(watch_namespace), watch_namespace)
    listing = await kube.request("GET", f"/api/v1/namespaces/{router_namespace}/secrets",
                                 query={"labelSelector": ROUTER_SECRET})
    existing = {s["metadata"]["name"]: s for s in listing.get("items") or []}
    for name, body in desired.items():
        current = existing.get(name)
        if current is None:
            await kube.request("POST", f"/api/v1/namespaces/{router_namespace}/secrets", body=body)
        elif current.get("data") != body["data"] or \
                (current["metadata"].get("annotations") or {}) != body["metadata"]["annotations"]:
            await kube.request("PATCH", f"/api/v1/namespaces/{router_namespace}/secrets/{name}", body=body,
                               content_type="application/merge-patch+json")
    for name in existing.keys() - desired.keys():
        try:
            await kube.request("DELETE", f"/api/v1/namespaces/{router_namespace}/secrets/{name}")
        except ApiError as exc:
            if not exc.not_found:
                raise
    log.debug("router secrets in %s: %d copies", router_namespace, len(desired))
