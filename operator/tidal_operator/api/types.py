"""Typed models of the LLMService spec, mirroring crds/tidal.dev_llmservices.yaml.

Field names are camelCase on the wire (aliases) and snake_case in Python. Every default
here is identical to the CRD's default (tests/operator/test_crd.py checks it): the operator
must get the same spec whether or not an API server defaulted it (an object stored before a
default was added to the CRD is not defaulted until it is written again).

The models check types and simple ranges only; cross-field rules live in validation.py,
which also turns pydantic's errors into readable problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# generate: chat/completions; embed: /v1/embeddings; score: /score and /rerank (a cross-encoder).
ModelTask = Literal["generate", "embed", "score"]
WeightQuantization = Literal["none", "fp8", "awq", "gptq"]
KvCacheDtype = Literal["auto", "fp8"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ScalingMetric = Literal["requestsWaiting", "requestsInFlight", "kvCacheUsage"]
ScalingMode = Literal["builtin", "hpa", "keda"]
RoutingStrategy = Literal["leastLoad", "prefixHash"]
CacheVolume = Literal["emptyDir", "hostPath", "persistentVolumeClaim"]
# Kubernetes quantities are int-or-string ("2", 2, "500m", "4Gi").
Quantity = Union[str, int]

DEFAULT_PORT = 8000
DEFAULT_STARTUP_TIMEOUT_SECONDS = 600
DEFAULT_CPU = "1"
DEFAULT_MEMORY = "2Gi"
DEFAULT_HF_TOKEN_KEY = "token"
DEFAULT_API_KEY_KEY = "api-key"
DEFAULT_REPLICAS = 1  # when neither spec.replicas nor spec.autoscaling is given
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_CACHE_HOST_PATH = "/var/cache/tidal"


class _Model(BaseModel):
    # extra="forbid": the local API server doesn't prune unknown fields, so a typo such as
    # `maxmodelLen` must surface as a problem rather than be silently ignored.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class SecretKeyRef(_Model):
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class HfTokenSecretRef(SecretKeyRef):
    key: str = Field(default=DEFAULT_HF_TOKEN_KEY, min_length=1)


class ApiKeySecretRef(SecretKeyRef):
    key: str = Field(default=DEFAULT_API_KEY_KEY, min_length=1)


class ModelSpec(_Model):
    uri: str = Field(min_length=1)
    served_name: str | None = None  # default: metadata.name
    max_model_len: int | None = Field(default=None, ge=1)
    dtype: Dtype = "auto"
    task: ModelTask = "generate"
    hf_token_secret_ref: HfTokenSecretRef | None = None


class EngineResources(_Model):
    cpu: Quantity = DEFAULT_CPU
    memory: Quantity = DEFAULT_MEMORY
    # Asking for GPUs: absent or 0 runs on CPU; otherwise it must equal tensor x pipeline.
    gpu: int | None = Field(default=None, ge=0)
    # The extended resource the GPUs are requested as (amd.com/gpu, a MIG profile, ...).
    gpu_resource_name: str = Field(default=DEFAULT_GPU_RESOURCE, min_length=3)


class EnvVar(_Model):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = None


class CacheSpec(_Model):
    """The engine's start-up cache volume (compiled kernels, one-row-linear choices)."""

    volume: CacheVolume = "emptyDir"
    host_path: str = DEFAULT_CACHE_HOST_PATH
    claim_name: str | None = None
    size_limit: Quantity | None = None  # emptyDir only


class KvOffloadSpec(_Model):
    """A host-memory tier for KV blocks evicted from the device (docs/kv-offload.md): the
    engine's --kv-offloading-size; the Pod's memory request and limit grow by ``size``."""

    size: Quantity  # for example 16Gi


class EngineSpec(_Model):
    image: str | None = None  # default: OperatorConfig.default_engine_image
    image_pull_policy: PullPolicy = "IfNotPresent"
    resources: EngineResources = Field(default_factory=EngineResources)
    args: list[str] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    kv_cache_memory: Quantity | None = None
    startup_timeout_seconds: int = Field(default=DEFAULT_STARTUP_TIMEOUT_SECONDS, ge=10)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    kv_offload: KvOffloadSpec | None = None  # absent: no host tier


class ParallelismSpec(_Model):
    tensor: int = Field(default=1, ge=1)
    pipeline: int = Field(default=1, ge=1)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline


class QuantizationSpec(_Model):
    weights: WeightQuantization = "none"
    kv_cache: KvCacheDtype = "auto"


class LoraAdapter(_Model):
    name: str = Field(min_length=1)
    uri: str = Field(min_length=1)


class LoraSpec(_Model):
    max_adapters: int = Field(default=4, ge=1)
    max_rank: int = Field(default=16, ge=1, le=512)
    adapters: list[LoraAdapter] = Field(default_factory=list)


class FeaturesSpec(_Model):
    prefix_caching: bool = True
    chunked_prefill: bool = True


class SpeculativeSpec(_Model):
    """Speculative decoding (docs/speculative-decoding.md) → the engine's --speculative-config:
    n-gram prompt lookup, or a draft model (a model URI, checked as spec.model.uri is) that
    shares the target's tokenizer."""

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    prompt_lookup_min: int = Field(default=1, ge=1)
    prompt_lookup_max: int = Field(default=3, ge=1)
    draft_model_uri: str | None = None  # method draft_model: bundled://<name> or file:///path

    def engine_config(self, draft_model_arg: str | None = None) -> dict[str, Any]:
        """The flag's JSON; ``draft_model_arg``: the draft's path or alias in the Pod."""
        if self.method == "draft_model":
            return {"model": draft_model_arg, "num_speculative_tokens": self.num_speculative_tokens}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}


