"""Cross-field validation of an LLMService spec, beyond what the CRD schema can say.

Everything the CRD's schema and CEL rules check is checked here too, because a spec can reach
the operator unchecked (an API server without CEL, `tidal dev` without cel-python, an object
stored under an older CRD), and because a problem found here gets a clear message in
`status.conditions[Validated]` and an Event.

Pure: Secret existence comes from an injected `secret_lookup(name) -> bool`. Messages name
Secrets and keys, never values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kubernetes.utils import parse_quantity
from pydantic import ValidationError

from .. import labels
from .types import LLMServiceSpec, OperatorConfig

SecretLookup = Callable[[str], bool]

# The models `bundled://` may name: those shipped as Python packages with the engine.
BUNDLED_MODELS: frozenset[str] = frozenset({"smollm2-135m", "all-minilm-l6-v2"})
URI_SCHEMES: tuple[str, ...] = ("hf://", "pvc://", "file://", "bundled://")

# hf://org/name[@revision]. Hub ids: letters, digits, '-', '_', '.'.
HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[A-Za-z0-9._/-]+))?$")
# pvc://claim[/path]: claim is a DNS-1123 subdomain-ish name (the PVC's name).
PVC_URI = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(?P<path>/.*)?$")
FILE_URI = re.compile(r"^file://(?P<path>/.*)$")
BUNDLED_URI = re.compile(r"^bundled://(?P<name>[a-z0-9][a-z0-9._-]*)$")
# What clients send as `model`: no whitespace or control characters.
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# The LLMService name also names the Service and prefixes Pod names: a DNS-1035 label.
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class ValidationProblem:
    """One reason a spec can't be reconciled. `field` is a path like `spec.model.uri`."""

    field: str
    message: str
    reason: str = "InvalidSpec"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def parse_spec(spec: LLMServiceSpec | Mapping[str, Any]) -> tuple[LLMServiceSpec | None, list[ValidationProblem]]:
    """Parse a raw spec into the typed model, turning pydantic errors into problems."""
    if isinstance(spec, LLMServiceSpec):
        return spec, []
    try:
        return LLMServiceSpec.from_body(spec), []
    except ValidationError as exc:
        return None, [_problem_from_pydantic(err) for err in exc.errors()]


def validate_spec(
    spec: LLMServiceSpec | Mapping[str, Any],
    *,
    name: str,
    namespace: str,
    secret_lookup: SecretLookup | None = None,
    config: OperatorConfig | None = None,
) -> list[ValidationProblem]:
    """All problems that stop `spec` from being reconciled; empty when it is valid.

    secret_lookup(name) says whether a Secret exists in `namespace`; None skips that check.
    """
    config = config or OperatorConfig()
    problems: list[ValidationProblem] = []
    if not DNS_1035_LABEL.match(name):
        problems.append(ValidationProblem(
            "metadata.name",
            f"{name!r} must be a DNS-1035 label (lower-case letters, digits and '-', starting "
            "with a letter, at most 63 characters): it names the Service and the Pods",
            "InvalidName"))
    parsed, parse_problems = parse_spec(spec)
    problems += parse_problems
    if parsed is None:
        # Still report a bad model URI, the most common mistake, next to the parse errors.
        model = spec.get("model") if isinstance(spec, Mapping) else None
        uri = model.get("uri") if isinstance(model, Mapping) else None
        if isinstance(uri, str) and (p := check_model_uri(uri, "spec.model.uri")):
            problems.append(p)
        return problems
    problems += _check_model(parsed, name)
    problems += _check_parallelism(parsed, config)
    problems += _check_resources(parsed)
    problems += _check_scaling(parsed)
    problems += _check_sleep(parsed)
    problems += _check_speculative(parsed)
    problems += _check_rollout(parsed)
    problems += _check_lora(parsed, config)
    problems += _check_pod_template(parsed)
    problems += _check_gpu_share(parsed)
    problems += _check_cache(parsed)
    if secret_lookup is not None:
        problems += _check_secrets(parsed, namespace, secret_lookup)
    return problems


# --- individual rules --------------------------------------------------------------------

