"""Pure functions from an LLMService to the objects it owns: engine Pods and a Service.

No I/O and no globals: everything comes from the CR body and an OperatorConfig. The kopf
handlers create what these return; tests validate every output with kubernetes-validate.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubernetes.utils import parse_quantity

from .. import labels as L
from ..api.types import LLMServiceSpec, OperatorConfig
from .gpu_claim import POD_CLAIM, pod_resource_claims, uses_shared_claim

HTTP_PORT_NAME = "http"
CONTAINER_NAME = "engine"
MODELS_ROOT = "/models"
HF_CACHE_DIR = "/models/hf-cache"
ADAPTERS_DIR = "/adapters"
CACHE_DIR = "/var/cache/tidal"  # the engine's start-up cache (TIDAL_CACHE_DIR)
CACHE_VOLUME = "tidal-cache"
API_KEY_ENV = "TIDAL_API_KEY"
HF_TOKEN_ENV = "HF_TOKEN"
# The engine binds to the Pod's own IP, given by the downward API. Correct on a real
# cluster (probes and Services reach the Pod IP) and under `tidal dev`, where every local
# Pod is a process on its own 127.0.0.N and binding 0.0.0.0 would collide on the port.
POD_IP_ENV = "POD_IP"
BIND_ALL = "0.0.0.0"
# emptyDir volumes (model cache, adapters) otherwise stop the cluster autoscaler from
# draining the node: the model is downloaded again, nothing is lost.
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
STARTUP_PERIOD_SECONDS = 10
POD_NAME_MAX = 63  # Pod names double as hostnames under the headless Service: a DNS label.


def _spec(spec: LLMServiceSpec | Mapping[str, Any]) -> LLMServiceSpec:
    return spec if isinstance(spec, LLMServiceSpec) else LLMServiceSpec.from_body(spec)


# --- model sources ---------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """How a model URI reaches the engine: the positional `model` argument, plus the
    volumes, mounts and environment it needs."""

    model_arg: str
    extra_args: tuple[str, ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    needs_network: bool = False


def model_source(spec: LLMServiceSpec | Mapping[str, Any]) -> ModelSource:
    """Map spec.model.uri to what the engine is given. Assumes a validated URI."""
    s = _spec(spec)
    uri = s.model.uri
    if uri.startswith("bundled://"):
        # The engine resolves the alias to weights shipped as a Python package.
        return ModelSource(model_arg=uri[len("bundled://"):])
    if uri.startswith("file://"):
        # A path inside the container's filesystem (the image, or the host for `tidal dev`).
        return ModelSource(model_arg=uri[len("file://"):])
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        mount = f"{MODELS_ROOT}/{claim}"
        volume_name = "model"
        return ModelSource(
            model_arg=f"{mount}/{sub}".rstrip("/") if sub else mount,
            volumes=({"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
            mounts=({"name": volume_name, "mountPath": mount, "readOnly": True},),
        )
    if uri.startswith("hf://"):
        # The engine downloads from the Hub at start (vLLM semantics for a hub id), into a
        # per-Pod cache volume. This needs network access to the Hub from the Pod; for air-
        # gapped clusters, pre-stage the weights on a PVC and use pvc:// instead.
        repo, _, revision = uri[len("hf://"):].partition("@")
        env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": HF_CACHE_DIR},
                                     {"name": "HF_HUB_CACHE", "value": f"{HF_CACHE_DIR}/hub"}]
        ref = s.model.hf_token_secret_ref
        if ref is not None:
            env.append(_secret_env(HF_TOKEN_ENV, ref.name, ref.key))
        return ModelSource(
            model_arg=repo,
            extra_args=("--revision", revision) if revision else (),
            volumes=({"name": "model-cache", "emptyDir": {}},),
            mounts=({"name": "model-cache", "mountPath": HF_CACHE_DIR},),
            env=tuple(env),
            needs_network=True,
        )
    raise ValueError(f"unsupported model URI {uri!r}")


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    # Only a reference: the value never leaves the Secret.
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


# --- engine command line ---------------------------------------------------------------

def engine_args(spec: LLMServiceSpec | Mapping[str, Any], name: str, config: OperatorConfig | None = None) -> list[str]:
    """The engine's full command line: `tidal-engine serve <model> --flag ...`, with
    spec.engine.args last so they override anything derived here (argparse: last wins)."""
    s = _spec(spec)
    src = model_source(s)
    e = s.engine
    argv = ["tidal-engine", "serve", src.model_arg, *src.extra_args,
            # Every address in the Pod: `kubectl port-forward` and sidecars (service meshes)
            # connect through localhost. The Pod IP stays what status and the router advertise.
            "--host", BIND_ALL, "--port", str(e.port),
            "--served-model-name", s.served_name(name)]
    if s.model.max_model_len is not None:
        argv += ["--max-model-len", str(s.model.max_model_len)]
    argv += ["--tensor-parallel-size", str(s.parallelism.tensor),
             "--pipeline-parallel-size", str(s.parallelism.pipeline),
             "--dtype", s.model.dtype]
    if s.model.task != "generate":  # a pooling model: embeddings, or cross-encoder scores
        argv += ["--runner", "pooling", "--convert", "embed" if s.model.task == "embed" else "classify"]
    if e.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", _number(e.gpu_memory_utilization)]
    elif s.gpu_share is not None and s.gpu_share.memory_fraction is not None:
        argv += ["--gpu-memory-utilization", _number(s.gpu_share.memory_fraction)]  # its share of the device
    if e.kv_cache_memory is not None:
        argv += ["--kv-cache-memory-bytes", str(int(parse_quantity(e.kv_cache_memory)))]
    if e.kv_offload is not None:  # the engine takes GiB (vLLM's flag)
        argv += ["--kv-offloading-size", _number(float(parse_quantity(e.kv_offload.size)) / 2**30),
                 "--kv-offloading-backend", "native"]
    argv.append("--enable-prefix-caching" if s.features.prefix_caching else "--no-enable-prefix-caching")
    argv.append("--enable-chunked-prefill" if s.features.chunked_prefill else "--no-enable-chunked-prefill")
    if s.quantization.weights != "none":
        argv += ["--quantization", s.quantization.weights]
    if s.quantization.kv_cache != "auto":
        argv += ["--kv-cache-dtype", s.quantization.kv_cache]
    if s.lora is not None:
        argv += ["--enable-lora", "--max-loras", str(s.lora.max_adapters), "--max-lora-rank", str(s.lora.max_rank)]
        # Where the LoRA controller may load adapters from at run time (the engine refuses any
        # other path): the model volumes, the adapters scratch dir and the file:// roots.
        roots = [MODELS_ROOT, ADAPTERS_DIR, *(config.allowed_file_roots if config is not None else ())]
        argv += ["--allowed-lora-roots", *dict.fromkeys(roots)]
    if s.sleep is not None or s.gpu_share is not None:  # a GPU-share member sleeps to make room
        argv.append("--enable-sleep-mode")
    if s.speculative is not None:
        draft = s.speculative.draft_model_uri
        draft_arg = draft.split("://", 1)[1] if draft else None  # bundled:// → alias, file:// → path
        argv += ["--speculative-config", json.dumps(s.speculative.engine_config(draft_arg), separators=(",", ":"))]
    return argv + list(e.args)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# --- spec hash ------------------------------------------------------------------------

def pod_affecting_spec(spec: LLMServiceSpec | Mapping[str, Any], config: OperatorConfig | None = None) -> dict[str, Any]:
    """The part of the spec that shapes a Pod. Everything else (replicas, autoscaling, the
    sleep timings, routing, the adapter list) is applied to running Pods without a restart."""
    s = _spec(spec)
    # exclude_defaults: a field that is absent and one set to its default hash the same, and
    # a new defaulted field added in a later operator version doesn't roll every Pod.
    dump = s.model_dump(by_alias=True, exclude_defaults=True, mode="json")
    out = {k: dump[k] for k in ("model", "engine", "parallelism", "quantization", "features", "auth", "podTemplate",
                                    "gpuShare", "speculative") if k in dump}
    if s.lora is not None:
        lora = s.lora.model_dump(by_alias=True, mode="json", exclude={"adapters"})
        out["lora"] = lora
    if s.sleep is not None or s.gpu_share is not None:
        out["sleepMode"] = True  # only --enable-sleep-mode reaches the Pod
    if config is not None and s.engine.image is None:
        out["defaultImage"] = config.default_engine_image  # a new default image rolls Pods
    return out


def spec_hash(spec: LLMServiceSpec | Mapping[str, Any], config: OperatorConfig | None = None) -> str:
    """A stable 10-hex-digit hash of the Pod-affecting spec; the same in every process."""
    canonical = json.dumps(pod_affecting_spec(spec, config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


# --- names ------------------------------------------------------------------------------

def pod_name(llm_name: str, hash_: str, index: int) -> str:
    """`<llm>-<spec hash>-<index>`: deterministic, so a restarted operator that recomputes
    a plan asks for the same names and the API server's AlreadyExists stops a duplicate."""
    suffix = f"-{hash_}-{index}"
    prefix = llm_name
    if len(prefix) + len(suffix) > POD_NAME_MAX:
        # Keep it a DNS label; a short digest of the full name keeps truncated names distinct.
        digest = hashlib.sha256(llm_name.encode()).hexdigest()[:4]
        prefix = llm_name[: POD_NAME_MAX - len(suffix) - 5].rstrip("-") + "-" + digest
    return prefix + suffix


