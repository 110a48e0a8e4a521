"""dev/schema.py: what the emulated API server does with the LLMService CRD's schema on a write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tidal_operator.dev.schema import admit

CRD = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "tidal.dev_llmservices.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def llm(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "bundled://smollm2-135m"}, **spec}}


def test_defaults_are_filled_and_unknown_fields_pruned() -> None:
    stored, errors = admit(SCHEMA, llm(replicas=1, madeUp={"x": 1}))
    assert errors == []
    assert "madeUp" not in stored["spec"]
    assert stored["spec"]["engine"]["port"] == 8000 and stored["spec"]["rollout"]["progressDeadlineSeconds"] == 600
    assert stored["metadata"] == {"name": "m"}  # metadata is the server's business, not the schema's


def test_schema_and_cel_errors_name_the_field() -> None:
    _, errors = admit(SCHEMA, llm(replicas=-1))
    assert [str(e) for e in errors] == ["spec.replicas: Invalid value: -1: should be greater than or equal to 0"]
    _, errors = admit(SCHEMA, llm(replicas=2, autoscaling={"maxReplicas": 3, "target": 1}))
    assert any("mutually exclusive" in e.message for e in errors)
    _, errors = admit(SCHEMA, llm(quantization={"weights": "int3"}))
    assert errors and errors[0].path == "spec.quantization.weights"
    _, errors = admit(SCHEMA, {**llm(), "spec": {}})
    assert [e.path for e in errors] == ["spec.model"]
