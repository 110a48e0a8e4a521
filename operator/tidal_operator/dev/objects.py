"""Object semantics of the emulated API server, free of HTTP: create, update, patch, delete,
finalizers, the /status subresource, garbage collection and CRD registration.
"""

from __future__ import annotations

import base64
import copy
import datetime
import secrets
import string
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from . import apply as ssa
from .schema import admit

from .patch import PatchError, PatchTestFailed, json_patch, merge_patch, strategic_merge_patch
from .store import Obj, ResourceKey, ResourceType, Store, builtin_types

CRD_KEY: ResourceKey = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY: ResourceKey = ("", "namespaces")
POD_KEY: ResourceKey = ("", "pods")
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class ApiError(Exception):
    """Answered to the client as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "details": self.details, "code": self.code,
        }


def not_found(rt: ResourceType, name: str) -> ApiError:
    what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    return ApiError(404, "NotFound", f'{what} "{name}" not found',
                    {"name": name, "group": rt.group, "kind": rt.plural})


def now_iso(offset_s: float = 0.0) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


DEFAULT_APPLIER = "unknown"  # an apply without ?fieldManager (kube-apiserver refuses those)


def _without_managed(obj: Obj) -> Obj:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("managedFields", "resourceVersion")}
    return {**obj, "metadata": meta}


def _at_path(obj: Obj, path: str) -> Any:
    """The value at a CRD scale path such as `.spec.replicas` (None if absent)."""
    node: Any = obj
    for part in [p for p in path.split(".") if p]:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set_path(obj: Obj, path: str, value: Any) -> None:
    parts = [p for p in path.split(".") if p]
    node = obj
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _content(obj: Obj) -> Obj:
    """What `generation` tracks: everything except metadata, status and the type header."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