def service_name(llm_name: str) -> str:
    return llm_name


def endpoint_url(llm_name: str, namespace: str, port: int, cluster_domain: str = "cluster.local") -> str:
    return f"http://{service_name(llm_name)}.{namespace}.svc.{cluster_domain}:{port}/v1"


def owner_reference(llm: Mapping[str, Any]) -> dict[str, Any]:
    meta = llm["metadata"]
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


# --- the Pod ----------------------------------------------------------------------------

def pod_labels(llm_name: str, index: int, spec: LLMServiceSpec) -> dict[str, str]:
    """User labels first, then the operator's (which win; validation rejects reserved keys)."""
    out = dict(spec.pod_template.labels)
    out.update({L.APP_NAME: L.APP_NAME_VALUE, L.APP_INSTANCE: llm_name, L.APP_COMPONENT: L.COMPONENT_VALUE,
                L.MANAGED_BY: L.MANAGED_BY_VALUE, L.LLMSERVICE: llm_name, L.REPLICA_INDEX: str(index),
                L.SLEEP_STATE: L.SLEEP_AWAKE})
    return out


def cache_volume(spec: LLMServiceSpec) -> dict[str, Any]:
    """The start-up cache (Triton's compiled kernels, the one-row-linear choices): per Pod
    (emptyDir), per node (hostPath), or a claim the user shares (persistentVolumeClaim)."""
    cache = spec.engine.cache
    if cache.volume == "hostPath":
        return {"name": CACHE_VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    if cache.volume == "persistentVolumeClaim":
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    empty: dict[str, Any] = {} if cache.size_limit is None else {"sizeLimit": str(cache.size_limit)}
    return {"name": CACHE_VOLUME, "emptyDir": empty}


def _env(spec: LLMServiceSpec, src: ModelSource) -> list[dict[str, Any]]:
    # POD_IP first: `$(POD_IP)` in args (and in later env values) can only refer to it then.
    env: list[dict[str, Any]] = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                 {"name": "TIDAL_CACHE_DIR", "value": CACHE_DIR}]
    env += [dict(e) for e in src.env]
    if spec.auth is not None:
        ref = spec.auth.api_key_secret_ref
        env.append(_secret_env(API_KEY_ENV, ref.name, ref.key))
    # User entries override ours by name (Kubernetes would keep both and use the last).
    for user in spec.engine.env:
        item = user.model_dump(by_alias=True, exclude_none=True, mode="json")
        env = [x for x in env if x["name"] != item["name"]] + [item]
    return env