def _check_model(spec: LLMServiceSpec, name: str) -> list[ValidationProblem]:
    uri = spec.model.uri
    out = [p for p in [check_model_uri(uri, "spec.model.uri")] if p]
    if spec.model.task != "generate" and spec.lora is not None:
        out.append(ValidationProblem("spec.lora", f"LoRA adapters need model.task generate, not {spec.model.task!r}",
                                     "LoRAOnPoolingModel"))
    served = spec.served_name(name)
    if not SERVED_NAME.match(served):
        out.append(ValidationProblem(
            "spec.model.servedName",
            f"{served!r} is not a valid model name: use letters, digits and . _ : / - "
            "(starting with a letter or digit, at most 128 characters)", "InvalidServedName"))
    if spec.model.hf_token_secret_ref is not None and not uri.startswith("hf://"):
        out.append(ValidationProblem(
            "spec.model.hfTokenSecretRef", "is only used with hf:// model URIs", "UnusedHfToken"))
    return out


def check_model_uri(uri: str, field: str) -> ValidationProblem | None:
    """The scheme and the scheme-specific format of a model (or adapter) URI."""
    if not uri.startswith(URI_SCHEMES):
        scheme = uri.split("://", 1)[0] + "://" if "://" in uri else uri
        return ValidationProblem(
            field, f"unsupported URI scheme in {scheme!r}: use hf://org/name[@revision], "
            "pvc://claim/path, file:///absolute/path or bundled://<name>", "UnsupportedURIScheme")
    if uri.startswith("hf://") and not HF_URI.match(uri):
        return ValidationProblem(field, f"{uri!r} is not of the form hf://org/name[@revision]", "InvalidURI")
    if uri.startswith("pvc://") and not PVC_URI.match(uri):
        return ValidationProblem(field, f"{uri!r} is not of the form pvc://claim/path "
                                 "(claim: a PersistentVolumeClaim name)", "InvalidURI")
    if uri.startswith("file://") and not FILE_URI.match(uri):
        return ValidationProblem(field, f"{uri!r} is not of the form file:///absolute/path", "InvalidURI")
    if uri.startswith("bundled://"):
        m = BUNDLED_URI.match(uri)
        if not m or m["name"] not in BUNDLED_MODELS:
            known = ", ".join(f"bundled://{n}" for n in sorted(BUNDLED_MODELS))
            return ValidationProblem(field, f"{uri!r} is not a bundled model; known: {known}", "UnknownBundledModel")
    return None


def _check_parallelism(spec: LLMServiceSpec, config: OperatorConfig) -> list[ValidationProblem]:
    """GPU engines need exactly tensor x pipeline GPUs, all on one node; CPU engines (no GPUs)
    may run tensor or pipeline ranks too (gloo, as vLLM's CPU backend does)."""
    world = spec.parallelism.world_size
    gpu = spec.engine.resources.gpu or 0
    if gpu > 0 and gpu != world:
        return [ValidationProblem(
            "spec.engine.resources.gpu",
            f"asks for {gpu} GPU(s) but tensor ({spec.parallelism.tensor}) x pipeline "
            f"({spec.parallelism.pipeline}) = {world}: each engine Pod needs exactly "
            "tensor x pipeline GPUs", "GPUCountMismatch")]
    if world > 1 and spec.model.task != "generate":
        return [ValidationProblem(
            "spec.parallelism",
            f"model.task {spec.model.task} (a pooling model) runs on one device: tensor x pipeline must be 1",
            "UnsupportedParallelism")]
    if world > 1 and spec.engine.kv_offload is not None:
        return [ValidationProblem(
            "spec.engine.kvOffload",
            "KV offload to host memory runs with one engine rank for now: tensor x pipeline must be 1",
            "UnsupportedKvOffload")]
    if gpu > config.max_gpus_per_node:
        return [ValidationProblem(
            "spec.parallelism",
            f"tensor x pipeline = {world} GPUs per engine Pod, more than one node offers "
            f"({config.max_gpus_per_node}); parallelism across nodes is not supported",
            "TooManyGPUsPerNode")]
    return []


