"""api/types.py and api/validation.py: every invalid case gives a problem with a clear
message naming the field; valid specs give none; secret values never appear."""

from __future__ import annotations

from typing import Any

import pytest

from tidal_operator.api import LLMServiceSpec, OperatorConfig, ValidationProblem, validate_spec
from tidal_operator.api.validation import parse_spec

BASE: dict[str, Any] = {"model": {"uri": "bundled://smollm2-135m"}}
SECRETS = {"api-key", "hf-token"}


def problems(spec: dict[str, Any], *, name: str = "smollm2", config: OperatorConfig | None = None,
             secrets: set[str] = SECRETS) -> list[ValidationProblem]:
    return validate_spec(spec, name=name, namespace="team-a", secret_lookup=lambda s: s in secrets, config=config)


def only(spec: dict[str, Any], **kw: Any) -> ValidationProblem:
    found = problems(spec, **kw)
    assert len(found) == 1, found
    return found[0]


def test_from_body_parses_camel_case_with_defaults() -> None:
    spec = LLMServiceSpec.from_body({"model": {"uri": "hf://Qwen/Qwen3-8B", "maxModelLen": 4096},
                                     "engine": {"resources": {"gpu": 1}}, "replicas": 2})
    assert spec.model.max_model_len == 4096
    assert spec.engine.port == 8000 and spec.engine.startup_timeout_seconds == 600
    assert spec.parallelism.tensor == 1 and spec.gpu_count == 1
    assert spec.features.prefix_caching and spec.features.chunked_prefill
    assert spec.quantization.weights == "none" and spec.quantization.kv_cache == "auto"
    assert spec.lora is None and spec.sleep is None and spec.autoscaling is None
    assert spec.served_name("my-llm") == "my-llm"
    assert LLMServiceSpec.from_body(spec.to_body()) == spec


def test_cpu_specs_have_no_gpus() -> None:
    assert LLMServiceSpec.from_body(BASE).gpu_count == 0
    assert LLMServiceSpec.from_body({**BASE, "engine": {"resources": {"gpu": 0}}}).gpu_count == 0