def _resources(spec: LLMServiceSpec) -> dict[str, Any]:
    r = spec.engine.resources
    memory = str(r.memory)
    if spec.engine.kv_offload is not None:  # the host KV pool comes on top of what the engine asked for
        memory = str(int(parse_quantity(r.memory) + parse_quantity(spec.engine.kv_offload.size)))
    requests: dict[str, Any] = {"cpu": str(r.cpu), "memory": memory}
    # Memory limit = request: an engine that outgrows it should be OOM-killed and reported,
    # not take the node's memory. No CPU limit: throttling only adds latency.
    limits: dict[str, Any] = {"memory": memory}
    if uses_shared_claim(spec):  # the group's device comes from its ResourceClaim, not a GPU of its own
        return {"requests": requests, "limits": limits, "claims": [{"name": POD_CLAIM}]}
    if spec.gpu_count:
        limits[r.gpu_resource_name] = str(spec.gpu_count)
        requests[r.gpu_resource_name] = str(spec.gpu_count)
    return {"requests": requests, "limits": limits}


def _probes(spec: LLMServiceSpec) -> dict[str, Any]:
    http = {"path": "/health", "port": HTTP_PORT_NAME}
    # failureThreshold x periodSeconds >= startupTimeoutSeconds: model loading gets the
    # whole budget before liveness takes over.
    threshold = math.ceil(spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    return {
        "startupProbe": {"httpGet": http, "periodSeconds": STARTUP_PERIOD_SECONDS, "timeoutSeconds": 5,
                         "failureThreshold": threshold},
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"httpGet": http, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 4},
    }


