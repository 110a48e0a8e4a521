"""The pure LoRA adapter plan: URI → engine path, per-replica actions, annotation, status."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest

from tidal_operator import labels as L
from tidal_operator.api.types import LLMServiceSpec, OperatorConfig
from tidal_operator.reconcile.adapters import (
    AdapterTarget,
    ReplicaObservation,
    ReplicaResult,
    adapters_status,
    annotation_value,
    desired_adapters,
    engine_path,
    loaded_after,
    parse_annotation,
    plan_replica,
)
from tidal_operator.reconcile.manifests import engine_args
from tidal_operator.reconcile.status import compute_status
from tidal_operator.router.registry import parse_adapters_annotation

NOW = datetime(2025, 1, 1, tzinfo=timezone.utc)


def spec(model_uri: str = "pvc://models/llama", adapters: list[dict[str, str]] | None = None) -> LLMServiceSpec:
    return LLMServiceSpec.from_body({"model": {"uri": model_uri}, "lora": {"adapters": adapters or []}})


@pytest.mark.parametrize(
    "uri, path, error",
    [
        ("file:///srv/adapters/sql", "/srv/adapters/sql", None),
        ("pvc://models/adapters/sql", "/models/models/adapters/sql", None),
        ("pvc://other/sql", None, "claim 'other' is not mounted"),
        ("hf://org/sql-lora", None, "need a download"),
        ("bundled://sql", None, "no bundled adapters"),
    ],
)
def test_engine_path(uri: str, path: str | None, error: str | None) -> None:
    got_path, got_error = engine_path(uri, spec())
    assert got_path == path
    assert (got_error is None) if error is None else (error in (got_error or ""))


def test_pvc_adapter_without_a_pvc_model() -> None:
    _, error = engine_path("pvc://models/x", spec(model_uri="bundled://smollm2-135m"))
    assert error is not None and "the model is not on a PVC" in error


def test_desired_adapters_keeps_order_and_errors() -> None:
    adapters = [{"name": "a", "uri": "file:///srv/a"}, {"name": "h", "uri": "hf://o/h"},
                {"name": "x", "uri": "file:///etc/x"}]
    targets = desired_adapters(spec(adapters=adapters), OperatorConfig(allowed_file_roots=("/srv",)))
    assert [t.name for t in targets] == ["a", "h", "x"]
    assert targets[0].engine_path == "/srv/a" and targets[1].engine_path is None and targets[1].error
    assert targets[2].engine_path is None and "only allowed under /srv" in (targets[2].error or "")
    assert desired_adapters(LLMServiceSpec.from_body({"model": {"uri": "bundled://smollm2-135m"}})) == []


A = AdapterTarget("a", "file:///srv/a", "/srv/a")
B = AdapterTarget("b", "file:///srv/b", "/srv/b")
HF = AdapterTarget("h", "hf://o/h", None, "needs a download")


def test_plan_loads_missing_and_unloads_dropped() -> None:
    observed = ReplicaObservation("p0", True, frozenset({"a", "old"}), {"a": A.uri, "old": "file:///srv/old"})
    plan = plan_replica([A, B, HF], observed)
    assert plan.unload == ("old",)
    assert [t.name for t in plan.load] == ["b"]  # a is there; h can't be loaded
    after = loaded_after([A, B, HF], observed, plan, unloaded=["old"], loaded=["b"])
    assert after == {"a": A.uri, "b": B.uri}


def test_plan_reloads_when_the_uri_changed() -> None:
    observed = ReplicaObservation("p0", True, frozenset({"a"}), {"a": "file:///srv/a-v1"})
    plan = plan_replica([A], observed)
    assert plan.unload == ("a",) and [t.name for t in plan.load] == ["a"]
    assert loaded_after([A], observed, plan, ["a"], ["a"]) == {"a": A.uri}
    assert loaded_after([A], observed, plan, ["a"], []) == {}  # unloaded, reload failed: not served


def test_restarted_engine_gets_everything_again() -> None:
    # The annotation still says a and b, but the engine (restarted) lists nothing.
    observed = ReplicaObservation("p0", True, frozenset(), {"a": A.uri, "b": B.uri})
    plan = plan_replica([A, B], observed)
    assert [t.name for t in plan.load] == ["a", "b"] and plan.unload == ()


@pytest.mark.parametrize("observed", [
    ReplicaObservation("p0", False, None, {"a": A.uri}),
    ReplicaObservation("p0", True, None, {"a": A.uri}),  # Ready but unreachable
])
def test_unready_or_unreachable_replicas_get_no_actions_and_no_adapters(observed: ReplicaObservation) -> None:
    plan = plan_replica([A], observed)
    assert plan.load == () and plan.unload == ()
    assert loaded_after([A], observed, plan, [], []) == {}


def test_annotation_round_trip_and_router_compatibility() -> None:
    value = annotation_value({"b": B.uri, "a": A.uri})
    assert json.loads(value) == [{"name": "a", "uri": A.uri}, {"name": "b", "uri": B.uri}]
    assert parse_annotation(value) == {"a": A.uri, "b": B.uri}
    assert parse_adapters_annotation(value) == frozenset({"a", "b"})
    assert parse_adapters_annotation(annotation_value({})) == frozenset()  # announced: serves none
    assert parse_annotation('["x", {"name": "y"}]') == {"x": "", "y": ""}
    assert parse_annotation("x, y") == {"x": "", "y": ""}
    assert parse_annotation(None) == {}


def test_status_entries_and_condition() -> None:
    results = [
        ReplicaResult("p0", True, {"a": A.uri}, {"b": "rank 32 exceeds the maximum LoRA rank 16"}),
        ReplicaResult("p1", True, {"a": A.uri, "b": B.uri}),
        ReplicaResult("p2", False, {}),
    ]
    entries, cond = adapters_status([A, B, HF], results, None, 3, NOW)
    by_name = {e["name"]: e for e in entries}
    assert by_name["a"]["loadedReplicas"] == 2 and by_name["a"]["errors"] == []
    assert [r["state"] for r in by_name["a"]["replicas"]] == ["Loaded", "Loaded", "Pending"]
    assert by_name["b"]["loadedReplicas"] == 1
    assert by_name["b"]["replicas"][0] == {"pod": "p0", "state": "Failed",
                                           "message": "rank 32 exceeds the maximum LoRA rank 16"}
    assert by_name["b"]["errors"] == ["p0: rank 32 exceeds the maximum LoRA rank 16"]
    assert by_name["h"]["loadedReplicas"] == 0 and "needs a download" in by_name["h"]["errors"][0]
    assert cond["type"] == "AdaptersReady" and cond["status"] == "False" and cond["reason"] == "AdapterLoadFailed"
    assert "b: p0: rank 32" in cond["message"] and cond["observedGeneration"] == 3

    ok, cond = adapters_status([A], [ReplicaResult("p0", True, {"a": A.uri})], [cond], 3, NOW)
    assert cond["status"] == "True" and cond["reason"] == "AllLoaded"
    _, loading = adapters_status([A], [ReplicaResult("p0", True, {})], None, 3, NOW)
    assert loading["status"] == "False" and loading["reason"] == "Loading"
    _, none = adapters_status([], [], None, 3, NOW)
    assert none["status"] == "True" and none["reason"] == "NoAdapters"


def test_the_main_status_computation_leaves_adapters_ready_alone() -> None:
    # The reconcile applies only its own conditions (server-side apply, its own field
    # manager); AdaptersReady is the LoRA controller's and is never in what it writes.
    llm: dict[str, Any] = {
        "metadata": {"name": "m", "namespace": "default", "generation": 1},
        "spec": {"model": {"uri": "bundled://smollm2-135m"}, "lora": {}},
        "status": {"conditions": [{"type": "AdaptersReady", "status": "True", "reason": "AllLoaded"}]},
    }
    status = compute_status(llm, [], [], 1, NOW)
    assert "AdaptersReady" not in {c["type"] for c in status["conditions"]}


def test_engine_args_confine_adapter_paths() -> None:
    s = spec(adapters=[{"name": "a", "uri": "file:///srv/a"}])
    argv = engine_args(s, "m", OperatorConfig(allowed_file_roots=("/srv",)))
    roots = argv[argv.index("--allowed-lora-roots") + 1:]
    assert roots[:3] == ["/models", "/adapters", "/srv"]
    assert "--allowed-lora-roots" in engine_args(s, "m")  # without a config: the volumes only
    no_lora = LLMServiceSpec.from_body({"model": {"uri": "bundled://smollm2-135m"}})
    assert "--allowed-lora-roots" not in engine_args(no_lora, "m")
    assert L.ADAPTERS == "tidal.dev/adapters"
