"""reconcile/manifests.py: every generated object passes kubernetes-validate (strict), the
engine flags follow the spec, secrets only appear as references, and the spec hash moves
only with what shapes a Pod."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import kubernetes_validate
import pytest

from tidal_operator import labels as L
from tidal_operator.api import OperatorConfig
from tidal_operator.reconcile.manifests import (
    disruption_budget_manifest, engine_args, metadata_drift, pod_manifest, pod_name, service_manifest, spec_hash,
)

K8S_VERSIONS = ("1.33", "1.37")
CONFIG = OperatorConfig(default_engine_image="registry.local/tidal-engine:test")
SECRET_VALUE = "sk-this-must-never-appear"


def llm(spec: dict[str, Any], name: str = "qwen") -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": name, "namespace": "team-a", "uid": "0b1e5c2e-0000-4000-8000-000000000001",
                         "generation": 1},
            "spec": spec}


SPECS: dict[str, dict[str, Any]] = {
    "bundled-cpu": {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 2048},
                    "engine": {"resources": {"cpu": "2", "memory": "2Gi"}, "kvCacheMemory": "256Mi"}},
    "file": {"model": {"uri": "file:///opt/models/llama"}, "engine": {"resources": {"cpu": 4, "memory": "8Gi"}}},
    "pvc-gpu": {"model": {"uri": "pvc://models/qwen3/8b", "servedName": "Qwen/Qwen3-8B"},
                "engine": {"resources": {"gpu": 2}, "gpuMemoryUtilization": 0.85},
                "parallelism": {"tensor": 2}, "quantization": {"weights": "fp8", "kvCache": "fp8"}},
    "hf-auth-lora-sleep": {
        "model": {"uri": "hf://Qwen/Qwen3-8B@abc123", "hfTokenSecretRef": {"name": "hf", "key": "token"}},
        "engine": {"image": "my/engine:1", "resources": {"gpu": 1}, "maxNumSeqs": 64, "maxNumBatchedTokens": 8192,
                   "args": ["--seed", "7"], "env": [{"name": "LOG_LEVEL", "value": "debug"},
                                                     {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
        "lora": {"maxAdapters": 8, "maxRank": 64, "adapters": [{"name": "sql", "uri": "hf://org/sql"}]},
        "features": {"prefixCaching": False, "chunkedPrefill": False},
        "sleep": {"afterIdleSeconds": 60},
        "auth": {"apiKeySecretRef": {"name": "api", "key": "key"}},
        "podTemplate": {"labels": {"team": "a"}, "annotations": {"owner": "ml"}, "nodeSelector": {"gpu": "h100"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [
                                {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                        "priorityClassName": "high", "serviceAccountName": "engine"}},
    "kv-offload": {"model": {"uri": "pvc://models/qwen3/8b"},
                   "engine": {"resources": {"gpu": 1, "memory": "24Gi"}, "kvOffload": {"size": "16Gi"}}},
    "pipeline": {"model": {"uri": "hf://meta-llama/Llama-3.1-70B"}, "engine": {"resources": {"gpu": 8}},
                 "parallelism": {"tensor": 4, "pipeline": 2}, "quantization": {"weights": "awq"}},
    "platform": {"model": {"uri": "pvc://models/qwen3"},
                 "engine": {"resources": {"gpu": 1, "gpuResourceName": "amd.com/gpu"}},
                 "disruption": {"maxUnavailable": 0},
                 "podTemplate": {"imagePullSecrets": [{"name": "registry"}],
                                 "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
                                 "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}],
                                 "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                                "whenUnsatisfiable": "ScheduleAnyway",
                                                                "labelSelector": {"matchLabels": {"tidal.dev/llmservice": "qwen"}}}],
                                 "runtimeClassName": "nvidia", "schedulerName": "volcano"}},
}


def container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_generated_object_validates(case: str, version: str) -> None:
    body = llm(SPECS[case])
    for index in (0, 3):
        kubernetes_validate.validate(pod_manifest(body, index, CONFIG), version, strict=True)
    kubernetes_validate.validate(service_manifest(body, CONFIG), version, strict=True)
    kubernetes_validate.validate(disruption_budget_manifest(body, CONFIG), version, strict=True)


def test_strict_validation_really_is_strict() -> None:
    pod = pod_manifest(llm(SPECS["bundled-cpu"]), 0, CONFIG)
    container(pod)["bogus"] = 1
    with pytest.raises(Exception):
        kubernetes_validate.validate(pod, "1.33", strict=True)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_args_bundled_cpu() -> None:
    argv = engine_args(SPECS["bundled-cpu"], "smollm2")
    assert argv[:3] == ["tidal-engine", "serve", "smollm2-135m"]
    # Every address in the Pod (port-forward, meshes); the Pod IP is still what is advertised.
    assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "8000"
    assert flag(argv, "--served-model-name") == "smollm2" and flag(argv, "--max-model-len") == "2048"
    assert flag(argv, "--tensor-parallel-size") == "1" and flag(argv, "--pipeline-parallel-size") == "1"
    assert flag(argv, "--dtype") == "auto" and flag(argv, "--kv-cache-memory-bytes") == str(256 * 2**20)
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    for absent in ("--quantization", "--kv-cache-dtype", "--enable-lora", "--enable-sleep-mode", "--max-num-seqs"):
        assert absent not in argv


def test_args_full() -> None:
    argv = engine_args(SPECS["hf-auth-lora-sleep"], "qwen")
    assert argv[2] == "Qwen/Qwen3-8B" and flag(argv, "--revision") == "abc123"
    assert flag(argv, "--served-model-name") == "qwen"
    assert flag(argv, "--max-num-seqs") == "64" and flag(argv, "--max-num-batched-tokens") == "8192"
    assert "--no-enable-prefix-caching" in argv and "--no-enable-chunked-prefill" in argv
    assert "--enable-lora" in argv and flag(argv, "--max-loras") == "8" and flag(argv, "--max-lora-rank") == "64"
    assert "--enable-sleep-mode" in argv
    assert argv[-2:] == ["--seed", "7"], "engine.args come last"


def test_args_quantization_and_parallelism() -> None:
    argv = engine_args(SPECS["pvc-gpu"], "qwen")
    assert argv[2] == "/models/models/qwen3/8b"
    assert flag(argv, "--served-model-name") == "Qwen/Qwen3-8B"
    assert flag(argv, "--quantization") == "fp8" and flag(argv, "--kv-cache-dtype") == "fp8"
    assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(engine_args(SPECS["file"], "x"), "serve") == "/opt/models/llama"


def test_kv_offload_sets_the_flags_and_grows_the_pod_memory() -> None:
    argv = engine_args(SPECS["kv-offload"], "qwen")
    assert flag(argv, "--kv-offloading-size") == "16" and flag(argv, "--kv-offloading-backend") == "native"
    resources = container(pod_manifest(llm(SPECS["kv-offload"]), 0, CONFIG))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == str(40 * 2**30)  # 24Gi + 16Gi
    half = {**SPECS["kv-offload"], "engine": {"resources": {"gpu": 1}, "kvOffload": {"size": "512Mi"}}}
    assert flag(engine_args(half, "qwen"), "--kv-offloading-size") == "0.5"
    assert "--kv-offloading-size" not in engine_args(SPECS["file"], "qwen")
    assert container(pod_manifest(llm(SPECS["file"]), 0, CONFIG))["resources"]["limits"]["memory"] == "8Gi"


def test_pod_basics() -> None:
    body = llm(SPECS["bundled-cpu"], name="smollm2")
    pod = pod_manifest(body, 0, CONFIG)
    meta, spec, c = pod["metadata"], pod["spec"], container(pod)
    h = spec_hash(body["spec"], CONFIG)
    assert meta["name"] == f"smollm2-{h}-0" == pod_name("smollm2", h, 0)
    assert meta["annotations"][L.SPEC_HASH] == h
    assert meta["labels"][L.LLMSERVICE] == "smollm2" and meta["labels"][L.APP_NAME] == "tidal-engine"
    assert meta["labels"][L.MANAGED_BY] == "tidal-operator" and meta["labels"][L.SLEEP_STATE] == "awake"
    assert meta["ownerReferences"] == [{"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "name": "smollm2",
                                        "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    assert c["name"] == "engine" and c["image"] == CONFIG.default_engine_image
    assert c["command"] + c["args"] == engine_args(body["spec"], "smollm2")
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    assert spec["restartPolicy"] == "Always" and spec["terminationGracePeriodSeconds"] == 60
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and "livenessProbe" in c
    sp = c["startupProbe"]
    assert sp["httpGet"]["path"] == "/health"
    assert sp["failureThreshold"] * sp["periodSeconds"] >= 600
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["hostname"] == meta["name"] and spec["subdomain"] == "smollm2"
    # Only the start-up cache, per Pod by default; the engine finds it through TIDAL_CACHE_DIR.
    assert spec["volumes"] == [{"name": "tidal-cache", "emptyDir": {}}] and "nvidia.com/gpu" not in json.dumps(pod)
    assert {"name": "tidal-cache", "mountPath": "/var/cache/tidal"} in c["volumeMounts"]
    assert {"name": "TIDAL_CACHE_DIR", "value": "/var/cache/tidal"} in c["env"]


@pytest.mark.parametrize("timeout", [10, 95, 600, 3601])
def test_startup_probe_covers_the_timeout(timeout: int) -> None:
    spec = copy.deepcopy(SPECS["bundled-cpu"])
    spec["engine"]["startupTimeoutSeconds"] = timeout
    sp = container(pod_manifest(llm(spec), 0, CONFIG))["startupProbe"]
    assert sp["failureThreshold"] * sp["periodSeconds"] >= timeout
    assert sp["failureThreshold"] == math.ceil(timeout / sp["periodSeconds"])


def test_gpu_pod() -> None:
    pod = pod_manifest(llm(SPECS["pvc-gpu"]), 1, CONFIG)
    c = container(pod)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}  # 1Gi per rank
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models/models", "readOnly": True}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert pod["metadata"]["labels"][L.REPLICA_INDEX] == "1"
    pipeline = container(pod_manifest(llm(SPECS["pipeline"]), 0, CONFIG))
    assert pipeline["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_hf_auth_lora_pod_uses_secret_refs_only() -> None:
    pod = pod_manifest(llm(SPECS["hf-auth-lora-sleep"]), 0, CONFIG)
    c = container(pod)
    env = {e["name"]: e for e in c["env"]}
    assert env["TIDAL_API_KEY"] == {"name": "TIDAL_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["HF_HUB_CACHE"]["value"].startswith("/models/hf-cache")
    assert env["LOG_LEVEL"] == {"name": "LOG_LEVEL", "value": "debug"}
    assert env["FROM_CM"]["valueFrom"] == {"configMapKeyRef": {"name": "c", "key": "k"}}
    assert all("value" not in e for e in c["env"] if e["name"] in ("TIDAL_API_KEY", "HF_TOKEN"))
    assert "--api-key" not in c["args"] and SECRET_VALUE not in json.dumps(pod)
    assert c["image"] == "my/engine:1"
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert volumes == {"model-cache", "adapters", "tidal-cache"}
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["priorityClassName"] == "high"
    assert spec["serviceAccountName"] == "engine" and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nodeAffinity" in spec["affinity"]
    assert pod["metadata"]["labels"]["team"] == "a" and pod["metadata"]["annotations"]["owner"] == "ml"


def test_user_env_overrides_by_name() -> None:
    spec = copy.deepcopy(SPECS["hf-auth-lora-sleep"])
    spec["engine"]["env"] = [{"name": "HF_HUB_CACHE", "value": "/elsewhere"}]
    env = container(pod_manifest(llm(spec), 0, CONFIG))["env"]
    assert [e for e in env if e["name"] == "HF_HUB_CACHE"] == [{"name": "HF_HUB_CACHE", "value": "/elsewhere"}]


def test_platform_pass_through_and_hygiene() -> None:
    pod = pod_manifest(llm(SPECS["platform"]), 0, CONFIG)
    spec, c = pod["spec"], container(pod)
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "certs", "secret": {"secretName": "ca"}} in spec["volumes"]
    assert {"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True} in c["volumeMounts"]
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert (spec["runtimeClassName"], spec["schedulerName"]) == ("nvidia", "volcano")
    assert c["resources"]["limits"]["amd.com/gpu"] == "1" and "nvidia.com/gpu" not in c["resources"]["limits"]
    # emptyDir volumes must not block the cluster autoscaler's scale-down; no API token.
    assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
    assert spec["automountServiceAccountToken"] is False
    pdb = disruption_budget_manifest(llm(SPECS["platform"]), CONFIG)
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": L.selector_labels("qwen")}}
    assert pdb["metadata"]["ownerReferences"][0]["controller"] is True
    assert disruption_budget_manifest(llm(SPECS["file"]), CONFIG)["spec"]["maxUnavailable"] == 1


def test_service() -> None:
    svc = service_manifest(llm(SPECS["bundled-cpu"], name="smollm2"), CONFIG)
    assert svc["metadata"]["name"] == "smollm2" and svc["metadata"]["namespace"] == "team-a"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {L.APP_NAME: "tidal-engine", L.LLMSERVICE: "smollm2"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["metadata"]["ownerReferences"][0]["controller"] is True
    pod = pod_manifest(llm(SPECS["bundled-cpu"], name="smollm2"), 0, CONFIG)
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


# --- spec hash -------------------------------------------------------------------------

BASE = SPECS["hf-auth-lora-sleep"]


def changed(**paths: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    for path, value in paths.items():
        node = spec
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return spec


@pytest.mark.parametrize("spec", [
    changed(lora__adapters=[{"name": "other", "uri": "hf://org/other"}]),
    changed(lora__adapters=[]),
    changed(replicas=3),
    changed(autoscaling={"maxReplicas": 4, "target": 2}),
    changed(sleep__afterIdleSeconds=900, sleep__level=2),
    changed(routing={"strategy": "prefixHash"}),
    changed(engine__port=8000),  # explicitly the default
    changed(quantization={"weights": "none", "kvCache": "auto"}),  # explicitly the defaults
], ids=["adapters", "no-adapters", "replicas", "autoscaling", "sleep-timing", "routing", "default-port", "default-quant"])
def test_spec_hash_ignores_what_does_not_shape_pods(spec: dict[str, Any]) -> None:
    assert spec_hash(spec) == spec_hash(BASE)


@pytest.mark.parametrize("spec", [
    changed(model__maxModelLen=8192),
    changed(engine__image="my/engine:2"),
    changed(engine__args=[]),
    changed(engine__resources={"gpu": 1, "memory": "64Gi"}),
    changed(lora__maxRank=16),
    changed(features__prefixCaching=True),
    changed(auth={"apiKeySecretRef": {"name": "other"}}),
    changed(podTemplate={"nodeSelector": {"gpu": "a100"}}),
    {k: v for k, v in BASE.items() if k != "sleep"},  # no sleep policy: no --enable-sleep-mode
    {k: v for k, v in BASE.items() if k != "lora"},
], ids=["maxModelLen", "image", "args", "resources", "lora-rank", "features", "auth", "podTemplate", "sleep-off", "lora-off"])
def test_spec_hash_changes_with_what_shapes_pods(spec: dict[str, Any]) -> None:
    assert spec_hash(spec) != spec_hash(BASE)


def test_spec_hash_is_stable_and_label_safe() -> None:
    h = spec_hash(BASE)
    assert h == spec_hash(copy.deepcopy(BASE)) and len(h) == 10 and h.isalnum() and h.islower()
    # A new default engine image rolls Pods that don't pin one.
    bundled = SPECS["bundled-cpu"]
    assert spec_hash(bundled, CONFIG) != spec_hash(bundled, OperatorConfig(default_engine_image="other:2"))
    assert spec_hash(BASE, CONFIG) == spec_hash(BASE, OperatorConfig(default_engine_image="other:2"))


def test_pod_names_are_dns_labels_even_for_long_names() -> None:
    long_a, long_b = "a" * 60 + "x", "a" * 60 + "y"
    a, b = pod_name(long_a, "0123456789", 12), pod_name(long_b, "0123456789", 12)
    assert len(a) <= 63 and len(b) <= 63 and a != b and a.endswith("-0123456789-12")
    assert pod_name("short", "0123456789", 0) == "short-0123456789-0"


def test_metadata_drift_restores_operator_labels_only() -> None:
    desired = pod_manifest(llm(SPECS["bundled-cpu"]), 0, CONFIG)
    actual = copy.deepcopy(desired)
    assert metadata_drift(desired, actual).patch() is None
    actual["metadata"]["labels"][L.LLMSERVICE] = "hijacked"
    actual["metadata"]["labels"][L.SLEEP_STATE] = "asleep-1"  # set by the idle controller: keep
    actual["metadata"]["labels"]["added-by-hand"] = "x"  # not ours: keep
    del actual["metadata"]["annotations"][L.SPEC_HASH]
    patch = metadata_drift(desired, actual).patch()
    assert patch == {"metadata": {"labels": {L.LLMSERVICE: "qwen"},
                                  "annotations": {L.SPEC_HASH: desired["metadata"]["annotations"][L.SPEC_HASH]}}}


@pytest.mark.parametrize("case", ["bundled-cpu", "file", "pvc-gpu", "pipeline"])
def test_engine_cli_accepts_the_generated_flags(case: str) -> None:
    """Catches drift between these flags and the engine's parser (when the engine is installed)."""
    cli = pytest.importorskip("tidal_engine.cli")
    argv = engine_args(SPECS[case], "m")
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.port == 8000


@pytest.mark.parametrize(("cache", "volume"), [
    ({"volume": "hostPath"}, {"hostPath": {"path": "/var/cache/tidal", "type": "DirectoryOrCreate"}}),
    ({"volume": "hostPath", "hostPath": "/mnt/nvme/tidal"}, {"hostPath": {"path": "/mnt/nvme/tidal", "type": "DirectoryOrCreate"}}),
    ({"volume": "persistentVolumeClaim", "claimName": "kernels"}, {"persistentVolumeClaim": {"claimName": "kernels"}}),
    ({"sizeLimit": "2Gi"}, {"emptyDir": {"sizeLimit": "2Gi"}}),
])
def test_start_up_cache_volume_choices(cache: dict[str, Any], volume: dict[str, Any]) -> None:
    # A node's hostPath (or a shared claim) lets the next Pod on the node start warm.
    body = llm({"model": {"uri": "bundled://smollm2-135m"}, "engine": {"cache": cache}})
    pod = pod_manifest(body, 0, CONFIG)
    assert {"name": "tidal-cache", **volume} in pod["spec"]["volumes"]
    assert {"name": "tidal-cache", "mountPath": "/var/cache/tidal"} in pod["spec"]["containers"][0]["volumeMounts"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
