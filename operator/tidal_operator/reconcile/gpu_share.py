"""Members of one GPU-share group must be placeable on one device: the same node selector and
the same kind of device. The earliest member (creation time, then namespace/name) sets the
group's placement; a later member that disagrees is refused (reason GPUShareConflict: a
Validated=False condition and a Warning Event), so it never starts somewhere else.

Pure: from an LLMService and the others the operator sees to problems.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..api.validation import ValidationProblem
from .served_names import claim_order

GPU_SHARE_CONFLICT = "GPUShareConflict"


def _group(llm: Mapping[str, Any]) -> tuple[str, str] | None:
    spec = llm.get("spec") or {}
    share = spec.get("gpuShare")
    if not isinstance(share, Mapping) or not share.get("group"):
        return None
    return (str((llm.get("metadata") or {}).get("namespace") or ""), str(share["group"]))


def placement(llm: Mapping[str, Any]) -> dict[str, Any]:
    """What must be equal across a group (read leniently, as the router reads specs)."""
    spec = llm.get("spec") or {}
    engine = spec.get("engine") if isinstance(spec.get("engine"), Mapping) else {}
    resources = engine.get("resources") if isinstance(engine.get("resources"), Mapping) else {}
    template = spec.get("podTemplate") if isinstance(spec.get("podTemplate"), Mapping) else {}
    return {"nodeSelector": dict(template.get("nodeSelector") or {}),
            "gpu": int(resources.get("gpu") or 0),
            "gpuResourceName": resources.get("gpuResourceName") or "nvidia.com/gpu"}


def gpu_share_conflicts(llm: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> list[ValidationProblem]:
    group = _group(llm)
    if group is None:
        return []
    earlier = [o for o in others if _group(o) == group and not (o.get("metadata") or {}).get("deletionTimestamp")
               and claim_order(o) < claim_order(llm)]
    if not earlier:
        return []
    first = min(earlier, key=claim_order)
    want, mine = placement(first), placement(llm)
    differ = sorted(k for k in want if want[k] != mine[k])
    if not differ:
        return []
    name = (first.get("metadata") or {}).get("name")
    return [ValidationProblem(
        "spec.gpuShare.group",
        f"group {group[1]!r} runs on one device as its first member {group[0]}/{name} places it; this member "
        f"differs in {', '.join(differ)} (theirs: {', '.join(f'{k}={want[k]!r}' for k in differ)})",
        GPU_SHARE_CONFLICT)]