class AutoscalingSpec(_Model):
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(ge=1)
    metric: ScalingMetric = "requestsWaiting"
    target: float = Field(gt=0)
    scale_up_stabilization_seconds: int = Field(default=0, ge=0)
    scale_down_delay_seconds: int = Field(default=300, ge=0)
    mode: ScalingMode = "builtin"


class SleepSpec(_Model):
    after_idle_seconds: int = Field(default=300, ge=1)
    level: Literal[1, 2] = 1
    # Both measured from the start of the idle window, not from the previous step.
    deep_after_seconds: int | None = Field(default=None, ge=1)
    remove_after_seconds: int | None = Field(default=None, ge=1)


class GpuShareSpec(_Model):
    """Several LLMServices taking turns on one GPU (docs/gpu-sharing.md). Members of a group
    (same namespace, same `group`) each use `memoryFraction` of the device while awake; the
    router keeps the awake members' fractions within 1 by putting the least recently used
    member to sleep before it wakes another."""

    group: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    # Absent: engine.gpuMemoryUtilization, else 1 (the whole device: one member awake at a time).
    memory_fraction: float | None = Field(default=None, gt=0, le=1)


class RoutingSpec(_Model):
    strategy: RoutingStrategy = "leastLoad"


class RolloutSpec(_Model):
    """How a spec change replaces Pods. Counts of Pods (no percentages). maxSurge 1,
    maxUnavailable 0: a new Pod first, an old one goes once it is Ready. maxSurge 0,
    maxUnavailable 1: an old Pod goes first (a full GPU pool has no room for a surge Pod)."""

    max_surge: int = Field(default=1, ge=0)
    max_unavailable: int = Field(default=0, ge=0)
    # A new Pod not Ready this long after its creation stalls the rollout: Progressing=False.
    progress_deadline_seconds: int = Field(default=DEFAULT_PROGRESS_DEADLINE_SECONDS, ge=1)


class AuthSpec(_Model):
    api_key_secret_ref: ApiKeySecretRef


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class LocalObjectReference(_Model):
    name: str = Field(min_length=1)


class PodTemplateSpec(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    service_account_name: str | None = None
    # Passed through to the Pod as Kubernetes defines them (the API server validates them).
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)  # on the engine container
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list)
    runtime_class_name: str | None = None
    scheduler_name: str | None = None


class DisruptionSpec(_Model):
    """The PodDisruptionBudget the operator keeps for the engine Pods (drains, node upgrades)."""

    max_unavailable: int = Field(default=1, ge=0)


class LLMServiceSpec(_Model):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    lora: LoraSpec | None = None  # absent: LoRA off (no --enable-lora)
    features: FeaturesSpec = Field(default_factory=FeaturesSpec)
    speculative: SpeculativeSpec | None = None  # absent: no speculative decoding
    replicas: int | None = Field(default=None, ge=0)
    autoscaling: AutoscalingSpec | None = None
    sleep: SleepSpec | None = None  # absent: never sleeps (no --enable-sleep-mode)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    gpu_share: GpuShareSpec | None = None  # absent: the engine has its device to itself
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    disruption: DisruptionSpec = Field(default_factory=DisruptionSpec)
    auth: AuthSpec | None = None
    pod_template: PodTemplateSpec = Field(default_factory=PodTemplateSpec)

    @classmethod
    def from_body(cls, spec: Mapping[str, Any]) -> "LLMServiceSpec":
        """Parse the `spec` of an LLMService body (camelCase keys). Raises pydantic's
        ValidationError; validation.validate_spec turns that into readable problems."""
        return cls.model_validate(dict(spec))

    def served_name(self, llm_name: str) -> str:
        return self.model.served_name or llm_name

    @property
    def gpu_count(self) -> int:
        """GPUs per Pod: tensor x pipeline when GPUs are asked for (engine.resources.gpu > 0),
        else 0 (a CPU engine)."""
        requested = self.engine.resources.gpu or 0
        return self.parallelism.world_size if requested > 0 else 0

    @property
    def gpu_share_fraction(self) -> float | None:
        """The share of the device this member uses awake; None outside a GPU-share group."""
        if self.gpu_share is None:
            return None
        return self.gpu_share.memory_fraction or self.engine.gpu_memory_utilization or 1.0

    def to_body(self) -> dict[str, Any]:
        """The spec as camelCase JSON, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


@dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide settings, passed into every pure function (never read from globals)."""

    default_engine_image: str = "ghcr.io/tidal-dev/tidal-engine:0.1.0"
    # Where LoRA adapters may come from. file:// adapters are allowed only under
    # allowed_file_roots, so a spec can't point the engine at arbitrary host paths.
    allowed_adapter_uri_prefixes: tuple[str, ...] = ("hf://", "pvc://", "bundled://")
    allowed_file_roots: tuple[str, ...] = ()
    namespace: str | None = None  # None: all namespaces
    # The most GPUs one node offers: an engine Pod (tensor x pipeline GPUs) must fit on one node
    # (multi-node parallelism is not built).
    max_gpus_per_node: int = 8
    cluster_domain: str = "cluster.local"
    termination_grace_period_seconds: int = 60
    # Seconds the preStop hook waits so endpoints and the router stop sending before SIGTERM.
    pre_stop_sleep_seconds: int = 5
    run_as_user: int = 1000
    # The DeviceClass of the one device a GPU-share group's ResourceClaim asks for
    # (reconcile/gpu_claim.py; NVIDIA's DRA driver names its class gpu.nvidia.com).
    gpu_share_device_class: str = "gpu.nvidia.com"
