"""The CPU examples run as their header comments say, on one `tidal dev` stack with real
engines (SmolLM2-135M), the real kubectl and the router:

- examples/lora-cpu.yaml, with its adapter written by examples/make_lora_adapter.py into a
  folder the stack allows (`tidal dev up --allow-file-root DIR`): the adapter answers through
  the router, and the base model too;
- examples/two-chat-models.yaml: each model answers under its own name, from its own engine;
- examples/sleep-scale-to-zero.yaml, with its idle windows shortened to seconds (the rest
  as written): it sleeps, goes to zero, and a request through the router brings it back.

Beside them, two LLMServices for features the examples don't show, on the same stack:
`speculative: {method: ngram}` answers with the same greedy text as the plain model, and
`quantization.weights: fp8` (the torch reference path on CPU) answers.

All are applied at once, so their engines start together and the idle one walks to
zero while the others are checked. Waits are on what the API and the router report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from lora_support import answer, ask  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
QUESTION = "What is the capital of France?"
READY_BOUND_S = 300  # six real engines starting together on 2 shared CPU cores
IDLE_BOUND_S = 120  # Ready → asleep → removed, with the shortened windows
EXAMPLE_ADAPTER_URI = "file:///tmp/tidal-adapters/demo"
# The sleep example's windows (60 s idle, 180 s to removal), shortened for the test.
SHORT_WINDOWS = {"sleep": {"afterIdleSeconds": 2, "removeAfterSeconds": 5},
                 "autoscaling": {"scaleDownDelaySeconds": 2}}


@pytest.fixture(scope="module", autouse=True)
def stack_environment() -> Iterator[None]:
    """One autoscaler tick a second, and one torch thread per engine (four engines share the
    machine's cores). Autouse, so it is set before the stack starts: `tidal dev up` passes its
    environment to the operator and the kubelet, and the kubelet to the engines."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_AUTOSCALE_INTERVAL_SECONDS", "1")
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tidal-adapters")


@pytest.fixture(scope="module")
def dev_up_args(adapter_root: Path) -> tuple[str, ...]:
    return ("--allow-file-root", str(adapter_root))


