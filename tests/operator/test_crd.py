"""The LLMService CRD: a valid, structural apiextensions/v1 object; the examples validate
against its schema; its defaults equal the pydantic models'; its CEL rules hold on good
specs, fail on bad ones, and are mirrored by api/validation.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tidal_operator.api import LLMServiceSpec, validate_spec
from tidal_operator.api.types import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "tidal.dev_llmservices.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.33"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def root_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def llmservice_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLES:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc and doc.get("kind") == "LLMService":
                yaml_id = f"{path.name}#{i}"
                yield yaml_id, doc


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: fill absent properties that have a
    default (the default itself then defaulted), recursively; items of arrays too."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(sub, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], x) for x in obj]
    return obj


def strip_extensions(schema: Any) -> Any:
    """jsonschema doesn't know x-kubernetes-*; int-or-string is expressed by anyOf already."""
    if isinstance(schema, dict):
        return {k: strip_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [strip_extensions(x) for x in schema]
    return schema


def schema_validator() -> jsonschema.Draft4Validator:
    # Draft 4: OpenAPI v3.0's boolean exclusiveMinimum.
    return jsonschema.Draft4Validator(strip_extensions(root_schema()))


# --- the CRD object itself -------------------------------------------------------------

def test_crd_is_valid_apiextensions_v1() -> None:
    crd = load_crd()
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    assert crd["metadata"]["name"] == "llmservices.tidal.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        "LLMService", "llmservices", ["llm"], ["tidal"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Ready", "Phase", "Endpoint", "Age"} <= set(columns)


def _walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    for path, node in _walk(root_schema(), "$"):
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        assert "type" in node or int_or_string, f"{path} has no type"
        if int_or_string:
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "anyOf" not in node and "oneOf" not in node, f"{path}: only int-or-string may use anyOf"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type") == "object", path
        if node.get("type") == "array":
            assert "items" in node, f"{path}: arrays need items"
        if "default" in node:
            # A default must validate against its own schema (the API server checks this).
            jsonschema.Draft4Validator(strip_extensions(node)).validate(apply_defaults(node, node["default"]))
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), f"{path}: map keys must be required"


def test_there_are_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.yaml", "gpu-qwen3-8b.yaml"} <= names


@pytest.mark.parametrize("doc_id,doc", list(llmservice_docs()))
def test_examples_validate_against_the_schema(doc_id: str, doc: dict[str, Any]) -> None:
    validator = schema_validator()
    validator.validate(doc)
    validator.validate(apply_defaults(root_schema(), doc))  # and once defaulted
    assert doc["apiVersion"] == "tidal.dev/v1alpha1"
    # The operator's configuration each example's header comment says to start it with.
    config = OperatorConfig(allowed_file_roots=("/tmp/tidal-adapters",))
    assert validate_spec(doc["spec"], name=doc["metadata"]["name"], namespace="default",
                         secret_lookup=lambda _: True, config=config) == []


def test_the_cpu_examples_are_there() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"sleep-scale-to-zero.yaml", "lora-cpu.yaml", "two-chat-models.yaml", "embeddings-minilm.yaml"} <= names
    lora = yaml.safe_load((ROOT / "examples" / "lora-cpu.yaml").read_text())
    assert "--allow-file-root /tmp/tidal-adapters" in (ROOT / "examples" / "lora-cpu.yaml").read_text()
    assert lora["spec"]["lora"]["adapters"][0]["uri"].startswith("file:///tmp/tidal-adapters/")


