"""Server-side apply with field ownership: the part of Kubernetes' structured-merge-diff that
controllers rely on.

Each manager that applies owns the fields it sent (`metadata.managedFields`, FieldsV1). An
apply merges the configuration in (lists of named items, such as `conditions` keyed by `type`,
merge item by item, so two managers can own different conditions of one list), then removes
the fields this manager owned before, left out now, and nobody else owns. A field another
manager owns with a different value is a conflict (409) unless `force=true`, which moves the
ownership. Writes that are not applies (update, merge/JSON/strategic patch) take the fields they
change away from the appliers, so a later apply that leaves them out doesn't remove them.
Approximations: only appliers are recorded as managers (an update's manager is not, so an
update never causes a conflict), and list keys come from patch.py's table, not from schemas.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from typing import Any, Iterable

from .patch import merge_key_for, strategic_merge_patch

Obj = dict[str, Any]
Path = tuple[str, ...]  # "f:<field>" and 'k:{"type":"Ready"}' (one item of a keyed list)
ITEM = "."

# Parts of an object no manager owns.
_UNOWNED_TOP = ("apiVersion", "kind")
_OWNED_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")


class ApplyConflict(Exception):
    def __init__(self, conflicts: list[tuple[tuple[str, str], Path]]) -> None:
        self.conflicts = conflicts
        listed = "; ".join(f'conflict with "{owner[0]}": {dotted(path)}' for owner, path in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {listed}")


def dotted(path: Path) -> str:
    return "".join("." + p[2:] if p.startswith("f:") else "[" + p[2:] + "]" for p in path)


def _item_key(field: str, items: list[Any]) -> str | None:
    key = merge_key_for(field, items)
    return key if key is not None and all(isinstance(i, dict) for i in items) else None


def field_paths(value: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every path a configuration sets, with its value: the leaves (scalars, lists without a
    key, empty objects) and each item of a keyed list (so the item itself can be owned)."""
    out: dict[Path, Any] = {}
    if not isinstance(value, dict) or not value:
        out[prefix] = value
        return out
    for name, sub in value.items():
        path = prefix + (f"f:{name}",)
        key = _item_key(name, sub) if isinstance(sub, list) and sub else None
        if key is None:
            out.update(field_paths(sub, path))
            continue
        for item in sub:
            item_path = path + ("k:" + json.dumps({key: item[key]}, separators=(",", ":")),)
            out[item_path] = ITEM
            out.update({p: v for p, v in field_paths({k: v for k, v in item.items()}, item_path).items()})
    return out


def owned_part(obj: Obj, subresource: str | None, has_status: bool) -> Obj:
    """The part of a configuration ownership is tracked for: `status` for the status
    subresource; otherwise everything but status, the type header and server-set metadata."""
    if subresource == "status":
        return {"status": obj.get("status") or {}}
    part = {k: v for k, v in obj.items() if k not in _UNOWNED_TOP and k != "metadata"
            and not (has_status and k == "status")}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in _OWNED_METADATA}
    if meta:
        part["metadata"] = meta
    return part


# --- FieldsV1 <-> paths ---------------------------------------------------------------------------

def to_fields_v1(paths: Iterable[Path]) -> Obj:
    tree: Obj = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        if path and path[-1].startswith("k:"):
            node[ITEM] = {}
    return tree


def from_fields_v1(tree: Obj, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for part, sub in tree.items():
        if part == ITEM:
            out.add(prefix)
            continue
        path = prefix + (part,)
        if sub:
            out |= from_fields_v1(sub, path)
        else:
            out.add(path)
    return out


def managers(obj: Obj) -> dict[tuple[str, str], set[Path]]:
    """(manager, subresource) -> owned paths, from metadata.managedFields."""
    out: dict[tuple[str, str], set[Path]] = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        out[(entry.get("manager", ""), entry.get("subresource", ""))] = from_fields_v1(entry.get("fieldsV1") or {})
    return out


def managed_fields(owners: dict[tuple[str, str], set[Path]], api_version: str, previous: list[Obj],
                   touched: tuple[str, str] | None) -> list[Obj]:
    times = {(e.get("manager", ""), e.get("subresource", "")): e.get("time") for e in previous}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for (manager, sub), paths in sorted(owners.items()):
        if not paths:
            continue
        entry: Obj = {"manager": manager, "operation": "Apply", "apiVersion": api_version,
                      "time": now if (manager, sub) == touched else times.get((manager, sub), now),
                      "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}
        if sub:
            entry["subresource"] = sub
        out.append(entry)
    return out


# --- reading and removing one path ----------------------------------------------------------------

def _step(node: Any, part: str) -> tuple[Any, Any]:
    """(container, index) of one path element in `node`, or (None, None) if absent."""
    if part.startswith("f:"):
        name = part[2:]
        return (node, name) if isinstance(node, dict) and name in node else (None, None)
    wanted = json.loads(part[2:])
    if isinstance(node, list):
        for i, item in enumerate(node):
            if isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items()):
                return node, i
    return None, None


def value_at(obj: Any, path: Path) -> Any:
    node = obj
    for part in path:
        container, index = _step(node, part)
        if container is None:
            return _MISSING
        node = container[index]
    return node


_MISSING = object()


def remove_path(obj: Any, path: Path) -> None:
    node = obj
    for part in path[:-1]:
        container, index = _step(node, part)
        if container is None:
            return
        node = container[index]
    container, index = _step(node, path[-1])
    if container is not None:
        del container[index]


# --- apply and update -----------------------------------------------------------------------------

def apply(existing: Obj, config: Obj, *, manager: str, subresource: str | None, has_status: bool,
          force: bool) -> tuple[Obj, dict[tuple[str, str], set[Path]]]:
    """The object after `manager` applies `config`, and the new ownership. Raises ApplyConflict."""
    me = (manager, subresource or "")
    owners = managers(existing)
    part = owned_part(config, subresource, has_status)
    wanted = field_paths(part) if part else {}
    wanted.pop((), None)
    conflicts = []
    for other, paths in owners.items():
        if other == me:
            continue
        for path in sorted(paths & wanted.keys()):
            if wanted[path] is not ITEM and value_at(existing, path) != wanted[path]:
                conflicts.append((other, path))
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    for other, path in conflicts:  # forced: the applier takes them
        owners[other].discard(path)
    merged = strategic_merge_patch(copy.deepcopy(existing), part)
    others = set().union(*(p for o, p in owners.items() if o != me)) if owners else set()
    gone = owners.get(me, set()) - wanted.keys() - others
    # A whole list item goes at once: its fields (its key among them) are not removed one by one.
    for path in sorted((p for p in gone if not any(p[:i] in gone for i in range(1, len(p)))), key=len, reverse=True):
        remove_path(merged, path)
    owners[me] = set(wanted)
    return merged, owners


def strip_changed(old: Obj, new: Obj, owners: dict[tuple[str, str], set[Path]]) -> bool:
    """After a write that is not an apply: the fields it changed leave their appliers. Returns
    whether any ownership changed."""
    if not owners:
        return False
    before, after = field_paths(old), field_paths(new)
    changed = {p for p in before.keys() | after.keys() if before.get(p, _MISSING) != after.get(p, _MISSING)}
    touched = False
    for paths in owners.values():
        gone = {p for p in paths if p in changed or any(p[:i] in changed for i in range(1, len(p)))}
        if gone:
            paths -= gone
            touched = True
    return touched
