"""Golden files of what `mode: hpa` and `mode: keda` hand to an external autoscaler: the HPA,
the KEDA ScaledObject and the PodMonitor, rendered by scaling/controller.py and committed
as YAML under tests/operator/golden/.

Each case renders one LLMService and compares the object with its golden file (a diff in
the failure message). A deliberate change of a renderer: regenerate with

    TIDAL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_scaling_golden.py

and review the diff of the YAML files. Besides the comparison:
- every HPA passes kubernetes-validate against Kubernetes 1.33, strict (unknown fields refused);
- every ScaledObject has KEDA's basic shape (the documented spec and prometheus-trigger
  fields, nothing else) and a threshold and target that make sense;
- the three agree with the rest of Tidal: the scale target is the CRD's scale subresource,
  the PodMonitor selects the Pods the operator makes on a port they have, and the KEDA
  query filters on the label the PodMonitor writes.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import yaml

from tidal_operator import labels as L
from tidal_operator.api.types import LLMServiceSpec, OperatorConfig
from tidal_operator.reconcile.manifests import pod_manifest
from tidal_operator.scaling.controller import hpa_manifest, keda_scaled_object, pod_monitor

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
CRD = ROOT / "crds" / "tidal.dev_llmservices.yaml"
K8S_VERSION = "1.33"
UPDATE = os.environ.get("TIDAL_UPDATE_GOLDEN") == "1"

Obj = dict[str, Any]


def llmservice(name: str, namespace: str, *, uid: str | None, auth: bool, **autoscaling: Any) -> Obj:
    spec: Obj = {"model": {"uri": "bundled://smollm2-135m"},
                 "autoscaling": {"maxReplicas": 5, "target": 4, **autoscaling}}
    if auth:
        spec["auth"] = {"apiKeySecretRef": {"name": f"{name}-engine-key"}}
    meta: Obj = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": meta, "spec": spec}


# name -> (renderer, LLMService). Every metric, fractional and whole targets, with and
# without an owner uid and an engine API key.
CHAT_WAITING = llmservice("chat", "ml", uid="0b8e8c52-6f1e-4c1a-9d55-3f2a1c9e7d10", auth=True, minReplicas=0,
                          metric="requestsWaiting", scaleUpStabilizationSeconds=15, scaleDownDelaySeconds=300,
                          mode="hpa")
CODER_KV = llmservice("coder", "team-a", uid="5d1f0a3e-2b7c-4e8f-a6d9-1c3b5e7f9a20", auth=False, minReplicas=2,
                      maxReplicas=8, metric="kvCacheUsage", target=0.75, scaleDownDelaySeconds=120, mode="hpa")
CHAT_KEDA = llmservice("chat", "ml", uid="0b8e8c52-6f1e-4c1a-9d55-3f2a1c9e7d10", auth=True, minReplicas=0,
                       metric="requestsWaiting", scaleUpStabilizationSeconds=15, scaleDownDelaySeconds=300,
                       mode="keda")
BATCH_KEDA = llmservice("batch", "default", uid=None, auth=False, minReplicas=1, maxReplicas=3,
                        metric="requestsInFlight", target=2.5, scaleDownDelaySeconds=0, mode="keda")

CASES: dict[str, tuple[Callable[[Obj, LLMServiceSpec], Obj], Obj]] = {
    "hpa-chat-requests-waiting": (hpa_manifest, CHAT_WAITING),
    "hpa-coder-kv-cache-usage": (hpa_manifest, CODER_KV),
    "keda-chat-requests-waiting": (keda_scaled_object, CHAT_KEDA),
    "keda-batch-requests-in-flight": (keda_scaled_object, BATCH_KEDA),
    "podmonitor-chat-with-api-key": (pod_monitor, CHAT_KEDA),
    "podmonitor-batch-no-api-key": (pod_monitor, BATCH_KEDA),
}


def render(case: str) -> Obj:
    renderer, llm = CASES[case]
    return renderer(llm, LLMServiceSpec.from_body(llm["spec"]))


def dump(obj: Obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)


def golden(case: str) -> Obj:
    path = GOLDEN / f"{case}.yaml"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"# Rendered by tests/operator/test_scaling_golden.py ({case}); "
                        "regenerate with TIDAL_UPDATE_GOLDEN=1.\n" + dump(render(case)))
    assert path.exists(), f"{path} is missing: run with TIDAL_UPDATE_GOLDEN=1 and review it"
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_object_matches_its_golden_file(case: str) -> None:
    want, got = golden(case), render(case)
    if got != want:
        diff = "\n".join(difflib.unified_diff(dump(want).splitlines(), dump(got).splitlines(),
                                              f"golden/{case}.yaml", "rendered", lineterm=""))
        pytest.fail(f"{case} differs from its golden file (TIDAL_UPDATE_GOLDEN=1 regenerates it):\n{diff}")


def test_every_golden_file_has_a_case() -> None:
    """A renamed or removed case must not leave a stale golden file behind."""
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(CASES)


# --- the HPA: Kubernetes' own schema, and the scale subresource it relies on ----------------

HPA_CASES = sorted(c for c in CASES if c.startswith("hpa-"))


@pytest.mark.parametrize("case", HPA_CASES)
def test_hpa_golden_passes_kubernetes_validate_strict(case: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(golden(case), K8S_VERSION, strict=True)


def test_kubernetes_validate_strict_refuses_an_unknown_field() -> None:
    """The check above has teeth: a misspelt field in an HPA fails it."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = golden(HPA_CASES[0])
    bad["spec"]["behaviour"] = bad["spec"].pop("behavior")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _crd_version(version: str) -> Obj:
    crd = yaml.safe_load(CRD.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)


