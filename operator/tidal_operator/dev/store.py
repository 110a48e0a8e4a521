"""Resource catalogue, selectors and the in-memory object store with its watch history.

Everything here runs on one event loop, so there is no locking: a snapshot and the
registration of a watcher happen without an `await` in between, which is what makes
"list, then watch from the list's resourceVersion" lose no event.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
from typing import Any, Iterator

Obj = dict[str, Any]
ResourceKey = tuple[str, str]  # (group, plural); storage is shared across a group's versions


@dataclasses.dataclass
class ResourceType:
    group: str  # "" for the core group
    versions: list[str]
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: list[str] = dataclasses.field(default_factory=list)
    categories: list[str] = dataclasses.field(default_factory=list)
    has_status: bool = False
    # A CRD's scale subresource: specReplicasPath, statusReplicasPath, labelSelectorPath.
    scale: dict[str, str] | None = None
    verbs: list[str] = dataclasses.field(
        default_factory=lambda: ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    )

    @property
    def key(self) -> ResourceKey:
        return (self.group, self.plural)

    def api_version(self, version: str | None = None) -> str:
        version = version or self.versions[0]
        return f"{self.group}/{version}" if self.group else version


def builtin_types() -> list[ResourceType]:
    """The built-in resources Tidal, kopf and kubectl touch."""
    R = ResourceType
    return [
        R("", ["v1"], "pods", "pod", "Pod", True, ["po"], ["all"], has_status=True),
        R("", ["v1"], "services", "service", "Service", True, ["svc"], ["all"], has_status=True),
        R("", ["v1"], "endpoints", "endpoints", "Endpoints", True, ["ep"]),
        R("", ["v1"], "secrets", "secret", "Secret", True),
        R("", ["v1"], "configmaps", "configmap", "ConfigMap", True, ["cm"]),
        R("", ["v1"], "events", "event", "Event", True, ["ev"]),
        R("", ["v1"], "namespaces", "namespace", "Namespace", False, ["ns"], has_status=True),
        R("", ["v1"], "nodes", "node", "Node", False, ["no"], has_status=True),
        R("", ["v1"], "persistentvolumeclaims", "persistentvolumeclaim", "PersistentVolumeClaim", True, ["pvc"],
          has_status=True),
        R("", ["v1"], "serviceaccounts", "serviceaccount", "ServiceAccount", True, ["sa"]),
        R("apps", ["v1"], "deployments", "deployment", "Deployment", True, ["deploy"], ["all"], has_status=True),
        R("apps", ["v1"], "statefulsets", "statefulset", "StatefulSet", True, ["sts"], ["all"], has_status=True),
        R("apps", ["v1"], "replicasets", "replicaset", "ReplicaSet", True, ["rs"], ["all"], has_status=True),
        R("coordination.k8s.io", ["v1"], "leases", "lease", "Lease", True),
        R("events.k8s.io", ["v1"], "events", "event", "Event", True, ["ev"]),
        R("autoscaling", ["v2"], "horizontalpodautoscalers", "horizontalpodautoscaler", "HorizontalPodAutoscaler",
          True, ["hpa"], ["all"], has_status=True),
        R("policy", ["v1"], "poddisruptionbudgets", "poddisruptionbudget", "PodDisruptionBudget", True, ["pdb"],
          has_status=True),
        # Stored only: no DRA scheduler or driver allocates it (docs/dev-control-plane.md).
        R("resource.k8s.io", ["v1"], "resourceclaims", "resourceclaim", "ResourceClaim", True, has_status=True),
        R("apiextensions.k8s.io", ["v1"], "customresourcedefinitions", "customresourcedefinition",
          "CustomResourceDefinition", False, ["crd", "crds"], ["api-extensions"], has_status=True),
    ]


# --- Selectors -----------------------------------------------------------------------------------


class SelectorError(ValueError):
    pass


_SET_REQ = re.compile(r"^\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_CMP_REQ = re.compile(r"^\s*([^\s!=,()]+)\s*(==|=|!=)\s*([^\s,()]*)\s*$")
_EXISTS_REQ = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside `( ... )`."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


Requirement = tuple[str, str, tuple[str, ...]]  # (key, operator, values)


def parse_label_selector(text: str | None) -> list[Requirement]:
    requirements: list[Requirement] = []
    for part in _split_top_level(text or ""):
        if match := _SET_REQ.match(part):
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append((match.group(1), match.group(2), values))
        elif match := _CMP_REQ.match(part):
            op = "=" if match.group(2) in ("=", "==") else "!="
            requirements.append((match.group(1), op, (match.group(3),)))
        elif match := _EXISTS_REQ.match(part):
            requirements.append((match.group(2), "!exists" if match.group(1) else "exists", ()))
        else:
            raise SelectorError(f"unable to parse requirement {part!r}")
    return requirements


def parse_field_selector(text: str | None) -> list[Requirement]:
    requirements: list[Requirement] = []
    for part in _split_top_level(text or ""):
        match = _CMP_REQ.match(part)
        if not match:
            raise SelectorError(f"invalid field selector {part!r}")
        op = "=" if match.group(2) in ("=", "==") else "!="
        requirements.append((match.group(1), op, (match.group(3),)))
    return requirements


def _label_matches(labels: dict[str, str], req: Requirement) -> bool:
    key, op, values = req
    if op == "exists":
        return key in labels
    if op == "!exists":
        return key not in labels
    if op in ("=", "in"):
        return key in labels and labels[key] in values
    # "!=" and "notin" also match objects without the label, as in Kubernetes.
    return labels.get(key) not in values


def field_value(obj: Obj, path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


@dataclasses.dataclass
class Selector:
    labels: list[Requirement] = dataclasses.field(default_factory=list)
    fields: list[Requirement] = dataclasses.field(default_factory=list)

    @classmethod
    def parse(cls, label_selector: str | None, field_selector: str | None) -> "Selector":
        return cls(parse_label_selector(label_selector), parse_field_selector(field_selector))

    def matches(self, obj: Obj) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        if not all(_label_matches(labels, req) for req in self.labels):
            return False
        for key, op, (value,) in self.fields:
            actual = field_value(obj, key)
            if (actual == value) != (op == "="):
                return False
        return True


# --- Store ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Change:
    rv: int
    type: str  # ADDED / MODIFIED / DELETED
    key: ResourceKey
    namespace: str | None
    obj: Obj
    old: Obj | None  # the previous version, so selector watches can turn MODIFIED into ADDED/DELETED


@dataclasses.dataclass(eq=False)
class Watcher:
    key: ResourceKey
    namespace: str | None  # None watches every namespace
    selector: Selector
    queue: asyncio.Queue[Any]

    def translate(self, change: Change) -> tuple[str, Obj] | None:
        """The event this watcher sees for a change, or None if it should not see it.

        As kube-apiserver's watch cache does: an object that a modification moves out of the
        selection is sent as DELETED with its *previous* content (stamped with the change's
        resourceVersion), since the new content doesn't match what the watcher asked for."""
        if change.key != self.key or (self.namespace is not None and change.namespace != self.namespace):
            return None
        now = self.selector.matches(change.obj)
        before = change.old is not None and self.selector.matches(change.old)
        if change.type == "MODIFIED":
            if now and before:
                return "MODIFIED", change.obj
            if now:
                return "ADDED", change.obj
            if before:
                assert change.old is not None
                previous = {**change.old, "metadata": {**change.old["metadata"], "resourceVersion": str(change.rv)}}
                return "DELETED", previous
            return None
        return (change.type, change.obj) if now else None