def lora_example(adapter_root: Path) -> str:
    """examples/lora-cpu.yaml with its adapter, made as its comment says, in the allowed folder."""
    made = subprocess.run([sys.executable, str(EXAMPLES / "make_lora_adapter.py"), str(adapter_root / "demo")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    text = (EXAMPLES / "lora-cpu.yaml").read_text()
    assert text.count(EXAMPLE_ADAPTER_URI) == 1
    return text.replace(EXAMPLE_ADAPTER_URI, f"file://{adapter_root / 'demo'}")


def sleep_example() -> str:
    doc = yaml.safe_load((EXAMPLES / "sleep-scale-to-zero.yaml").read_text())
    for section, fields in SHORT_WINDOWS.items():
        assert set(fields) <= set(doc["spec"][section]), (section, doc["spec"][section])
        doc["spec"][section].update(fields)
    return yaml.safe_dump(doc)


def feature_llmservice(name: str, **spec: Any) -> str:
    """A small SmolLM2 service with one feature switched on (the two-chat example's settings)."""
    body = {"model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512},
            "engine": {"resources": {"cpu": "1", "memory": "1Gi"}, "kvCacheMemory": "64Mi",
                       "startupTimeoutSeconds": 300},
            "replicas": 1, **spec}
    return yaml.safe_dump({"apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService",
                           "metadata": {"name": name}, "spec": body})


@pytest.fixture(scope="module")
def stack(real_stack: Any, adapter_root: Path) -> Any:
    manifests = [lora_example(adapter_root), (EXAMPLES / "two-chat-models.yaml").read_text(), sleep_example(),
                 feature_llmservice("smollm2-ngram", speculative={"method": "ngram", "numSpeculativeTokens": 4}),
                 feature_llmservice("smollm2-fp8", quantization={"weights": "fp8"})]
    real_stack.kubectl("apply", "-f", "-", input="\n---\n".join(manifests))
    return real_stack


def router_ask(stack: Any, model: str, timeout: float = 120) -> tuple[int, Any]:
    return ask(stack.router_url, model, QUESTION, stack.api_key, max_tokens=16, timeout=timeout)


def test_the_lora_example_answers_for_its_adapter_through_the_router(stack: Any, adapter_root: Path) -> None:
    stack.wait_ready("smollm2-lora", READY_BOUND_S)
    (pod,) = stack.pods("smollm2-lora")
    args = pod["spec"]["containers"][0]["args"]
    assert str(adapter_root) in args[args.index("--allowed-lora-roots") + 1:]  # what --allow-file-root allowed

    def loaded() -> bool:
        entries = {e["name"]: e for e in (stack.llm("smollm2-lora").get("status") or {}).get("adapters") or []}
        return [r["state"] for r in (entries.get("demo") or {}).get("replicas") or []] == ["Loaded"]
    stack.wait_for(loaded, 60, "the demo adapter Loaded in status.adapters")

    status, body = router_ask(stack, "demo")
    assert status == 200, body
    assert body["model"] == "demo" and answer(body).strip()
    status, body = router_ask(stack, "smollm2-lora")
    assert status == 200 and "Paris" in answer(body), body


def test_two_chat_models_each_answer_under_their_own_name(stack: Any) -> None:
    for name in ("smollm2-chat", "smollm2-fast"):
        stack.wait_ready(name, READY_BOUND_S)
    assert stack.llm("smollm2-fast")["status"]["servedModelName"] == "fast"
    answers = {}
    for model in ("smollm2-chat", "fast"):
        status, body = router_ask(stack, model)
        assert status == 200, (model, body)
        assert body["model"] == model  # the engine serving that name answered
        answers[model] = answer(body)
    assert "Paris" in answers["smollm2-chat"]
    assert answers["fast"] == answers["smollm2-chat"]  # the same weights, greedy
    status, body = router_ask(stack, "smollm2-fast")  # the LLMService's name is not its served name
    assert status == 404, body


def test_the_sleep_example_sleeps_goes_to_zero_and_a_request_brings_it_back(stack: Any) -> None:
    name = "smollm2-idle"

    def reasons() -> set[str]:
        return {e["reason"] for e in stack.events(name)}
    stack.wait_for(lambda: {"ReplicaSleeping", "RemovingIdleReplica"} <= reasons() and not stack.pods(name),
                   READY_BOUND_S + IDLE_BOUND_S, f"{name} asleep, then removed: 0 Pods")
    assert stack.llm(name)["status"]["desiredReplicas"] == 0

    status, body = router_ask(stack, name, timeout=READY_BOUND_S)  # held by the router while a replica starts
    assert status == 200 and "Paris" in answer(body), body
    assert len(stack.pods(name)) == 1


def test_ngram_speculation_answers_with_the_plain_models_greedy_text(stack: Any) -> None:
    for name in ("smollm2-ngram", "smollm2-chat"):
        stack.wait_ready(name, READY_BOUND_S)
    (pod,) = stack.pods("smollm2-ngram")
    args = pod["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "ngram"
    answers = {}
    for model in ("smollm2-ngram", "smollm2-chat"):
        status, body = router_ask(stack, model)
        assert status == 200 and body["model"] == model, (model, body)
        answers[model] = answer(body)
    assert answers["smollm2-ngram"] == answers["smollm2-chat"] and "Paris" in answers["smollm2-chat"]


def test_fp8_weights_answer_on_cpu(stack: Any) -> None:
    stack.wait_ready("smollm2-fp8", READY_BOUND_S)
    (pod,) = stack.pods("smollm2-fp8")
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--quantization") + 1] == "fp8"
    status, body = router_ask(stack, "smollm2-fp8")
    assert status == 200 and "Paris" in answer(body), body