def _check_resources(spec: LLMServiceSpec) -> list[ValidationProblem]:
    out = []
    fields = {"spec.engine.resources.cpu": spec.engine.resources.cpu,
              "spec.engine.resources.memory": spec.engine.resources.memory,
              "spec.engine.kvCacheMemory": spec.engine.kv_cache_memory,
              "spec.engine.cache.sizeLimit": spec.engine.cache.size_limit,
              "spec.engine.kvOffload.size": spec.engine.kv_offload.size if spec.engine.kv_offload else None}
    for path, value in fields.items():
        if value is None:
            continue
        try:
            if parse_quantity(value) <= 0:
                raise ValueError
        except ValueError:
            out.append(ValidationProblem(path, f"{value!r} is not a positive Kubernetes quantity "
                                         "(for example 2, 500m, 4Gi)", "InvalidQuantity"))
    return out


def _check_scaling(spec: LLMServiceSpec) -> list[ValidationProblem]:
    out = []
    a = spec.autoscaling
    if spec.replicas is not None and a is not None and a.mode == "builtin":
        out.append(ValidationProblem(
            "spec.replicas",
            "is set together with spec.autoscaling: use one or the other (only the hpa and "
            "keda modes share spec.replicas, which the HPA or KEDA then writes)", "ReplicasAndAutoscaling"))
    if a is not None:
        if a.min_replicas > a.max_replicas:
            out.append(ValidationProblem(
                "spec.autoscaling", f"minReplicas ({a.min_replicas}) is greater than maxReplicas "
                f"({a.max_replicas})", "InvalidAutoscaling"))
        if a.metric == "kvCacheUsage" and a.target > 1:
            out.append(ValidationProblem(
                "spec.autoscaling.target", f"kvCacheUsage is a fraction: the target must be in "
                f"(0, 1], got {a.target}", "InvalidAutoscaling"))
    return out


def _check_rollout(spec: LLMServiceSpec) -> list[ValidationProblem]:
    r = spec.rollout
    if r.max_surge == 0 and r.max_unavailable == 0:
        return [ValidationProblem("spec.rollout", "maxSurge and maxUnavailable can't both be 0: a rollout "
                                  "could never replace a Pod", "InvalidRollout")]
    return []


DRAFT_URI_SCHEMES = ("bundled://", "file://")  # a path or alias the engine reads as the target's, no volume


def _check_speculative(spec: LLMServiceSpec) -> list[ValidationProblem]:
    s = spec.speculative
    if s is None:
        return []
    field = "spec.speculative.draftModelUri"
    if s.method == "ngram":
        if s.draft_model_uri is not None:
            return [ValidationProblem(field, "is only used with method draft_model", "InvalidSpeculative")]
        if s.prompt_lookup_min > s.prompt_lookup_max:
            return [ValidationProblem("spec.speculative.promptLookupMax",
                                      f"({s.prompt_lookup_max}) must be >= promptLookupMin ({s.prompt_lookup_min})",
                                      "InvalidSpeculative")]
        return []
    if not s.draft_model_uri:
        return [ValidationProblem(field, "method draft_model needs a draft model URI", "InvalidSpeculative")]
    problem = check_model_uri(s.draft_model_uri, field)  # the target model's own checks
    if problem is None and not s.draft_model_uri.startswith(DRAFT_URI_SCHEMES):
        problem = ValidationProblem(field, "a draft model is given as bundled://<name> or file:///path for now "
                                    "(hf:// and pvc:// drafts are not supported yet)", "InvalidSpeculative")
    return [problem] if problem else []


def _check_sleep(spec: LLMServiceSpec) -> list[ValidationProblem]:
    s = spec.sleep
    if s is None:
        return []
    out = []
    if s.deep_after_seconds is not None:
        if s.level == 2:
            out.append(ValidationProblem("spec.sleep.deepAfterSeconds",
                                         "only applies with level 1 (level 2 is already the deep sleep)", "InvalidSleep"))
        elif s.deep_after_seconds <= s.after_idle_seconds:
            out.append(ValidationProblem("spec.sleep.deepAfterSeconds",
                                         f"({s.deep_after_seconds}) must be greater than afterIdleSeconds "
                                         f"({s.after_idle_seconds}): both count from the start of idleness", "InvalidSleep"))
    last = max(s.after_idle_seconds, s.deep_after_seconds or 0)
    if s.remove_after_seconds is not None and s.remove_after_seconds <= last:
        out.append(ValidationProblem("spec.sleep.removeAfterSeconds",
                                     f"({s.remove_after_seconds}) must be greater than the sleep steps before "
                                     f"it ({last}s): all count from the start of idleness", "InvalidSleep"))
    return out