@pytest.mark.parametrize("spec", [
    BASE,
    {**BASE, "replicas": 0},
    {"model": {"uri": "hf://Qwen/Qwen3-8B@main", "hfTokenSecretRef": {"name": "hf-token"}},
     "engine": {"resources": {"gpu": 2}}, "parallelism": {"tensor": 2}, "auth": {"apiKeySecretRef": {"name": "api-key"}}},
    {"model": {"uri": "pvc://models/qwen3-8b", "servedName": "Qwen/Qwen3-8B"}, "quantization": {"weights": "awq"}},
    {"model": {"uri": "file:///opt/models/llama"}, "quantization": {"kvCache": "fp8"}},
    {**BASE, "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "target": 4}, "sleep": {"afterIdleSeconds": 60}},
    {**BASE, "lora": {"adapters": [{"name": "sql", "uri": "hf://org/sql-lora"},
                                   {"name": "chat", "uri": "pvc://adapters/chat"}]}},
    {**BASE, "podTemplate": {"labels": {"team": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}},
])
def test_valid_specs_have_no_problems(spec: dict[str, Any]) -> None:
    assert problems(spec) == []


def test_bad_uri_scheme() -> None:
    p = only({"model": {"uri": "s3://bucket/model"}})
    assert p.field == "spec.model.uri" and p.reason == "UnsupportedURIScheme"
    assert "s3://" in p.message and "hf://" in p.message and "pvc://" in p.message


@pytest.mark.parametrize("uri,word", [
    ("hf://no-org", "hf://org/name"),
    ("pvc://", "pvc://claim"),
    ("file://relative", "file:///"),
    ("bundled://gpt-5", "bundled://smollm2-135m"),
])
def test_malformed_uris(uri: str, word: str) -> None:
    p = only({"model": {"uri": uri}})
    assert p.field == "spec.model.uri" and word in p.message


def test_unknown_quantization() -> None:
    p = only({**BASE, "quantization": {"weights": "fp4"}})
    assert p.field == "spec.quantization.weights"
    assert "'fp4'" in p.message and "awq" in p.message and "gptq" in p.message


def test_cache_volume_needs_its_claim_and_an_absolute_host_path() -> None:
    p = only({**BASE, "engine": {"cache": {"volume": "persistentVolumeClaim"}}})
    assert (p.field, p.reason) == ("spec.engine.cache.claimName", "MissingClaimName")
    p = only({**BASE, "engine": {"cache": {"volume": "hostPath", "hostPath": "cache"}}})
    assert (p.field, p.reason) == ("spec.engine.cache.hostPath", "InvalidVolume")
    assert only({**BASE, "engine": {"cache": {"volume": "nfs"}}}).field == "spec.engine.cache.volume"
    assert only({**BASE, "engine": {"cache": {"sizeLimit": "lots"}}}).field == "spec.engine.cache.sizeLimit"


def test_unknown_kv_cache_dtype() -> None:
    assert only({**BASE, "quantization": {"kvCache": "int4"}}).field == "spec.quantization.kvCache"


def test_tensor_pipeline_mismatch_with_gpus_asked() -> None:
    p = only({**BASE, "engine": {"resources": {"gpu": 2}}, "parallelism": {"tensor": 2, "pipeline": 2}})
    assert p.reason == "GPUCountMismatch" and p.field == "spec.engine.resources.gpu"
    assert "2 GPU" in p.message and "= 4" in p.message


def test_cpu_engines_may_run_tensor_and_pipeline_ranks() -> None:
    # No GPUs asked: the ranks are gloo processes on the CPU (as vLLM's CPU backend allows).
    assert problems({**BASE, "parallelism": {"tensor": 2, "pipeline": 2}}) == []


def test_more_gpus_than_a_node_offers_is_refused() -> None:
    spec = {**BASE, "engine": {"resources": {"gpu": 16}}, "parallelism": {"tensor": 8, "pipeline": 2}}
    p = only(spec)
    assert p.reason == "TooManyGPUsPerNode" and p.field == "spec.parallelism"
    assert "16 GPUs" in p.message and "(8)" in p.message and "across nodes" in p.message
    assert problems(spec, config=OperatorConfig(max_gpus_per_node=16)) == []


def test_negative_replicas() -> None:
    p = only({**BASE, "replicas": -1})
    assert p.field == "spec.replicas" and ">= 0" in p.message and "-1" in p.message


def test_replicas_and_autoscaling() -> None:
    p = only({**BASE, "replicas": 2, "autoscaling": {"maxReplicas": 4, "target": 2}})
    assert p.reason == "ReplicasAndAutoscaling" and "spec.autoscaling" in p.message
    # hpa/keda own spec.replicas through the scale subresource: allowed.
    assert problems({**BASE, "replicas": 2, "autoscaling": {"maxReplicas": 4, "target": 2, "mode": "keda"}}) == []


def test_min_greater_than_max() -> None:
    p = only({**BASE, "autoscaling": {"minReplicas": 5, "maxReplicas": 2, "target": 2}})
    assert "minReplicas (5)" in p.message and "maxReplicas (2)" in p.message


@pytest.mark.parametrize("spec,field", [
    ({**BASE, "auth": {"apiKeySecretRef": {"name": "missing"}}}, "spec.auth.apiKeySecretRef"),
    ({"model": {"uri": "hf://Qwen/Qwen3-8B", "hfTokenSecretRef": {"name": "missing"}}}, "spec.model.hfTokenSecretRef"),
])
def test_missing_secret(spec: dict[str, Any], field: str) -> None:
    p = only(spec)
    assert p.field == field and p.reason == "SecretNotFound"
    assert "'missing'" in p.message and "team-a" in p.message


def test_secret_lookup_is_optional() -> None:
    spec = {**BASE, "auth": {"apiKeySecretRef": {"name": "missing"}}}
    assert validate_spec(spec, name="m", namespace="n", secret_lookup=None) == []


def test_adapters_duplicates_and_allow_list() -> None:
    spec = {**BASE, "lora": {"adapters": [
        {"name": "a", "uri": "hf://org/a"},
        {"name": "a", "uri": "hf://org/b"},
        {"name": "web", "uri": "https://evil.example/lora"},
        {"name": "local", "uri": "file:///etc/passwd"},
    ]}}
    found = problems(spec)
    reasons = sorted(p.reason for p in found)
    assert reasons == ["AdapterURINotAllowed", "AdapterURINotAllowed", "DuplicateAdapter"], found
    assert any("spec.lora.adapters[1].name" == p.field for p in found)
    # file:// adapters are allowed under configured roots only, and no escaping them.
    config = OperatorConfig(allowed_file_roots=("/adapters",))
    ok = {**BASE, "lora": {"adapters": [{"name": "x", "uri": "file:///adapters/x"}]}}
    assert problems(ok, config=config) == []
    escape = {**BASE, "lora": {"adapters": [{"name": "x", "uri": "file:///adapters/../etc/x"}]}}
    assert only(escape, config=config).reason == "AdapterURINotAllowed"
    # The allow-list is configurable.
    only_hf = OperatorConfig(allowed_adapter_uri_prefixes=("hf://",))
    pvc = {**BASE, "lora": {"adapters": [{"name": "x", "uri": "pvc://claim/x"}]}}
    assert only(pvc, config=only_hf).reason == "AdapterURINotAllowed"


def test_file_adapter_error_says_how_to_allow_a_root() -> None:
    p = only({**BASE, "lora": {"adapters": [{"name": "a", "uri": "file:///srv/a"}]}},
             config=OperatorConfig(allowed_adapter_uri_prefixes=("file://",)))
    assert "--allowed-file-root DIR" in p.message and "TIDAL_ALLOWED_FILE_ROOTS" in p.message
    assert "tidal dev up --allow-file-root DIR" in p.message


def test_served_name_format() -> None:
    p = only({"model": {"uri": "bundled://smollm2-135m", "servedName": "has spaces"}})
    assert p.field == "spec.model.servedName"


def test_llmservice_name_must_be_a_dns_label() -> None:
    assert only(BASE, name="Not_A_Label").field == "metadata.name"
    assert only(BASE, name="x" * 64).field == "metadata.name"


def test_reserved_pod_template_labels() -> None:
    p = only({**BASE, "podTemplate": {"labels": {"tidal.dev/llmservice": "other"}}})
    assert p.reason == "ReservedKey"


def test_pod_template_volumes_and_gpu_resource_name() -> None:
    assert only({**BASE, "podTemplate": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}).reason == "ReservedVolumeName"
    assert only({**BASE, "podTemplate": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}}).reason == "UnknownVolume"
    assert only({**BASE, "engine": {"resources": {"gpuResourceName": "gpu"}}}).reason == "InvalidResourceName"
    assert problems({**BASE, "engine": {"resources": {"gpuResourceName": "amd.com/gpu"}},
                     "podTemplate": {"volumes": [{"name": "x", "emptyDir": {}}],
                                     "volumeMounts": [{"name": "x", "mountPath": "/x"}]}}) == []


def test_sleep_policy_order() -> None:
    assert only({**BASE, "sleep": {"afterIdleSeconds": 300, "deepAfterSeconds": 100}}).field == "spec.sleep.deepAfterSeconds"


def test_bad_quantities() -> None:
    p = only({**BASE, "engine": {"resources": {"memory": "lots"}}})
    assert p.field == "spec.engine.resources.memory" and p.reason == "InvalidQuantity"


def test_kv_offload_needs_a_positive_size_and_one_rank() -> None:
    p = only({**BASE, "engine": {"kvOffload": {"size": "0"}}})
    assert p.field == "spec.engine.kvOffload.size" and p.reason == "InvalidQuantity"
    p = only({**BASE, "engine": {"resources": {"gpu": 2}, "kvOffload": {"size": "8Gi"}}, "parallelism": {"tensor": 2}})
    assert p.field == "spec.engine.kvOffload" and p.reason == "UnsupportedKvOffload"
    assert problems({**BASE, "engine": {"kvOffload": {"size": "8Gi"}}}) == []


def test_unknown_field_is_reported() -> None:
    p = only({"model": {"uri": "bundled://smollm2-135m", "maxmodelLen": 10}})
    assert p.field == "spec.model.maxmodelLen" and p.reason == "UnknownField"


def test_missing_model() -> None:
    assert only({}).field == "spec.model"


def test_parse_errors_and_bad_uri_are_reported_together() -> None:
    found = problems({"model": {"uri": "s3://x"}, "quantization": {"weights": "fp4"}})
    assert {p.field for p in found} == {"spec.model.uri", "spec.quantization.weights"}


def test_messages_never_include_env_values() -> None:
    spec = {**BASE, "engine": {"env": [{"name": "TOKEN", "value": 123456789}]}}
    found = problems(spec)
    assert found and all("123456789" not in str(p) for p in found)


def test_problem_str_names_the_field() -> None:
    p = only({**BASE, "replicas": -3})
    assert str(p) == "spec.replicas: must be >= 0, got -3"


def test_parse_spec_accepts_a_parsed_spec() -> None:
    spec = LLMServiceSpec.from_body(BASE)
    assert parse_spec(spec) == (spec, [])


def test_pooling_models_run_on_one_device() -> None:
    p = only({**BASE, "model": {**BASE["model"], "task": "embed"}, "parallelism": {"tensor": 2}})
    assert p.reason == "UnsupportedParallelism" and p.field == "spec.parallelism"


def test_speculative_ngram_becomes_the_engine_flag() -> None:
    import json

    from tidal_operator.reconcile.manifests import engine_args

    spec = {"model": {"uri": "bundled://smollm2-135m"},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 4}}
    assert problems(spec) == []
    argv = engine_args(spec, "smollm2")
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert "--speculative-config" not in engine_args({"model": {"uri": "bundled://smollm2-135m"}}, "smollm2")


