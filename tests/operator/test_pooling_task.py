"""spec.model.task: the CRD field and column, the engine flags it sets, its validation, and
the router's pooling paths (routed by model like chat)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tidal_operator.api.validation import validate_spec
from tidal_operator.reconcile.manifests import engine_args
from tidal_operator.router import Registry

from router_upstreams import FakeEngine, llmservice, pod, run_router_for_test, serve_engines

ROOT = Path(__file__).resolve().parents[2]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_crd_declares_task_with_a_wide_column() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "tidal.dev_llmservices.yaml").read_text())
    version = crd["spec"]["versions"][0]
    task = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]["properties"]["task"]
    assert task["enum"] == ["generate", "embed", "score"] and task["default"] == "generate"
    column = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Task")
    assert column["jsonPath"] == ".spec.model.task" and column["priority"] == 1  # shown by -o wide


def test_task_sets_the_pooling_runner() -> None:
    def argv(task: str | None) -> list[str]:
        model: dict[str, Any] = {"uri": "bundled://all-minilm-l6-v2"}
        if task:
            model["task"] = task
        return engine_args({"model": model}, "emb")

    assert "--runner" not in argv(None) and "--runner" not in argv("generate")
    assert (_flag(argv("embed"), "--runner"), _flag(argv("embed"), "--convert")) == ("pooling", "embed")
    assert (_flag(argv("score"), "--runner"), _flag(argv("score"), "--convert")) == ("pooling", "classify")


def test_task_validation() -> None:
    ok = validate_spec({"model": {"uri": "bundled://all-minilm-l6-v2", "task": "embed"}}, name="emb", namespace="default")
    assert ok == []
    bad_task = validate_spec({"model": {"uri": "bundled://all-minilm-l6-v2", "task": "translate"}}, name="emb", namespace="default")
    assert any("task" in p.field for p in bad_task)
    lora = validate_spec({"model": {"uri": "hf://org/m", "task": "embed"},
                          "lora": {"adapters": [{"name": "a", "uri": "hf://org/a"}]}}, name="emb", namespace="default")
    assert any(p.reason == "LoRAOnPoolingModel" for p in lora)


async def test_router_routes_pooling_paths_by_model() -> None:
    async with serve_engines(FakeEngine("chat-0"), FakeEngine("emb-0")) as (chat, emb):
        registry = Registry()
        for obj in (llmservice("chat"), llmservice("emb"), pod("chat-0", "chat", chat.port),
                    pod("emb-0", "emb", emb.port)):
            if obj["kind"] == "Pod":
                registry.apply_pod_event({"type": "ADDED", "object": obj})
            else:
                registry.apply_llmservice_event({"type": "ADDED", "object": obj})
        async with run_router_for_test(registry) as router:
            for path in ("/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/rerank", "/v2/rerank"):
                answer = await router.client.post(path, json={"model": "emb", "input": "x"})
                assert answer.status_code == 200 and answer.json()["replica"] == "emb-0", path
            answer = await router.client.post("/v1/chat/completions", json={"model": "chat", "messages": []})
            assert answer.json()["replica"] == "chat-0"
            unknown = await router.client.post("/rerank", json={"model": "nope", "query": "q", "documents": []})
            assert unknown.status_code == 404