def _check_lora(spec: LLMServiceSpec, config: OperatorConfig) -> list[ValidationProblem]:
    if spec.lora is None:
        return []
    out = []
    seen: set[str] = set()
    for i, adapter in enumerate(spec.lora.adapters):
        path = f"spec.lora.adapters[{i}]"
        if adapter.name in seen:
            out.append(ValidationProblem(f"{path}.name", f"duplicate adapter name {adapter.name!r}", "DuplicateAdapter"))
        seen.add(adapter.name)
        if not ADAPTER_NAME.match(adapter.name):
            out.append(ValidationProblem(f"{path}.name", f"{adapter.name!r} is not a valid adapter name "
                                         "(letters, digits, . _ -, at most 63 characters)", "InvalidAdapter"))
        uri_problem = check_adapter_uri(adapter.uri, f"{path}.uri", config)
        if uri_problem:
            out.append(uri_problem)
    return out


def check_adapter_uri(uri: str, field: str, config: OperatorConfig) -> ValidationProblem | None:
    """An adapter URI must be well-formed and come from a source the operator allows."""
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        roots = [r.rstrip("/") + "/" for r in config.allowed_file_roots]
        if FILE_URI.match(uri) and "/../" not in path + "/" and any(path.startswith(r) for r in roots):
            return None
        where = ", ".join(config.allowed_file_roots) or "nowhere (no file roots are configured)"
        return ValidationProblem(field, f"file:// adapters are only allowed under {where}: allow a directory with "
                                 "the operator's --allowed-file-root DIR (env TIDAL_ALLOWED_FILE_ROOTS, comma-"
                                 "separated; locally: tidal dev up --allow-file-root DIR)", "AdapterURINotAllowed")
    allowed = config.allowed_adapter_uri_prefixes
    if not uri.startswith(tuple(allowed)):
        return ValidationProblem(field, f"{uri!r} is not allowed: adapter URIs must start with one of "
                                 f"{', '.join(allowed)}", "AdapterURINotAllowed")
    if uri.startswith(URI_SCHEMES):
        return check_model_uri(uri, field)
    return None


def _check_gpu_share(spec: LLMServiceSpec) -> list[ValidationProblem]:
    """A member of a GPU-share group is one engine on one device (docs/gpu-sharing.md)."""
    g = spec.gpu_share
    if g is None:
        return []
    out = []
    e = spec.engine.gpu_memory_utilization
    if g.memory_fraction is not None and e is not None and g.memory_fraction != e:
        out.append(ValidationProblem("spec.gpuShare.memoryFraction",
                                     f"({g.memory_fraction}) differs from engine.gpuMemoryUtilization ({e}): set one "
                                     "of them (the member's share of the device)", "InvalidGPUShare"))
    if spec.autoscaling is not None or (spec.replicas or 0) > 1:
        out.append(ValidationProblem("spec.gpuShare", "a member of a GPU-share group runs one replica: leave "
                                     "spec.autoscaling unset and spec.replicas at 0 or 1", "InvalidGPUShare"))
    if spec.parallelism.world_size > 1:
        out.append(ValidationProblem("spec.gpuShare", "a member of a GPU-share group runs on one device: tensor x "
                                     "pipeline must be 1", "InvalidGPUShare"))
    return out


# A qualified extended-resource name: <DNS subdomain>/<name>.
EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# Names of the volumes the operator adds to the Pod (reconcile/manifests.py).
RESERVED_VOLUMES = frozenset({"model", "model-cache", "adapters", "dshm", "tidal-cache"})