def test_speculative_draft_model_becomes_the_engine_flag() -> None:
    import json

    from tidal_operator.reconcile.manifests import engine_args

    spec = {"model": {"uri": "file:///models/big"},
            "speculative": {"method": "draft_model", "numSpeculativeTokens": 2, "draftModelUri": "bundled://smollm2-135m"}}
    assert problems(spec) == []
    argv = engine_args(spec, "big")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"model": "smollm2-135m",
                                                                         "num_speculative_tokens": 2}


@pytest.mark.parametrize("speculative, message", [
    ({"method": "draft_model"}, "needs a draft model URI"),
    ({"method": "draft_model", "draftModelUri": "s3://bucket/draft"}, "unsupported URI scheme"),
    ({"method": "draft_model", "draftModelUri": "bundled://nope"}, "not a bundled model"),
    ({"method": "draft_model", "draftModelUri": "hf://org/draft"}, "bundled://<name> or file:///path"),
    ({"method": "ngram", "draftModelUri": "bundled://smollm2-135m"}, "only used with method draft_model"),
])
def test_speculative_bad_draft_models_are_problems(speculative: dict, message: str) -> None:
    p = only({"model": {"uri": "bundled://smollm2-135m"}, "speculative": speculative})
    assert p.field == "spec.speculative.draftModelUri" and message in p.message


def test_speculative_bad_values_are_problems() -> None:
    p = only({"model": {"uri": "bundled://smollm2-135m"},
              "speculative": {"promptLookupMin": 5, "promptLookupMax": 2}})
    assert p.field == "spec.speculative.promptLookupMax" and p.reason == "InvalidSpeculative"
    assert problems({"model": {"uri": "bundled://smollm2-135m"}, "speculative": {"method": "draft"}})
    assert problems({"model": {"uri": "bundled://smollm2-135m"}, "speculative": {"numSpeculativeTokens": 0}})
