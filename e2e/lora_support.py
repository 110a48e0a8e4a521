"""Helpers for the multi-LoRA end-to-end test (no tests here).

- PEFT adapter folders for SmolLM2-135M, written by hand (``adapter_config.json`` +
  ``adapter_model.safetensors``, PEFT's names), from seeded random numbers: cheap, no model
  load. Same shapes as the engine's SmolLM2 acceptance test (tests/engine/test_lora_server.py).
- ``ObjectWatch``: ``kubectl get <kind> -w --output-watch-events -o json`` in the background,
  every event in the order the API server sent it (the test reads status snapshots from it).
- ``post_json``: an HTTP POST that returns (status, body) for error statuses too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors.numpy import save_file

from kubectl_watch import KubectlWatch

# SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536, 30 layers.
SMOLLM2_LAYERS = 30
SMOLLM2_MODULES = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192), "mlp.down_proj": (1536, 576)}


def write_peft_adapter(folder: Path, *, rank: int, alpha: float, seed: int,
                       modules: Mapping[str, tuple[int, int]] = SMOLLM2_MODULES,
                       layers: int = SMOLLM2_LAYERS, std: float = 0.1) -> Path:
    """A random LoRA adapter in PEFT's format: ``modules`` maps e.g. "self_attn.q_proj" to
    (in, out). lora_B is random too (PEFT starts it at zero, which changes nothing)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in modules.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * std).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M",
              "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted({m.rpartition(".")[2] for m in modules})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def llmservice(name: str, *, replicas: int, max_adapters: int, max_rank: int,
               adapters: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The quickstart's SmolLM2 on CPU, small, with LoRA on."""
    return {
        "apiVersion": "tidal.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
        "spec": {
            "model": {"uri": "bundled://smollm2-135m", "maxModelLen": 512},
            "engine": {"resources": {"cpu": "1", "memory": "2Gi"}, "kvCacheMemory": "64Mi",
                       "maxNumSeqs": 8, "startupTimeoutSeconds": 300,
                       # one thread per engine: the replicas share the machine's cores
                       "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
            "replicas": replicas,
            "lora": {"maxAdapters": max_adapters, "maxRank": max_rank, "adapters": adapters or []},
        },
    }


def post_json(url: str, body: Mapping[str, Any], key: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    """POST ``body``; (status, parsed JSON or text), error statuses included."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def get_json(url: str, key: str | None = None, timeout: float = 10) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        return json.loads(response.read())


def ask(url: str, model: str, question: str, key: str | None = None, max_tokens: int = 8,
        timeout: float = 60) -> tuple[int, Any]:
    """A greedy chat completion: (status, body)."""
    return post_json(f"{url}/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0}, key, timeout)


def answer(body: Any) -> str:
    return str(body["choices"][0]["message"]["content"])


def error_message(body: Any) -> str:
    """The message of an OpenAI-shaped error body (or the raw body)."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        return str(body["error"].get("message"))
    return str(body)


ObjectWatch = KubectlWatch  # every (monotonic time, event type, object), in order