class Store:
    """Objects by resource and (namespace, name), plus a bounded change history for watches."""

    def __init__(self, history_size: int = 10_000) -> None:
        self.rv = 0
        self.objects: dict[ResourceKey, dict[tuple[str, str], Obj]] = collections.defaultdict(dict)
        self.history: collections.deque[Change] = collections.deque(maxlen=history_size)
        self.compacted_rv = 0  # every change at or below this rv has left the history window
        self.watchers: dict[ResourceKey, set[Watcher]] = collections.defaultdict(set)
        # owner uid -> dependents, so garbage collection does not scan the store
        self.dependents: dict[str, set[tuple[ResourceKey, str, str]]] = collections.defaultdict(set)

    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def get(self, key: ResourceKey, namespace: str | None, name: str) -> Obj | None:
        return self.objects[key].get((namespace or "", name))

    def items(self, key: ResourceKey, namespace: str | None) -> Iterator[Obj]:
        for (ns, _), obj in self.objects[key].items():
            if namespace is None or ns == namespace:
                yield obj

    def _index_owners(self, key: ResourceKey, obj: Obj, add: bool) -> None:
        meta = obj["metadata"]
        entry = (key, meta.get("namespace", ""), meta["name"])
        for ref in meta.get("ownerReferences") or []:
            uid = ref.get("uid")
            if not uid:
                continue
            if add:
                self.dependents[uid].add(entry)
            else:
                self.dependents[uid].discard(entry)
                if not self.dependents[uid]:
                    del self.dependents[uid]

    def write(self, key: ResourceKey, obj: Obj, event: str) -> None:
        """Store `obj` (already stamped with the new resourceVersion) and publish the change."""
        meta = obj["metadata"]
        slot = (meta.get("namespace", ""), meta["name"])
        old = self.objects[key].get(slot)
        if old is not None:
            self._index_owners(key, old, add=False)
        if event == "DELETED":
            self.objects[key].pop(slot, None)
        else:
            self.objects[key][slot] = obj
            self._index_owners(key, obj, add=True)
        self._publish(Change(int(meta["resourceVersion"]), event, key, meta.get("namespace"), obj, old))

    def _publish(self, change: Change) -> None:
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(change)
        for watcher in self.watchers.get(change.key, ()):
            event = watcher.translate(change)
            if event is not None:
                watcher.queue.put_nowait(event)

    def changes_since(self, rv: int) -> list[Change] | None:
        """Changes after `rv`, or None when some of them already left the window (410 Gone)."""
        if rv < self.compacted_rv:
            return None
        return [change for change in self.history if change.rv > rv]

    def drop_resource(self, key: ResourceKey) -> None:
        self.objects.pop(key, None)