def test_every_example_file_is_only_known_kinds() -> None:
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["kind"] == "LLMService" or kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_rejects_what_it_should() -> None:
    validator = schema_validator()
    good = {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "bundled://smollm2-135m"}}}
    validator.validate(good)
    bad_specs = [
        {"model": {"uri": "bundled://smollm2-135m"}, "replicas": -1},
        {"model": {"uri": "bundled://smollm2-135m"}, "quantization": {"weights": "fp4"}},
        {"model": {"uri": "bundled://smollm2-135m", "dtype": "int8"}},
        {"model": {"uri": "bundled://smollm2-135m"}, "parallelism": {"tensor": 0}},
        {"model": {"uri": "bundled://smollm2-135m"}, "engine": {"resources": {"memory": "lots"}}},
        {"model": {"uri": "bundled://smollm2-135m"}, "autoscaling": {"maxReplicas": 2}},  # no target
        {"model": {"uri": "bundled://smollm2-135m"}, "sleep": {"level": 3}},
        {"model": {"uri": "bundled://smollm2-135m"}, "rollout": {"maxSurge": -1}},
        {"model": {"uri": "bundled://smollm2-135m"}, "engine": {"kvOffload": {}}},  # no size
        {"model": {"uri": "bundled://smollm2-135m"}, "engine": {"kvOffload": {"size": "much"}}},
        {"model": {}},
    ]
    for spec in bad_specs:
        assert not validator.is_valid({**good, "spec": spec}), spec


# --- defaults: the CRD's equal the pydantic models' -------------------------------------

FULL_MINIMAL = {
    "model": {"uri": "hf://Qwen/Qwen3-8B", "hfTokenSecretRef": {"name": "hf"}},
    "engine": {"resources": {"gpu": 1}, "env": [{"name": "A", "value": "b"}]},
    "lora": {"adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}]},
    "autoscaling": {"maxReplicas": 3, "target": 2},
    "sleep": {},
    "auth": {"apiKeySecretRef": {"name": "key"}},
    "podTemplate": {"tolerations": [{"key": "k", "operator": "Exists"}]},
}


@pytest.mark.parametrize("spec", [{"model": {"uri": "bundled://smollm2-135m"}}, FULL_MINIMAL]
                         + [doc["spec"] for _, doc in llmservice_docs()])
def test_crd_defaults_equal_pydantic_defaults(spec: dict[str, Any]) -> None:
    spec_schema = root_schema()["properties"]["spec"]
    defaulted_by_crd = apply_defaults(spec_schema, spec)
    defaulted_by_pydantic = LLMServiceSpec.from_body(spec).to_body()
    assert defaulted_by_pydantic == defaulted_by_crd
    # Defaulting is idempotent through pydantic too.
    assert LLMServiceSpec.from_body(defaulted_by_crd).to_body() == defaulted_by_crd


# --- CEL rules ------------------------------------------------------------------------

try:
    import celpy  # cel-python: evaluates the CRD's CEL rules without an API server
except ImportError:  # pragma: no cover
    celpy = None
needs_cel = pytest.mark.skipif(celpy is None, reason="cel-python is not installed")


def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """Kubernetes hands CEL `type: number` fields as doubles, whatever the JSON looked like."""
    if schema.get("type") == "number" and isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict) and "properties" in schema:
        return {k: _cel_value(schema["properties"].get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_cel_value(schema["items"], v) for v in value]
    return value


def cel_failures(body: dict[str, Any]) -> list[str]:
    """Evaluate every x-kubernetes-validations rule against the defaulted body (rules on
    absent nodes don't run, as in Kubernetes); return the failing rules' messages."""
    env = celpy.Environment()
    schema = root_schema()
    body = apply_defaults(schema, body)
    failures: list[str] = []

    def visit(node: dict[str, Any], value: Any) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(_cel_value(node, value))})
            if result is not True and result != celpy.celtypes.BoolType(True):
                failures.append(rule["message"])
        if isinstance(value, dict):
            for key, sub in (node.get("properties") or {}).items():
                if key in value and key != "metadata":
                    visit(sub, value[key])
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                visit(node["items"], item)

    visit(schema, body)
    return failures


def _body(spec: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name}, "spec": spec}


@needs_cel
@pytest.mark.parametrize("doc_id,doc", list(llmservice_docs()))
def test_cel_rules_pass_on_examples(doc_id: str, doc: dict[str, Any]) -> None:
    assert cel_failures(doc) == []


