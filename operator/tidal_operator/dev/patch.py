"""The four PATCH flavours the Kubernetes API accepts, over plain JSON values.

- JSON merge patch (RFC 7386): exact.
- JSON patch (RFC 6902): exact, including `test`, `move` and `copy`.
- Strategic merge patch: approximate. Lists of named items merge by a key chosen from the
  field name (containers by `name`, conditions by `type`, ...); every other list is replaced.
  The `$patch`, `$setElementOrder/`, `$deleteFromPrimitiveList/` and `$retainKeys` directives
  that kubectl sends are understood or safely dropped.
"""

from __future__ import annotations

import copy
from typing import Any

JSON = Any


class PatchError(ValueError):
    """The patch is malformed or cannot be applied (answered as 422 Invalid)."""


class PatchTestFailed(PatchError):
    """A JSON-patch `test` operation did not hold (answered as 409 Conflict... Kubernetes says 422)."""


# --- JSON merge patch ----------------------------------------------------------------------------


def merge_patch(target: JSON, patch: JSON) -> JSON:
    """RFC 7386: dicts merge recursively, `null` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- JSON patch ----------------------------------------------------------------------------------


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"invalid JSON pointer {pointer!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]


def _list_index(container: list[Any], token: str, *, for_insert: bool) -> int:
    if token == "-" and for_insert:
        return len(container)
    try:
        index = int(token)
    except ValueError as exc:
        raise PatchError(f"invalid list index {token!r}") from exc
    limit = len(container) if for_insert else len(container) - 1
    if index < 0 or index > limit:
        raise PatchError(f"list index {index} out of range")
    return index


def _resolve_parent(doc: JSON, parts: list[str]) -> JSON:
    node = doc
    for token in parts[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"path segment {token!r} does not exist")
            node = node[token]
        elif isinstance(node, list):
            node = node[_list_index(node, token, for_insert=False)]
        else:
            raise PatchError(f"cannot descend into a scalar at {token!r}")
    return node


def _get(doc: JSON, parts: list[str]) -> JSON:
    if not parts:
        return doc
    parent = _resolve_parent(doc, parts)
    last = parts[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {'/'.join(parts)!r} does not exist")
        return parent[last]
    if isinstance(parent, list):
        return parent[_list_index(parent, last, for_insert=False)]
    raise PatchError("cannot index a scalar")


def _remove(doc: JSON, parts: list[str]) -> JSON:
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _resolve_parent(doc, parts)
    last = parts[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {'/'.join(parts)!r} does not exist")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_list_index(parent, last, for_insert=False))
    raise PatchError("cannot remove from a scalar")


def _add(doc: JSON, parts: list[str], value: JSON, *, replace: bool) -> JSON:
    if not parts:
        return value
    parent = _resolve_parent(doc, parts)
    last = parts[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(f"path {'/'.join(parts)!r} does not exist")
        parent[last] = value
    elif isinstance(parent, list):
        if replace:
            parent[_list_index(parent, last, for_insert=False)] = value
        else:
            parent.insert(_list_index(parent, last, for_insert=True), value)
    else:
        raise PatchError("cannot add into a scalar")
    return doc


def json_patch(target: JSON, operations: JSON) -> JSON:
    """RFC 6902 over a deep copy of `target`; the original is never touched."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed operation {op!r}")
        kind, parts = op["op"], _split_pointer(op["path"])
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")), replace=False)
        elif kind == "replace":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")), replace=True)
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "test":
            try:
                actual = _get(doc, parts)
            except PatchError as exc:
                raise PatchTestFailed(f"test failed: {exc}") from exc
            if actual != op.get("value"):
                raise PatchTestFailed(f"test failed at {op['path']}: {actual!r} != {op.get('value')!r}")
        elif kind in ("move", "copy"):
            source = _split_pointer(op.get("from", ""))
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
            doc = _add(doc, parts, value, replace=False)
        else:
            raise PatchError(f"unknown operation {kind!r}")
    return doc


# --- Strategic merge patch (approximate) ---------------------------------------------------------

# Field name -> merge key, as Kubernetes' Go struct tags declare for the common types.
_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "conditions": ("type",),
    "ownerReferences": ("uid",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey",),
    # Container ports merge by containerPort, Service ports by port.
    "ports": ("containerPort", "port"),
    "containerStatuses": ("name",),
}
# Lists of scalars that Kubernetes merges as sets.
_SET_LISTS = {"finalizers"}


def merge_key_for(field: str, items: list[Any]) -> str | None:
    for candidate in _MERGE_KEYS.get(field, ()):
        if all(isinstance(item, dict) and candidate in item for item in items):
            return candidate
    return None


def _strategic_list(field: str, current: list[Any], patch: list[Any]) -> list[Any]:
    if field in _SET_LISTS:
        merged = list(current)
        merged.extend(item for item in patch if item not in merged)
        return merged
    key = merge_key_for(field, [*current, *(p for p in patch if not _is_directive(p))])
    if key is None:
        return [copy.deepcopy(item) for item in patch if not _is_directive(item)]
    merged = [copy.deepcopy(item) for item in current]
    index = {item[key]: pos for pos, item in enumerate(merged)}
    for item in patch:
        if isinstance(item, dict) and item.get("$patch") == "delete":
            if item.get(key) in index:
                merged[index[item[key]]] = None
            continue
        if isinstance(item, dict) and item.get("$patch") == "replace":
            return [copy.deepcopy(p) for p in patch if not _is_directive(p)]
        if item.get(key) in index and merged[index[item[key]]] is not None:
            merged[index[item[key]]] = strategic_merge_patch(merged[index[item[key]]], item)
        else:
            index[item.get(key)] = len(merged)
            merged.append(strategic_merge_patch({}, item))
    return [item for item in merged if item is not None]


def _is_directive(item: Any) -> bool:
    return isinstance(item, dict) and "$patch" in item and len(item) == 1


def strategic_merge_patch(target: JSON, patch: JSON) -> JSON:
    """Approximate strategic merge: named lists merge by key, other lists replace."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue  # ordering hints and retain lists: dropping them is a fine approximation
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _strategic_list(key, result[key], value)
        elif isinstance(value, list):
            result[key] = _strategic_list(key, [], value)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    return result