def _check_pod_template(spec: LLMServiceSpec) -> list[ValidationProblem]:
    out = []
    gpu_name = spec.engine.resources.gpu_resource_name
    if not EXTENDED_RESOURCE.match(gpu_name) or gpu_name.startswith("kubernetes.io/"):
        out.append(ValidationProblem("spec.engine.resources.gpuResourceName",
                                     f"{gpu_name!r} is not an extended resource name (for example nvidia.com/gpu, "
                                     "amd.com/gpu)", "InvalidResourceName"))
    pt = spec.pod_template
    names = [v.get("name") for v in pt.volumes]
    for name in names:
        if not isinstance(name, str) or not name:
            out.append(ValidationProblem("spec.podTemplate.volumes", "every volume needs a name", "InvalidVolume"))
        elif name in RESERVED_VOLUMES:
            out.append(ValidationProblem("spec.podTemplate.volumes", f"{name!r} is the name of a volume the operator "
                                         "adds; choose another", "ReservedVolumeName"))
    for mount in pt.volume_mounts:
        if mount.get("name") not in names:
            out.append(ValidationProblem("spec.podTemplate.volumeMounts",
                                         f"mounts {mount.get('name')!r}, which is not in spec.podTemplate.volumes",
                                         "UnknownVolume"))
        if not isinstance(mount.get("mountPath"), str) or not mount["mountPath"].startswith("/"):
            out.append(ValidationProblem("spec.podTemplate.volumeMounts",
                                         f"{mount.get('name')!r}: mountPath must be an absolute path", "InvalidVolume"))
    for kind, mapping in (("labels", spec.pod_template.labels), ("annotations", spec.pod_template.annotations)):
        for key in sorted(mapping):
            if labels.is_reserved_key(key):
                out.append(ValidationProblem(f"spec.podTemplate.{kind}", f"{key!r} is reserved for the operator",
                                             "ReservedKey"))
    return out


def _check_cache(spec: LLMServiceSpec) -> list[ValidationProblem]:
    cache = spec.engine.cache
    if cache.volume == "persistentVolumeClaim" and not cache.claim_name:
        return [ValidationProblem("spec.engine.cache.claimName", "volume persistentVolumeClaim needs claimName",
                                  "MissingClaimName")]
    if cache.volume == "hostPath" and not cache.host_path.startswith("/"):
        return [ValidationProblem("spec.engine.cache.hostPath", f"{cache.host_path!r} must be an absolute path",
                                  "InvalidVolume")]
    return []


def _check_secrets(spec: LLMServiceSpec, namespace: str, secret_lookup: SecretLookup) -> list[ValidationProblem]:
    refs = []
    if spec.auth is not None:
        refs.append(("spec.auth.apiKeySecretRef", spec.auth.api_key_secret_ref))
    if spec.model.hf_token_secret_ref is not None:
        refs.append(("spec.model.hfTokenSecretRef", spec.model.hf_token_secret_ref))
    return [ValidationProblem(path, f"Secret {ref.name!r} (key {ref.key!r}) not found in namespace {namespace!r}",
                              "SecretNotFound")
            for path, ref in refs if not secret_lookup(ref.name)]


# --- pydantic errors → problems ------------------------------------------------------------

_CAMEL = re.compile(r"_([a-z])")


def _problem_from_pydantic(err: Mapping[str, Any]) -> ValidationProblem:
    loc = [str(p) for p in err.get("loc", ())]
    path = "spec"
    for part in loc:
        path += f"[{part}]" if part.isdigit() else "." + _CAMEL.sub(lambda m: m[1].upper(), part)
    kind = err.get("type", "")
    value = err.get("input")
    ctx = err.get("ctx") or {}
    # Only echo short scalar inputs, and never anything under env (values may be secrets).
    shown = repr(value) if isinstance(value, (int, float, str)) and len(str(value)) <= 80 and "env" not in loc else None
    got = f", got {shown}" if shown is not None else ""
    if kind == "literal_error":
        return ValidationProblem(path, f"unsupported value{' ' + shown if shown else ''}: supported values are "
                                 f"{ctx.get('expected', '?')}", "UnsupportedValue")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "?")
        return ValidationProblem(path, f"must be {op} {bound}{got}", "OutOfRange")
    if kind == "missing":
        return ValidationProblem(path, "is required", "MissingField")
    if kind == "extra_forbidden":
        return ValidationProblem(path, "is not a known field (check its spelling)", "UnknownField")
    return ValidationProblem(path, f"{err.get('msg', 'invalid')}{got}", "InvalidField")
