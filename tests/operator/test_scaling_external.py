"""mode hpa | keda: the generated HPA, KEDA ScaledObject and PodMonitor.

The HPA is validated against Kubernetes' own schema (kubernetes-validate, strict). KEDA and
the Prometheus operator publish no schema we can load offline, so their shapes are checked
against JSON schemas written here from the documented fields (KEDA's ScaledObject spec and
prometheus trigger, the PodMonitor CRD), with unknown fields refused.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from tidal_operator import labels as L
from tidal_operator.api.types import LLMServiceSpec
from tidal_operator.scaling.controller import hpa_manifest, keda_scaled_object, pod_monitor

LLM = {"apiVersion": L.API_VERSION, "kind": L.KIND,
       "metadata": {"name": "chat", "namespace": "ml", "uid": "1234-abcd"}}


def spec(engine_args: list[str] | None = None, **autoscaling: Any) -> LLMServiceSpec:
    a = {"minReplicas": 0, "maxReplicas": 5, "metric": "requestsWaiting", "target": 4,
         "scaleUpStabilizationSeconds": 15, "scaleDownDelaySeconds": 300, "mode": "hpa", **autoscaling}
    body: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m"}, "autoscaling": a,
                            "auth": {"apiKeySecretRef": {"name": "engine-key"}}}
    if engine_args is not None:
        body["engine"] = {"args": engine_args}
    return LLMServiceSpec.from_body(body)


OWNER = [{"apiVersion": L.API_VERSION, "kind": L.KIND, "name": "chat", "uid": "1234-abcd", "controller": True,
          "blockOwnerDeletion": True}]
META = {"name": "chat", "namespace": "ml", "labels": {L.LLMSERVICE: "chat", L.MANAGED_BY: L.MANAGED_BY_VALUE},
        "ownerReferences": OWNER}

GOLDEN_HPA = {
    "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": META,
    "spec": {
        "scaleTargetRef": {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "name": "chat"},
        "minReplicas": 1, "maxReplicas": 5,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": "tidal_num_requests_waiting"},
                                              "target": {"type": "AverageValue", "averageValue": "4"}}}],
        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 15},
                     "scaleDown": {"stabilizationWindowSeconds": 300}},
    },
}

GOLDEN_KEDA = {
    "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": META,
    "spec": {
        "scaleTargetRef": {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "name": "chat"},
        "minReplicaCount": 0, "maxReplicaCount": 5, "pollingInterval": 15, "cooldownPeriod": 300,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleUp": {"stabilizationWindowSeconds": 15}, "scaleDown": {"stabilizationWindowSeconds": 300}}}},
        "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
            "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
            "query": 'sum(tidal:num_requests_waiting{namespace="ml",tidal_dev_llmservice="chat"})',
            "threshold": "4"}}],
    },
}

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_BEHAVIOR = {"type": "object", "additionalProperties": False, "properties": {
    "scaleUp": {"type": "object"}, "scaleDown": {"type": "object"}}}
_META = {"type": "object", "required": ["name", "namespace"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STR_MAP,
    "ownerReferences": {"type": "array"}}}
_TARGET_REF = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
    "envSourceContainerName": {"type": "string"}}}

# From KEDA's ScaledObject spec (keda.sh/v1alpha1) and its prometheus scaler's metadata.
SCALED_OBJECT_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _META,
        "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                 "properties": {
                     "scaleTargetRef": _TARGET_REF,
                     "pollingInterval": {"type": "integer", "minimum": 1},
                     "cooldownPeriod": {"type": "integer", "minimum": 0},
                     "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                     "idleReplicaCount": {"type": "integer", "minimum": 0},
                     "minReplicaCount": {"type": "integer", "minimum": 0},
                     "maxReplicaCount": {"type": "integer", "minimum": 1},
                     "fallback": {"type": "object"},
                     "advanced": {"type": "object", "additionalProperties": False, "properties": {
                         "restoreToOriginalReplicaCount": {"type": "boolean"},
                         "horizontalPodAutoscalerConfig": {
                             "type": "object", "additionalProperties": False,
                             "properties": {"name": {"type": "string"}, "behavior": _BEHAVIOR}},
                         "scalingModifiers": {"type": "object"}}},
                     "triggers": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                         "properties": {
                             "type": {"type": "string"}, "name": {"type": "string"},
                             "useCachedMetrics": {"type": "boolean"},
                             "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                             "authenticationRef": {"type": "object"},
                             "metadata": {**_STR_MAP, "required": ["serverAddress", "query", "threshold"]}}}},
                 }},
    }}

# From the Prometheus operator's PodMonitor CRD (monitoring.coreos.com/v1), the fields used.
POD_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "properties": {
            "selector": {"type": "object", "properties": {"matchLabels": _STR_MAP}},
            "podMetricsEndpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"},
                    "relabelings": {"type": "array", "items": {"type": "object", "properties": {
                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                        "targetLabel": {"type": "string"}}}},
                    "authorization": {"type": "object", "required": ["credentials"], "properties": {
                        "type": {"type": "string"},
                        "credentials": {"type": "object", "required": ["name", "key"]}}}}}}}}}}


def test_hpa_matches_the_golden_and_validates_against_kubernetes() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    hpa = hpa_manifest(LLM, spec())
    assert hpa == GOLDEN_HPA
    kubernetes_validate.validate(hpa, "1.32.0", strict=True)


@pytest.mark.parametrize("metric,target,name,value", [
    ("requestsInFlight", 8, "tidal_num_requests_in_flight", "8"),
    ("kvCacheUsage", 0.75, "tidal_kv_cache_usage_perc", "750m"),
])
def test_hpa_metrics_and_quantities(metric: str, target: float, name: str, value: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    hpa = hpa_manifest(LLM, spec(metric=metric, target=target, minReplicas=2))
    assert hpa["spec"]["minReplicas"] == 2
    assert hpa["spec"]["metrics"][0]["pods"] == {"metric": {"name": name},
                                                 "target": {"type": "AverageValue", "averageValue": value}}
    kubernetes_validate.validate(hpa, "1.32.0", strict=True)


def test_keda_scaled_object_matches_the_golden_and_the_schema() -> None:
    obj = keda_scaled_object(LLM, spec(mode="keda"))
    assert obj == GOLDEN_KEDA
    jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)


def test_keda_in_flight_sums_running_and_waiting() -> None:
    obj = keda_scaled_object(LLM, spec(mode="keda", metric="requestsInFlight"))
    query = obj["spec"]["triggers"][0]["metadata"]["query"]
    assert "tidal:num_requests_running" in query and "tidal:num_requests_waiting" in query
    jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)


@pytest.mark.parametrize("args", [["--metrics-prefix", "vllm"], ["--metrics-prefix=vllm"]])
@pytest.mark.parametrize("metric", ["requestsWaiting", "requestsInFlight", "kvCacheUsage"])
def test_keda_queries_follow_the_engines_metrics_prefix(args: list[str], metric: str) -> None:
    query = keda_scaled_object(LLM, spec(args, mode="keda", metric=metric))["spec"]["triggers"][0]["metadata"]["query"]
    assert "vllm:" in query and "tidal:" not in query
    default = keda_scaled_object(LLM, spec(mode="keda", metric=metric))["spec"]["triggers"][0]["metadata"]["query"]
    assert default == query.replace("vllm:", "tidal:")


def test_pod_monitor_selects_the_engines_and_uses_the_api_key() -> None:
    monitor = pod_monitor(LLM, spec())
    jsonschema.validate(monitor, POD_MONITOR_SCHEMA)
    assert monitor["metadata"]["name"] == "chat-engines"
    assert monitor["spec"]["selector"]["matchLabels"] == L.selector_labels("chat")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "engine-key", "key": "api-key"}


def test_the_schemas_refuse_wrong_shapes() -> None:
    bad = keda_scaled_object(LLM, spec(mode="keda"))
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCALED_OBJECT_SCHEMA)
    with pytest.raises(ValueError):
        hpa_manifest(LLM, LLMServiceSpec.from_body({"model": {"uri": "bundled://smollm2-135m"}}))