def pod_manifest(llm: Mapping[str, Any], index: int, config: OperatorConfig) -> dict[str, Any]:
    """The engine Pod with replica index `index` for the LLMService body `llm` (which must
    carry metadata.name, .namespace and .uid). Its name comes from `pod_name`."""
    meta = llm["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or config.namespace or "default"
    spec = _spec(llm["spec"])
    hash_ = spec_hash(spec, config)
    src = model_source(spec)
    argv = engine_args(spec, name, config)

    volumes = list(src.volumes)
    mounts = list(src.mounts)
    if spec.parallelism.world_size > 1:
        # NCCL (and gloo on CPU) exchange tensors through shared memory; the runtime's default
        # 64Mi is too small. 1Gi per rank, counted against the Pod's memory.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": f"{spec.parallelism.world_size}Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.lora is not None:
        # Where the engine puts adapters it downloads at run time (LoRA changes don't restart Pods).
        volumes.append({"name": "adapters", "emptyDir": {}})
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_DIR})

    volumes.append(cache_volume(spec))
    mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_DIR})

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image or config.default_engine_image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": argv[:2],
        "args": argv[2:],
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": _env(spec, src),
        "resources": _resources(spec),
        **_probes(spec),
        # The engine drains in-flight requests on SIGTERM; this pause first lets the
        # endpoints and the router stop sending new ones to a Pod that is going away.
        "lifecycle": {"preStop": {"sleep": {"seconds": config.pre_stop_sleep_seconds}}},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts + [dict(m) for m in spec.pod_template.volume_mounts],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pt = spec.pod_template
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": config.termination_grace_period_seconds,
        # hostname.subdomain gives each replica a stable DNS name under the headless Service.
        "hostname": pod_name(name, hash_, index),
        "subdomain": service_name(name),
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token in the Pod.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": config.run_as_user, "runAsGroup": config.run_as_user,
                            "fsGroup": config.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": volumes + [dict(v) for v in pt.volumes],
    }
    if claims := pod_resource_claims(spec):
        pod_spec["resourceClaims"] = claims
    if pt.node_selector:
        pod_spec["nodeSelector"] = dict(pt.node_selector)
    if pt.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in pt.tolerations]
    if pt.affinity:
        pod_spec["affinity"] = pt.affinity
    if pt.priority_class_name:
        pod_spec["priorityClassName"] = pt.priority_class_name
    if pt.service_account_name:
        pod_spec["serviceAccountName"] = pt.service_account_name
    if pt.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in pt.image_pull_secrets]
    if pt.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(c) for c in pt.topology_spread_constraints]
    if pt.runtime_class_name:
        pod_spec["runtimeClassName"] = pt.runtime_class_name
    if pt.scheduler_name:
        pod_spec["schedulerName"] = pt.scheduler_name

    annotations = {SAFE_TO_EVICT: "true", **pt.annotations}
    annotations[L.SPEC_HASH] = hash_
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(name, hash_, index),
            "namespace": namespace,
            "labels": pod_labels(name, index, spec),
            "annotations": annotations,
            "ownerReferences": [owner_reference(llm)],
        },
        "spec": pod_spec,
    }