@pytest.mark.parametrize("case", HPA_CASES + sorted(c for c in CASES if c.startswith("keda-")))
def test_scale_target_is_the_llmservice_scale_subresource(case: str) -> None:
    obj, llm = golden(case), CASES[case][1]
    ref = obj["spec"]["scaleTargetRef"]
    assert ref == {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": llm["metadata"]["name"]}
    assert obj["metadata"]["namespace"] == llm["metadata"]["namespace"]
    version = _crd_version(L.API_VERSION.split("/")[1])
    assert version["served"] is True
    scale = version["subresources"]["scale"]
    # What the HPA / KEDA write and read: spec.replicas, status.replicas, the Pod selector.
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}


@pytest.mark.parametrize("case", HPA_CASES)
def test_hpa_limits_and_windows_follow_the_spec(case: str) -> None:
    obj, llm = golden(case), CASES[case][1]
    a = llm["spec"]["autoscaling"]
    spec = obj["spec"]
    # No scale to zero without the HPAScaleToZero feature gate: minReplicas >= 1.
    assert spec["minReplicas"] == max(1, a["minReplicas"]) and spec["maxReplicas"] == a["maxReplicas"]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == a.get("scaleDownDelaySeconds", 300)
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == a.get("scaleUpStabilizationSeconds", 0)
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"


# --- KEDA: the ScaledObject's documented shape --------------------------------------------

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_WINDOW = {"type": "object", "properties": {"stabilizationWindowSeconds": {"type": "integer", "minimum": 0}}}
# From KEDA's ScaledObject reference (keda.sh/v1alpha1): the spec fields and the prometheus
# scaler's trigger metadata. Unknown fields are refused, so a typo can't pass.
SCALED_OBJECT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "namespace": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS,
            "ownerReferences": {"type": "array", "items": {
                "type": "object", "required": ["apiVersion", "kind", "name", "uid"]}}}},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"]},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "name": {"type": "string"},
                            "behavior": {"type": "object", "additionalProperties": False,
                                         "properties": {"scaleUp": _WINDOW, "scaleDown": _WINDOW}}}},
                    "scalingModifiers": {"type": "object"}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"const": "prometheus"},
                        "name": {"type": "string"},
                        "useCachedMetrics": {"type": "boolean"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "authenticationRef": {"type": "object", "required": ["name"]},
                        # Trigger metadata values are strings in KEDA, numbers included.
                        "metadata": {**_STRINGS, "required": ["serverAddress", "query", "threshold"],
                                     "propertyNames": {"enum": [
                                         "serverAddress", "query", "threshold", "activationThreshold",
                                         "namespace", "customHeaders", "ignoreNullValues",
                                         "queryParameters", "unsafeSsl", "timeout"]}}}}},
            }},
    }}

KEDA_CASES = sorted(c for c in CASES if c.startswith("keda-"))


@pytest.mark.parametrize("case", KEDA_CASES)
def test_keda_golden_has_the_scaled_object_shape(case: str) -> None:
    obj, llm = golden(case), CASES[case][1]
    jsonschema.validate(obj, SCALED_OBJECT)
    spec, a = obj["spec"], llm["spec"]["autoscaling"]
    assert spec["minReplicaCount"] == a["minReplicas"] <= spec["maxReplicaCount"] == a["maxReplicas"]
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    assert float(meta["threshold"]) == a["target"] > 0
    assert meta["serverAddress"].startswith(("http://", "https://"))
    # The query sums over this LLMService's engines only, by the label the PodMonitor writes.
    label = L.LLMSERVICE.replace(".", "_").replace("/", "_")
    assert f'{label}="{llm["metadata"]["name"]}"' in meta["query"]
    assert f'namespace="{llm["metadata"]["namespace"]}"' in meta["query"]


def test_the_keda_shape_check_has_teeth() -> None:
    obj = golden(KEDA_CASES[0])
    obj["spec"]["triggers"][0]["metadata"].pop("threshold")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, SCALED_OBJECT)
    obj = golden(KEDA_CASES[0])
    obj["spec"]["minReplicas"] = 0  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, SCALED_OBJECT)


# --- the PodMonitor agrees with the Pods and the KEDA query ---------------------------------

@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("podmonitor-")))
def test_pod_monitor_selects_the_engine_pods_on_their_port(case: str) -> None:
    obj, llm = golden(case), CASES[case][1]
    # The Pod the operator would make (it needs an owner uid; the monitor doesn't).
    pod = pod_manifest({**llm, "metadata": {"uid": "u", **llm["metadata"]}}, 0, OperatorConfig())
    pod_labels = pod["metadata"]["labels"]
    selector = obj["spec"]["selector"]["matchLabels"]
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items())
    (endpoint,) = obj["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports") or []}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    # The label the KEDA query filters on comes from the Pod label, which the Pods carry.
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == L.LLMSERVICE.replace(".", "_").replace("/", "_")
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_" + relabel["targetLabel"]]
    # With an engine API key, Prometheus sends it from the same Secret the engines read.
    auth = llm["spec"].get("auth")
    if auth:
        ref = auth["apiKeySecretRef"]
        assert endpoint["authorization"] == {"type": "Bearer",
                                             "credentials": {"name": ref["name"], "key": "api-key"}}
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert any((e.get("valueFrom") or {}).get("secretKeyRef") == {"name": ref["name"], "key": "api-key"}
                   for e in env.values())
    else:
        assert "authorization" not in endpoint
