"""Served names are one namespace for the whole router: the first LLMService to claim a name
(its served name or one of its LoRA adapters) keeps it; a later claimant is not served.

Pure: from an LLMService and the others the operator sees to the conflicts, as validation
problems (reason ServedNameConflict), so the later claimant gets Ready=False and an Event and
no Pods, and the router routes the name to the first claimant only.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..api.validation import ValidationProblem

SERVED_NAME_CONFLICT = "ServedNameConflict"


def claimed_names(llm: Mapping[str, Any]) -> set[str]:
    """The request `model` values an LLMService answers to (read leniently, like the router)."""
    meta = llm.get("metadata") or {}
    spec = llm.get("spec") or {}
    model = spec.get("model") if isinstance(spec.get("model"), Mapping) else {}
    names = {str(model.get("servedName") or meta.get("name") or "")}
    lora = spec.get("lora") if isinstance(spec.get("lora"), Mapping) else {}
    names |= {str(a["name"]) for a in lora.get("adapters") or [] if isinstance(a, Mapping) and a.get("name")}
    return names - {""}


def _adapter_names(llm: Mapping[str, Any]) -> set[str]:
    meta = llm.get("metadata") or {}
    model = (llm.get("spec") or {}).get("model") or {}
    served = str((model.get("servedName") if isinstance(model, Mapping) else None) or meta.get("name") or "")
    return claimed_names(llm) - {served}


def claim_order(llm: Mapping[str, Any]) -> tuple[str, str, str]:
    """Earlier claims first: creation time, then namespace/name (a stable tie-break)."""
    meta = llm.get("metadata") or {}
    return (str(meta.get("creationTimestamp") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def served_name_conflicts(llm: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> list[ValidationProblem]:
    """One problem per name of `llm` that an earlier LLMService (not being deleted) claims."""
    mine, me = claimed_names(llm), claim_order(llm)
    problems: list[ValidationProblem] = []
    for other in sorted(others, key=claim_order):
        meta = other.get("metadata") or {}
        if meta.get("deletionTimestamp") or claim_order(other) >= me:
            continue
        for taken in sorted(mine & claimed_names(other)):
            field = "spec.lora.adapters" if taken in _adapter_names(llm) else "spec.model.servedName"
            problems.append(ValidationProblem(
                field, f"the model name {taken!r} is already served by LLMService "
                f"{meta.get('namespace')}/{meta.get('name')}: choose another servedName or adapter name",
                SERVED_NAME_CONFLICT))
        mine -= claimed_names(other)
    return problems