def disruption_budget_manifest(llm: Mapping[str, Any], config: OperatorConfig | None = None) -> dict[str, Any]:
    """The PodDisruptionBudget over the engine Pods (spec.disruption.maxUnavailable)."""
    meta = llm["metadata"]
    name = meta["name"]
    namespace = meta.get("namespace") or (config.namespace if config else None) or "default"
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {L.APP_NAME: L.APP_NAME_VALUE, L.APP_INSTANCE: name, L.MANAGED_BY: L.MANAGED_BY_VALUE,
                       L.LLMSERVICE: name},
            "ownerReferences": [owner_reference(llm)],
        },
        "spec": {"maxUnavailable": _spec(llm["spec"]).disruption.max_unavailable,
                 "selector": {"matchLabels": L.selector_labels(name)}},
    }


def service_manifest(llm: Mapping[str, Any], config: OperatorConfig | None = None) -> dict[str, Any]:
    """A headless Service over the engine Pods: per-replica DNS and the status endpoint."""
    meta = llm["metadata"]
    name = meta["name"]
    namespace = meta.get("namespace") or (config.namespace if config else None) or "default"
    port = _spec(llm["spec"]).engine.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": namespace,
            "labels": {L.APP_NAME: L.APP_NAME_VALUE, L.APP_INSTANCE: name, L.MANAGED_BY: L.MANAGED_BY_VALUE,
                       L.LLMSERVICE: name},
            "ownerReferences": [owner_reference(llm)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": L.selector_labels(name),
            "ports": [{"name": HTTP_PORT_NAME, "port": port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}],
            "publishNotReadyAddresses": False,
        },
    }


# --- drift --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetadataDrift:
    """A merge patch restoring the operator-owned labels/annotations of a live Pod."""

    labels: dict[str, str | None] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)

    def patch(self) -> dict[str, Any] | None:
        meta: dict[str, Any] = {}
        if self.labels:
            meta["labels"] = self.labels
        if self.annotations:
            meta["annotations"] = self.annotations
        return {"metadata": meta} if meta else None


def metadata_drift(desired: Mapping[str, Any], actual: Mapping[str, Any]) -> MetadataDrift:
    """What to patch on `actual` so its labels/annotations match `desired` again. Keys that
    other controllers change on purpose (sleep state, loaded adapters) are left alone, and
    keys someone added by hand are kept (we only restore what we set)."""
    def diff(kind: str, skip: frozenset[str]) -> dict[str, str | None]:
        want = desired.get("metadata", {}).get(kind) or {}
        have = actual.get("metadata", {}).get(kind) or {}
        return {k: v for k, v in want.items() if k not in skip and have.get(k) != v}
    return MetadataDrift(diff("labels", L.MUTABLE_LABELS), diff("annotations", L.MUTABLE_ANNOTATIONS))
