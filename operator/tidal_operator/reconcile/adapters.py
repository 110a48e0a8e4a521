"""Pure: the LoRA adapter plan of one LLMService, from its spec and what each replica has loaded.

No I/O. ``adapters_sync`` observes (each engine's ``/v1/models``), calls ``plan_replica``
per replica, applies the loads and unloads through the engine API, then writes what this
module computes: the Pod annotation ``tidal.dev/adapters`` (what the router trusts) and
``status.adapters`` plus the ``AdaptersReady`` condition.

Where adapter files come from, as the engine sees them:

- ``file:///abs/path``: that path inside the container (validation confines it to the
  operator's ``allowed_file_roots``, which the engine also gets as ``--allowed-lora-roots``);
- ``pvc://claim/sub``: the model's own claim is mounted at ``/models/<claim>``, so an
  adapter on it is ``/models/<claim>/sub``. Another claim is not mounted (mounting one would
  change the Pod and restart it), so it is an error that says so;
- ``hf://``: the engine has no download path for adapters (and Pods may have no route to a
  hub), so it is a per-adapter error, never a silent skip; ``bundled://`` has no adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from .. import labels as L
from ..api.types import LLMServiceSpec, OperatorConfig
from ..api.validation import check_adapter_uri
from .manifests import MODELS_ROOT, spec_hash
from .status import _condition

CONDITION_TYPE = "AdaptersReady"

# Per-replica states in status.adapters[].replicas[].state
LOADED = "Loaded"
FAILED = "Failed"
PENDING = "Pending"  # the replica isn't Ready (starting, restarting) or couldn't be reached


@dataclass(frozen=True)
class AdapterTarget:
    """One spec.lora.adapters entry and where the engine reads it (or why it can't)."""

    name: str
    uri: str
    engine_path: str | None
    error: str | None = None


def engine_path(uri: str, spec: LLMServiceSpec) -> tuple[str | None, str | None]:
    """(path inside the engine container, None) or (None, why it can't be loaded)."""
    if uri.startswith("file://"):
        return uri[len("file://"):], None
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        model_uri = spec.model.uri
        model_claim = model_uri[len("pvc://"):].partition("/")[0] if model_uri.startswith("pvc://") else None
        if claim != model_claim:
            where = f"the model's claim {model_claim!r}" if model_claim else "no claim (the model is not on a PVC)"
            return None, (f"{uri}: claim {claim!r} is not mounted in the engine Pods (they mount {where}); "
                          "put the adapter on the model's claim, or use a file:// root")
        return f"{MODELS_ROOT}/{claim}/{sub}".rstrip("/"), None
    if uri.startswith("hf://"):
        return None, (f"{uri}: hf:// adapters need a download, and the engine has no download path for "
                      "adapters; stage the files on the model's PVC (pvc://) or under a file:// root")
    if uri.startswith("bundled://"):
        return None, f"{uri}: there are no bundled adapters"
    return None, f"{uri}: unsupported adapter URI"


def desired_adapters(spec: LLMServiceSpec, config: OperatorConfig | None = None) -> list[AdapterTarget]:
    """The adapters the spec asks for, each with its engine path or its error."""
    if spec.lora is None:
        return []
    out = []
    for i, adapter in enumerate(spec.lora.adapters):
        # Validation refuses such a spec before reconciling it; checked again here because
        # this list drives what engines read (the engine's --allowed-lora-roots is the last guard).
        problem = check_adapter_uri(adapter.uri, f"spec.lora.adapters[{i}].uri", config or OperatorConfig())
        if problem is not None:
            out.append(AdapterTarget(adapter.name, adapter.uri, None, problem.message))
            continue
        path, error = engine_path(adapter.uri, spec)
        out.append(AdapterTarget(adapter.name, adapter.uri, path, error))
    return out


# ---------------------------------------------------------------------- the Pod annotation


def parse_annotation(value: str | None) -> dict[str, str]:
    """``tidal.dev/adapters`` → {name: uri}. Accepts what the router accepts: a JSON list of
    names or ``{"name", "uri"}`` objects, or a comma-separated list (uri unknown: "")."""
    if not value:
        return {}
    try:
        items = json.loads(value)
    except ValueError:
        return {n.strip(): "" for n in value.split(",") if n.strip()}
    out: dict[str, str] = {}
    for item in items if isinstance(items, list) else []:
        if isinstance(item, str):
            out[item] = ""
        elif isinstance(item, Mapping) and isinstance(item.get("name"), str):
            out[item["name"]] = str(item.get("uri") or "")
    return out


def annotation_value(loaded: Mapping[str, str]) -> str:
    """{name: uri} → the annotation: a JSON list of {"name", "uri"}, sorted (stable diffs)."""
    return json.dumps([{"name": n, "uri": loaded[n]} for n in sorted(loaded)], separators=(",", ":"))


# ---------------------------------------------------------------------- one replica


@dataclass(frozen=True)
class ReplicaObservation:
    """One engine Pod as the sync saw it."""

    pod: str
    ready: bool
    # What the engine lists in /v1/models (adapter names); None: not asked or unreachable.
    engine_adapters: frozenset[str] | None
    # The Pod's current annotation, {name: uri}: which URI each loaded name came from.
    annotated: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaPlan:
    pod: str
    unload: tuple[str, ...] = ()
    load: tuple[AdapterTarget, ...] = ()


def plan_replica(targets: Sequence[AdapterTarget], observed: ReplicaObservation) -> ReplicaPlan:
    """Unload what the spec dropped (or whose URI changed), load what is missing.

    A replica that isn't Ready, or whose engine couldn't be asked, gets no actions (and,
    from ``loaded_after``, an empty annotation: the router must not send adapter requests to
    an engine that may have restarted without them). Failed loads are retried every sync.
    """
    if not observed.ready or observed.engine_adapters is None:
        return ReplicaPlan(observed.pod)
    wanted = {t.name: t for t in targets if t.engine_path is not None}
    loaded = observed.engine_adapters
    unload = []
    for name in sorted(loaded):
        target = wanted.get(name)
        # The annotation records the URI a name was loaded from: a changed URI is a reload.
        previous_uri = observed.annotated.get(name, "")
        if target is None or (previous_uri and previous_uri != target.uri):
            unload.append(name)
    load = [t for name, t in sorted(wanted.items()) if name not in loaded or name in unload]
    return ReplicaPlan(observed.pod, tuple(unload), tuple(load))


def loaded_after(
    targets: Sequence[AdapterTarget],
    observed: ReplicaObservation,
    plan: ReplicaPlan,
    unloaded: Iterable[str],
    loaded: Iterable[str],
) -> dict[str, str]:
    """{name: uri} the replica serves once the plan ran (``unloaded``/``loaded``: the actions
    that succeeded). Empty for a replica that isn't Ready or couldn't be asked."""
    if not observed.ready or observed.engine_adapters is None:
        return {}
    uris = {t.name: t.uri for t in targets}
    out = {n: observed.annotated.get(n) or uris.get(n, "") for n in observed.engine_adapters}
    for name in unloaded:
        out.pop(name, None)
    succeeded = set(loaded)
    out.update({t.name: t.uri for t in plan.load if t.name in succeeded})
    return out


# ---------------------------------------------------------------------- status


@dataclass(frozen=True)
class ReplicaResult:
    """After the sync acted on one replica: what is loaded, and the per-adapter load errors."""

    pod: str
    ready: bool
    loaded: Mapping[str, str]  # name → uri, what the annotation now says
    errors: Mapping[str, str] = field(default_factory=dict)  # adapter name → engine's message


def adapters_status(
    targets: Sequence[AdapterTarget],
    results: Iterable[ReplicaResult],
    previous_conditions: Sequence[Mapping[str, Any]] | None,
    generation: int | None,
    now: datetime,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``status.adapters`` (one entry per spec adapter: its loaded replica count, each
    replica's state, errors) and the ``AdaptersReady`` condition."""
    results = list(results)
    ready = [r for r in results if r.ready]
    entries: list[dict[str, Any]] = []
    problems: list[str] = []
    for target in targets:
        replicas = []
        errors: list[str] = []
        if target.error:
            errors.append(target.error)
        for r in results:
            if target.name in r.loaded:
                state, message = LOADED, None
            elif target.name in r.errors:
                state, message = FAILED, r.errors[target.name]
                errors.append(f"{r.pod}: {message}")
            elif target.error:
                state, message = FAILED, target.error
            else:
                state, message = PENDING, None if r.ready else "replica not ready"
            replicas.append({"pod": r.pod, "state": state, **({"message": message} if message else {})})
        loaded = sum(1 for r in ready if target.name in r.loaded)
        entry: dict[str, Any] = {"name": target.name, "uri": target.uri, "loadedReplicas": loaded,
                                 "replicas": replicas, "errors": errors}
        entries.append(entry)
        if errors:
            problems.append(f"{target.name}: {errors[0]}")
        elif loaded < len(ready):
            problems.append(f"{target.name}: loaded in {loaded}/{len(ready)} ready replicas")
    previous = {c.get("type"): c for c in previous_conditions or []}
    failed = [e for e in entries if e["errors"]]
    if not targets:
        cond = _condition(previous, CONDITION_TYPE, True, "NoAdapters", "spec.lora.adapters is empty", generation, now)
    elif failed:
        cond = _condition(previous, CONDITION_TYPE, False, "AdapterLoadFailed", "; ".join(problems), generation, now)
    elif problems:
        cond = _condition(previous, CONDITION_TYPE, False, "Loading", "; ".join(problems), generation, now)
    else:
        cond = _condition(previous, CONDITION_TYPE, True, "AllLoaded",
                          f"{len(targets)} adapter(s) loaded in {len(ready)} ready replica(s)", generation, now)
    return entries, cond


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_annotation(pod: Mapping[str, Any]) -> dict[str, str]:
    return parse_annotation(((pod.get("metadata") or {}).get("annotations") or {}).get(L.ADAPTERS))


def predates_lora(pod: Mapping[str, Any], spec: LLMServiceSpec, config: OperatorConfig | None = None) -> bool:
    """A Pod of an older spec whose engine was started without --enable-lora: the roll replaces
    it, and asking it to load adapters could only fail (and warn about it)."""
    previous = ((pod.get("metadata") or {}).get("annotations") or {}).get(L.SPEC_HASH)
    if not previous or previous == spec_hash(spec, config):
        return False
    argv = [a for c in (pod.get("spec") or {}).get("containers") or [] for a in [*(c.get("command") or []),
                                                                               *(c.get("args") or [])]]
    return "--enable-lora" not in argv