class ObjectApi:
    """The API semantics over a `Store`. All methods are synchronous and run on the server loop."""

    def __init__(self, store: Store, auto_create_namespaces: bool = True) -> None:
        self.store = store
        self.auto_create_namespaces = auto_create_namespaces
        self.types: dict[ResourceKey, ResourceType] = {}
        self.by_group_version: dict[tuple[str, str], dict[str, ResourceType]] = {}
        self.live_uids: set[str] = set()
        self._service_ips = 10
        # (group, plural) -> version -> openAPIV3Schema, for the CRDs' custom resources.
        self.schemas: dict[ResourceKey, dict[str, Obj]] = {}
        # Called with (rt, final object) whenever an object is removed for good.
        self.on_removed: list[Callable[[ResourceType, Obj], None]] = []
        for rt in builtin_types():
            self.register_type(rt)
        for ns in INITIAL_NAMESPACES:
            self.create(self.types[NAMESPACE_KEY], None, {"metadata": {"name": ns}})

    # --- catalogue -------------------------------------------------------------------------------

    def register_type(self, rt: ResourceType) -> None:
        old = self.types.get(rt.key)
        if old is not None:
            for version in old.versions:
                self.by_group_version.get((old.group, version), {}).pop(old.plural, None)
        self.types[rt.key] = rt
        for version in rt.versions:
            self.by_group_version.setdefault((rt.group, version), {})[rt.plural] = rt

    def unregister_type(self, key: ResourceKey) -> None:
        self.schemas.pop(key, None)
        rt = self.types.pop(key, None)
        if rt is None:
            return
        for version in rt.versions:
            group_version = self.by_group_version.get((rt.group, version), {})
            group_version.pop(rt.plural, None)
            if not group_version:
                self.by_group_version.pop((rt.group, version), None)

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.by_group_version.get((group, version), {}).get(plural)

    # --- helpers ---------------------------------------------------------------------------------

    def present(self, obj: Obj, rt: ResourceType, version: str) -> Obj:
        """The object as seen through `version` (CRDs: no conversion, only apiVersion changes)."""
        api_version = rt.api_version(version)
        if obj.get("apiVersion") == api_version:
            return obj
        return {**obj, "apiVersion": api_version}

    def _stamp(self, obj: Obj) -> None:
        obj["metadata"]["resourceVersion"] = str(self.store.next_rv())

    def _ensure_namespace(self, namespace: str) -> None:
        if self.store.get(NAMESPACE_KEY, None, namespace) is not None:
            return
        if not self.auto_create_namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})
        self.create(self.types[NAMESPACE_KEY], None, {"metadata": {"name": namespace}})

    # --- create ----------------------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str | None, body: Any, *, version: str | None = None,
               dry_run: bool = False) -> Obj:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", "the body must be an object with metadata")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            alphabet = string.ascii_lowercase + string.digits
            meta["name"] = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
        if rt.namespaced:
            body_ns = meta.get("namespace")
            if namespace and body_ns and body_ns != namespace:
                raise ApiError(400, "BadRequest",
                               "the namespace of the provided object does not match the namespace sent on the request")
            namespace = namespace or body_ns or "default"
            meta["namespace"] = namespace
            self._ensure_namespace(namespace)
        else:
            meta.pop("namespace", None)
        if self.store.get(rt.key, namespace, meta["name"]) is not None:
            what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            raise ApiError(409, "AlreadyExists", f'{what} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": rt.group, "kind": rt.plural})
        obj["apiVersion"] = rt.api_version(version)
        obj["kind"] = rt.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(field, None)
        if rt.has_status:
            obj.pop("status", None)  # status is only written through /status
        self._defaults_on_create(rt, obj)
        obj = self._admit(rt, obj)
        meta = obj["metadata"]
        if dry_run:
            return obj
        self._stamp(obj)
        self.store.write(rt.key, obj, "ADDED")
        self.live_uids.add(meta["uid"])
        return obj

    def _admit(self, rt: ResourceType, obj: Obj) -> Obj:
        """A custom resource as kube-apiserver stores it: defaulted and pruned by its CRD's
        schema; 422 when it doesn't validate (dev/schema.py)."""
        versions = self.schemas.get(rt.key)
        if not versions:
            return obj
        version = str(obj.get("apiVersion", "")).rpartition("/")[2]
        schema = versions.get(version) or next(iter(versions.values()))
        stored, errors = admit(schema, obj)
        if errors:
            name = obj["metadata"].get("name", "")
            causes = [{"reason": "FieldValueInvalid", "message": str(e), "field": e.path} for e in errors]
            raise ApiError(422, "Invalid", f'{rt.kind}.{rt.group} "{name}" is invalid: '
                                           + ", ".join(str(e) for e in errors),
                           {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})
        return stored

    def _defaults_on_create(self, rt: ResourceType, obj: Obj) -> None:
        """The few defaults and side effects of real controllers that clients rely on."""
        if rt.key == ("", "secrets"):
            self._fold_string_data(obj)
            if not obj.get("type"):
                obj["type"] = "Opaque"  # kube-apiserver's default
        elif rt.key == POD_KEY:
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif rt.key == ("", "services"):
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if spec.get("clusterIP") != "None":
                self._service_ips += 1
                ip = f"10.96.{self._service_ips // 250}.{self._service_ips % 250 + 1}"
                spec.setdefault("clusterIP", ip)
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
        elif rt.key == NAMESPACE_KEY:
            obj["status"] = {"phase": "Active"}
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif rt.key == CRD_KEY:
            obj["status"] = self._register_crd(obj)

    @staticmethod
    def _fold_string_data(obj: Obj) -> None:
        string_data = obj.pop("stringData", None) or {}
        data = obj.setdefault("data", {}) if string_data else obj.get("data")
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()

    # --- read ------------------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self.store.get(rt.key, namespace if rt.namespaced else None, name)
        if obj is None:
            raise not_found(rt, name)
        return obj

    # --- update ----------------------------------------------------------------------------------

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: Any, *,
               subresource: str | None = None, version: str | None = None, dry_run: bool = False,
               managed: list[Obj] | None = None) -> Obj:
        """PUT semantics; PATCH computes the full new object and lands here too. `managed`: the
        managedFields a server-side apply computed; any other write takes the fields it changes
        away from their appliers (dev/apply.py)."""
        old = self.get(rt, namespace, name)
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", "the body must be an object with metadata")
        new_meta = body.get("metadata") or {}
        if new_meta.get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        expected_rv = new_meta.get("resourceVersion")
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {what} "{name}": the object has been '
                                            "modified; please apply your changes to the latest version and try again",
                           {"name": name, "group": rt.group, "kind": rt.plural})
        if subresource == "status":
            new = {**old, "status": copy.deepcopy(body.get("status"))}
            if new["status"] is None:
                new.pop("status")
        else:
            new = copy.deepcopy(body)
            new["metadata"] = meta = dict(new.get("metadata") or {})
            for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                          "namespace", "name", "generation"):
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
                else:
                    meta.pop(field, None)
            if rt.has_status:
                new.pop("status", None)
                if "status" in old:
                    new["status"] = old["status"]
            if rt.key == ("", "secrets"):
                self._fold_string_data(new)
        new["apiVersion"] = old["apiVersion"]
        new["kind"] = rt.kind
        new["metadata"] = {**new["metadata"], "resourceVersion": old["metadata"]["resourceVersion"]}
        if managed is None:
            owners = ssa.managers(old)
            ssa.strip_changed(_without_managed(old), _without_managed(new), owners)
            managed = ssa.managed_fields(owners, old["apiVersion"], old["metadata"].get("managedFields") or [], None)
        if managed:
            new["metadata"]["managedFields"] = managed
        else:
            new["metadata"].pop("managedFields", None)
        new = self._admit(rt, new)
        if _content(new) != _content(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new == old:
            return old  # a no-op write keeps its resourceVersion, as in Kubernetes
        if rt.key == CRD_KEY and subresource is None:
            new["status"] = self._register_crd(new)
        if dry_run:
            return new
        self._stamp(new)
        if self._ready_to_remove(rt, new):
            self._remove(rt, new)
        else:
            self.store.write(rt.key, new, "MODIFIED")
        return new

    def patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, raw: bytes, *,
              subresource: str | None = None, version: str | None = None, dry_run: bool = False,
              field_manager: str | None = None, force: bool = False) -> tuple[int, Obj]:
        media = content_type.split(";")[0].strip()
        try:
            payload = yaml.safe_load(raw) if media == APPLY_PATCH else _json_loads(raw)
        except Exception as exc:  # the client sent garbage; say so rather than 500
            raise ApiError(400, "BadRequest", f"cannot decode patch: {exc}") from exc
        existing = self.store.get(rt.key, namespace if rt.namespaced else None, name)
        if existing is None:
            if media == APPLY_PATCH and subresource is None:  # server-side apply creates
                if isinstance(payload, dict):
                    payload.setdefault("metadata", {}).setdefault("name", name)
                    owned = ssa.field_paths(ssa.owned_part(payload, None, rt.has_status))
                    owned.pop((), None)
                    payload["metadata"]["managedFields"] = ssa.managed_fields(
                        {(field_manager or DEFAULT_APPLIER, ""): set(owned)}, rt.api_version(version), [], None)
                return 201, self.create(rt, namespace, payload, version=version, dry_run=dry_run)
            raise not_found(rt, name)
        try:
            if media == MERGE_PATCH:
                new = merge_patch(existing, payload)
            elif media == JSON_PATCH:
                new = json_patch(existing, payload)
            elif media == APPLY_PATCH:
                if not isinstance(payload, dict):
                    raise PatchError("an apply configuration must be an object")
                return self._apply(rt, namespace, name, existing, payload, subresource=subresource,
                                   version=version, dry_run=dry_run, manager=field_manager or DEFAULT_APPLIER,
                                   force=force)
            elif media == STRATEGIC_PATCH:
                new = strategic_merge_patch(existing, payload)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the media type {media!r} is not supported")
        except PatchTestFailed as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        except PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patch did not produce an object")
        # A resourceVersion the patch put in the object is a precondition; none means "any".
        if new.get("metadata", {}).get("resourceVersion") == existing["metadata"]["resourceVersion"]:
            new["metadata"] = {**new["metadata"]}
            new["metadata"].pop("resourceVersion")
        return 200, self.update(rt, namespace, name, new, subresource=subresource, version=version, dry_run=dry_run)

    def _apply(self, rt: ResourceType, namespace: str | None, name: str, existing: Obj, config: Obj, *,
               subresource: str | None, version: str | None, dry_run: bool, manager: str,
               force: bool) -> tuple[int, Obj]:
        """Server-side apply onto an existing object, with field ownership (dev/apply.py)."""
        expected_rv = (config.get("metadata") or {}).get("resourceVersion")
        try:
            merged, owners = ssa.apply(existing, config, manager=manager, subresource=subresource,
                                       has_status=rt.has_status, force=force)
        except ssa.ApplyConflict as exc:
            raise ApiError(409, "Conflict", str(exc), {"name": name, "group": rt.group, "kind": rt.plural}) from exc
        if owners == ssa.managers(existing) and _without_managed(merged) == _without_managed(existing):
            return 200, existing  # nothing to change: no write, as in Kubernetes
        managed = ssa.managed_fields(owners, existing["apiVersion"], existing["metadata"].get("managedFields") or [],
                                     (manager, subresource or ""))
        merged["metadata"] = {**merged["metadata"]}
        if expected_rv:
            merged["metadata"]["resourceVersion"] = expected_rv
        else:
            merged["metadata"].pop("resourceVersion", None)
        return 200, self.update(rt, namespace, name, merged, subresource=subresource, version=version,
                                dry_run=dry_run, managed=managed)

    # --- the scale subresource --------------------------------------------------------------------

    def get_scale(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        """autoscaling/v1 Scale, read through the CRD's scale paths (`kubectl scale`, HPAs)."""
        assert rt.scale is not None
        obj = self.get(rt, namespace, name)
        meta = obj["metadata"]
        spec_replicas = _at_path(obj, rt.scale.get("specReplicasPath", ""))
        status_replicas = _at_path(obj, rt.scale.get("statusReplicasPath", ""))
        status: Obj = {"replicas": status_replicas if isinstance(status_replicas, int) else 0}
        selector = _at_path(obj, rt.scale.get("labelSelectorPath", "")) if rt.scale.get("labelSelectorPath") else None
        if isinstance(selector, str):
            status["selector"] = selector
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": spec_replicas if isinstance(spec_replicas, int) else 0}, "status": status}

    def write_scale(self, rt: ResourceType, namespace: str | None, name: str, patch_type: str | None, raw: bytes, *,
                    dry_run: bool = False) -> Obj:
        """PUT (patch_type None: `raw` is a Scale) or PATCH of the scale subresource: only the
        replica count at specReplicasPath changes."""
        assert rt.scale is not None
        current = self.get_scale(rt, namespace, name)
        try:
            body = _json_loads(raw)
            media = (patch_type or "").split(";")[0].strip()
            if patch_type is None:
                scale = body
            elif media == MERGE_PATCH:
                scale = merge_patch(current, body)
            elif media == JSON_PATCH:
                scale = json_patch(current, body)
            elif media == STRATEGIC_PATCH:
                scale = strategic_merge_patch(current, body)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the media type {media!r} is not supported for scale")
        except PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"cannot decode the body: {exc}") from exc
        replicas = ((scale or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer")
        obj = copy.deepcopy(self.get(rt, namespace, name))
        expected_rv = ((scale or {}).get("metadata") or {}).get("resourceVersion")
        if expected_rv:
            obj["metadata"]["resourceVersion"] = expected_rv
        else:
            obj["metadata"].pop("resourceVersion", None)
        _set_path(obj, rt.scale.get("specReplicasPath", ".spec.replicas"), replicas)
        self.update(rt, namespace, name, obj, version=None, dry_run=dry_run)
        return self.get_scale(rt, namespace, name) if not dry_run else {**current, "spec": {"replicas": replicas}}

    # --- delete ----------------------------------------------------------------------------------

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: dict[str, Any] | None = None,
               *, dry_run: bool = False) -> Obj:
        options = options or {}
        old = self.get(rt, namespace, name)
        meta = old["metadata"]
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != meta["uid"] or (
                preconditions.get("resourceVersion") and preconditions["resourceVersion"] != meta["resourceVersion"]):
            raise ApiError(409, "Conflict", f'Precondition failed for {rt.plural} "{name}"',
                           {"name": name, "group": rt.group, "kind": rt.plural})
        if dry_run:
            return old
        grace = options.get("gracePeriodSeconds")
        if rt.key == POD_KEY and self._pod_needs_kubelet(old) and grace != 0:
            # A scheduled pod is only marked; its kubelet stops it, then deletes with grace 0.
            grace = int(grace if grace is not None else old["spec"].get("terminationGracePeriodSeconds", 30))
            if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", grace) <= grace:
                return old
            return self._mark_deleting(rt, old, grace)
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", 0) == 0:
                return old
            return self._mark_deleting(rt, old, 0)
        return self._remove(rt, old, orphan=options.get("propagationPolicy") == "Orphan")

    @staticmethod
    def _ready_to_remove(rt: ResourceType, obj: Obj) -> bool:
        """Deleting, no finalizers left and, for pods, the kubelet's grace period is over."""
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return False
        return rt.key != POD_KEY or meta.get("deletionGracePeriodSeconds", 0) == 0

    @staticmethod
    def _pod_needs_kubelet(pod: Obj) -> bool:
        return bool(pod.get("spec", {}).get("nodeName")) and \
            pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")

    def _mark_deleting(self, rt: ResourceType, old: Obj, grace: int) -> Obj:
        new = {**old, "metadata": {**old["metadata"], "deletionTimestamp": now_iso(grace),
                                   "deletionGracePeriodSeconds": grace}}
        self._stamp(new)
        self.store.write(rt.key, new, "MODIFIED")
        return new

    def _remove(self, rt: ResourceType, obj: Obj, orphan: bool = False) -> Obj:
        """Remove for good, then cascade: CRD instances, namespace contents, owned objects."""
        final = {**obj, "metadata": dict(obj["metadata"])}
        self._stamp(final)
        self.store.write(rt.key, final, "DELETED")
        uid = final["metadata"]["uid"]
        self.live_uids.discard(uid)
        for callback in self.on_removed:
            callback(rt, final)
        if rt.key == CRD_KEY:
            self._drop_crd(final)
        elif rt.key == NAMESPACE_KEY:
            self._empty_namespace(final["metadata"]["name"])
        if orphan:
            self._orphan_dependents(uid)
        else:
            self._collect_garbage(uid)
        return final

    def _orphan_dependents(self, owner_uid: str) -> None:
        """`propagationPolicy: Orphan`, as Kubernetes' garbage collector does it: the dependents
        stay, without their ownerReference to the deleted owner."""
        for key, namespace, name in list(self.store.dependents.get(owner_uid, ())):
            dependent = self.store.get(key, namespace or None, name)
            if dependent is None:
                continue
            refs = [r for r in dependent["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
            meta = {k: v for k, v in dependent["metadata"].items() if k != "ownerReferences"}
            new = {**dependent, "metadata": {**meta, **({"ownerReferences": refs} if refs else {})}}
            self._stamp(new)
            self.store.write(key, new, "MODIFIED")

    def _collect_garbage(self, owner_uid: str) -> None:
        for key, namespace, name in list(self.store.dependents.get(owner_uid, ())):
            dependent = self.store.get(key, namespace or None, name)
            rt = self.types.get(key)
            if dependent is None or rt is None:
                continue
            refs = dependent["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") in self.live_uids for ref in refs if ref.get("uid") != owner_uid):
                continue  # another owner is alive: Kubernetes keeps the dependent
            try:
                self.delete(rt, namespace or None, name, {"propagationPolicy": "Background"})
            except ApiError:
                pass

    def _empty_namespace(self, namespace: str) -> None:
        for rt in list(self.types.values()):
            if not rt.namespaced:
                continue
            for obj in list(self.store.items(rt.key, namespace)):
                try:
                    self.delete(rt, namespace, obj["metadata"]["name"], {"gracePeriodSeconds": 0})
                except ApiError:
                    pass

    # --- CRDs ------------------------------------------------------------------------------------

    def _register_crd(self, crd: Obj) -> Obj:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
        if not (group and plural and kind):
            raise ApiError(422, "Invalid", "spec.group, spec.names.plural and spec.names.kind are required")
        if crd["metadata"]["name"] != f"{plural}.{group}":
            raise ApiError(422, "Invalid", f'metadata.name: Invalid value: must be spec.names.plural+"."+spec.group')
        versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
        if not versions:
            raise ApiError(422, "Invalid", "spec.versions: at least one served version is required")
        # Storage (preferred) version first, as discovery's preferredVersion.
        versions.sort(key=lambda v: not v.get("storage", False))
        existing = self.types.get((group, plural))
        if existing is not None and (group, plural) not in self._crd_keys():
            raise ApiError(422, "Invalid", f"{plural}.{group} clashes with a built-in resource")
        self.schemas[(group, plural)] = {v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") or {}
                                         for v in versions if (v.get("schema") or {}).get("openAPIV3Schema")}
        self.register_type(ResourceType(
            group=group, versions=[v["name"] for v in versions], plural=plural,
            singular=names.get("singular") or kind.lower(), kind=kind,
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            has_status=any("status" in (v.get("subresources") or {}) for v in versions),
            scale=next(((v.get("subresources") or {}).get("scale") for v in versions
                        if isinstance((v.get("subresources") or {}).get("scale"), dict)), None),
        ))
        stamp = now_iso()
        accepted = {"plural": plural, "singular": names.get("singular") or kind.lower(), "kind": kind,
                    "listKind": names.get("listKind") or f"{kind}List",
                    **{k: names[k] for k in ("shortNames", "categories") if k in names}}
        return {
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": stamp},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": stamp},
            ],
            "acceptedNames": accepted,
            "storedVersions": [versions[0]["name"]],
        }

    def _crd_keys(self) -> set[ResourceKey]:
        return {(o["spec"]["group"], o["spec"]["names"]["plural"]) for o in self.store.items(CRD_KEY, None)}

    def _drop_crd(self, crd: Obj) -> None:
        key = (crd["spec"]["group"], crd["spec"]["names"]["plural"])
        rt = self.types.get(key)
        if rt is None:
            return
        for obj in list(self.store.items(key, None)):
            final = {**obj, "metadata": {**obj["metadata"], "finalizers": []}}
            self._remove(rt, final)
        self.unregister_type(key)

    def register_crds_from_dir(self, path: str | Path) -> list[str]:
        """Create every CustomResourceDefinition found in `path/*.yaml` (and `.yml`, `.json`)."""
        names = []
        directory = Path(path)
        files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml"), *directory.glob("*.json")])
        for file in files:
            for doc in yaml.safe_load_all(file.read_text()):
                if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                    continue
                crd_type = self.types[CRD_KEY]
                name = doc["metadata"]["name"]
                if self.store.get(CRD_KEY, None, name) is None:
                    self.create(crd_type, None, doc)
                else:
                    current = self.store.get(CRD_KEY, None, name)
                    self.update(crd_type, None, name, {**doc, "metadata": {**doc["metadata"],
                                "resourceVersion": current["metadata"]["resourceVersion"]}})
                names.append(name)
        return names


def _json_loads(raw: bytes) -> Any:
    import json

    return json.loads(raw or b"null")