BASE = {"model": {"uri": "bundled://smollm2-135m"}}

# (spec, name, a word of the CEL message). Each must also be caught by validate_spec.
CEL_BAD_CASES = [
    ({**BASE, "replicas": 2, "autoscaling": {"maxReplicas": 3, "target": 1}}, "m", "mutually exclusive"),
    ({**BASE, "autoscaling": {"minReplicas": 4, "maxReplicas": 3, "target": 1}}, "m", "minReplicas"),
    ({**BASE, "autoscaling": {"maxReplicas": 3, "target": 5, "metric": "kvCacheUsage"}}, "m", "fraction"),
    ({**BASE, "engine": {"resources": {"gpu": 2}}}, "m", "tensor x"),
    ({**BASE, "engine": {"resources": {"gpu": 2}}, "parallelism": {"tensor": 4}}, "m", "tensor x"),
    ({"model": {"uri": "s3://bucket/model"}}, "m", "scheme"),
    ({"model": {"uri": "hf://just-a-name"}}, "m", "hf://org/name"),
    ({"model": {"uri": "pvc://Bad_Claim/x"}}, "m", "pvc://claim"),
    ({"model": {"uri": "file://relative/path"}}, "m", "file:///"),
    ({"model": {"uri": "bundled://llama-70b"}}, "m", "bundled"),
    ({**BASE, "sleep": {"afterIdleSeconds": 600, "deepAfterSeconds": 300}}, "m", "deepAfterSeconds"),
    ({**BASE, "sleep": {"level": 2, "deepAfterSeconds": 900}}, "m", "deepAfterSeconds"),
    ({**BASE, "sleep": {"afterIdleSeconds": 600, "removeAfterSeconds": 60}}, "m", "removeAfterSeconds"),
    (BASE, "Bad_Name", "DNS-1035"),
    ({**BASE, "rollout": {"maxSurge": 0}}, "m", "maxUnavailable"),
]

CEL_GOOD_CASES = [
    ({**BASE, "replicas": 0}, "m"),
    ({**BASE, "autoscaling": {"minReplicas": 3, "maxReplicas": 3, "target": 0.5, "metric": "kvCacheUsage"}}, "m"),
    ({**BASE, "replicas": 2, "autoscaling": {"maxReplicas": 3, "target": 1, "mode": "hpa"}}, "m"),
    ({"model": {"uri": "hf://Qwen/Qwen3-8B@v1.0"}, "engine": {"resources": {"gpu": 4}},
      "parallelism": {"tensor": 2, "pipeline": 2}}, "m"),
    ({"model": {"uri": "pvc://models/qwen3"}, "engine": {"resources": {"gpu": 0}}}, "m"),
    ({"model": {"uri": "file:///opt/models/qwen"}}, "m"),
    ({**BASE, "sleep": {"afterIdleSeconds": 60, "deepAfterSeconds": 120, "removeAfterSeconds": 180}}, "m"),
    ({**BASE, "rollout": {"maxSurge": 0, "maxUnavailable": 1, "progressDeadlineSeconds": 60}}, "m"),
]


@needs_cel
@pytest.mark.parametrize("spec,name,word", CEL_BAD_CASES)
def test_cel_rules_reject_and_validation_mirrors_them(spec: dict[str, Any], name: str, word: str) -> None:
    failures = cel_failures(_body(spec, name))
    assert any(word in f for f in failures), failures
    assert validate_spec(spec, name=name, namespace="ns"), "validation.py must mirror the CEL rule"


@needs_cel
@pytest.mark.parametrize("spec,name", CEL_GOOD_CASES)
def test_cel_rules_accept_and_validation_agrees(spec: dict[str, Any], name: str) -> None:
    assert cel_failures(_body(spec, name)) == []
    assert validate_spec(spec, name=name, namespace="ns") == []
