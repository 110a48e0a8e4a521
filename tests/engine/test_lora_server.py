"""Multi-LoRA through the real server: runtime load/unload over HTTP, requests by adapter name,
/v1/models, errors, path confinement, pending unloads, metrics and the prefix cache.

The engine is the tiny random Llama with SmolLM2's tokenizer (test_server_support); the
adapters are real PEFT adapters for it (test_lora_support).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_support import make_peft_adapter, random_lora_tensors, write_adapter  # noqa: E402
from test_server_support import API_KEY, LiveServer, make_engine, tiny_model_dir, wait_until  # noqa: E402

from tidal_engine.server.metrics import metric_value  # noqa: E402

HIDDEN, INTER, KV_OUT = 64, 128, 32  # the tiny Llama's sizes (4 heads of 16, 2 KV heads)
PROMPT = [1, 504, 3216, 314, 260, 2003, 30, 2]


@functools.cache
def adapter_root() -> Path:
    """Adapters for the tiny model, built once: 'good' (rank 8), 'other' (rank 4), and bad ones."""
    from transformers import AutoModelForCausalLM

    root = Path(tempfile.mkdtemp(prefix="tidal-lora-root-"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    make_peft_adapter(hf, root / "good", rank=8, alpha=16, seed=3, std=0.3)
    make_peft_adapter(hf, root / "other", rank=4, alpha=8, seed=4, std=0.3, targets=["q_proj", "v_proj", "o_proj"])
    write_adapter(root / "rank32", random_lora_tensors({"self_attn.q_proj": (HIDDEN, HIDDEN)}, rank=32), rank=32)
    write_adapter(root / "bad-target", random_lora_tensors({"self_attn.q_proj": (HIDDEN, HIDDEN)}, rank=4),
                  rank=4, targets=["q_proj", "c_attn"])
    write_adapter(root / "bad-shape", random_lora_tensors({"self_attn.q_proj": (HIDDEN + 1, HIDDEN)}, rank=4), rank=4)
    (root / "no-config").mkdir()
    outside = Path(tempfile.mkdtemp(prefix="tidal-lora-outside-"))
    make_peft_adapter(hf, outside / "secret", rank=4, alpha=8, seed=5)
    os.symlink(outside / "secret", root / "escape-link")
    return root


def outside_dir() -> Path:
    return Path(os.readlink(adapter_root() / "escape-link"))


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    root = adapter_root()
    engine = make_engine(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                         allowed_lora_roots=[str(root)], max_num_seqs=8)
    with LiveServer(engine, served_model_names=["tiny"], api_key=API_KEY) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def load(client: httpx.Client, name: str, path: str | Path) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def complete(client: httpx.Client, model: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return client.post("/v1/completions", json=body)


def tokens_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_load_use_unload_over_http(client: httpx.Client) -> None:
    base = tokens_of(complete(client, "tiny"))
    response = load(client, "good", adapter_root() / "good")
    assert response.status_code == 200 and "added successfully" in response.text
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["good"]["parent"] == "tiny" and models["good"]["object"] == "model"
    assert models["good"]["root"] == str(adapter_root() / "good")
    with_adapter = complete(client, "good")
    assert with_adapter.json()["model"] == "good"
    assert tokens_of(with_adapter) != base  # the adapter changes the output
    chat = client.post("/v1/chat/completions", json={"model": "good", "max_tokens": 4, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "good"

    # Base and adapter requests in flight together: each equals its solo answer.
    results: dict[str, str] = {}

    def run(model: str, key: str) -> None:
        with httpx.Client(base_url=str(client.base_url), headers=dict(client.headers), timeout=60) as c:
            results[key] = tokens_of(complete(c, model))

    threads = [threading.Thread(target=run, args=(m, f"{m}-{i}")) for i in range(2) for m in ("tiny", "good")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["tiny-0"] == results["tiny-1"] == base
    assert results["good-0"] == results["good-1"] == tokens_of(with_adapter)

    response = unload(client, "good")
    assert response.status_code == 200 and "removed successfully" in response.text
    gone = complete(client, "good")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert "good" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert tokens_of(complete(client, "tiny")) == base


@pytest.mark.parametrize(
    "name, path, status, message",
    [
        ("x", "{root}/missing", 400, "does not exist"),
        ("x", "{root}/rank32", 400, "rank 32 exceeds the maximum LoRA rank 8"),
        ("x", "{root}/bad-target", 400, "target module(s) c_attn do not exist"),
        ("x", "{root}/bad-shape", 400, "maps 65 → 64 features"),
        ("x", "{root}/no-config", 400, "has no adapter_config.json"),
        ("x", "{outside}/secret", 400, "outside the allowed roots"),
        ("x", "{root}/escape-link", 400, "outside the allowed roots"),
        ("x", "{root}/../{outside_name}/secret", 400, "must not contain '..'"),
        ("x", "/etc", 400, "outside the allowed roots"),
        ("tiny", "{root}/good", 400, "base model's name"),
    ],
    ids=["missing", "rank", "target", "shape", "no-config", "outside", "symlink", "dotdot", "etc", "base-name"],
)
def test_load_errors(client: httpx.Client, name: str, path: str, status: int, message: str) -> None:
    root, outside = adapter_root(), outside_dir()
    path = path.format(root=root, outside=outside, outside_name=outside.name)
    response = load(client, name, path)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert "x" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_duplicate_unknown_and_malformed(client: httpx.Client) -> None:
    assert load(client, "dup", adapter_root() / "other").status_code == 200
    again = load(client, "dup", adapter_root() / "good")
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert unload(client, "dup").status_code == 200
    missing = unload(client, "dup")
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "y"}).status_code == 400
    assert client.post("/v1/load_lora_adapter", json={"lora_name": 3, "lora_path": "/x"}).status_code == 400


def test_admin_routes_need_the_key(server: LiveServer) -> None:
    with server.client() as anonymous:
        assert load(anonymous, "k", adapter_root() / "good").status_code == 401
        assert unload(anonymous, "k").status_code == 401


def test_unload_waits_for_running_requests(client: httpx.Client) -> None:
    assert load(client, "busy", adapter_root() / "other").status_code == 200
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}
    lines: list[str] = []
    with client.stream("POST", "/v1/completions", json=body) as stream:
        iterator = stream.iter_lines()
        for line in iterator:  # wait until it is generating
            if line.startswith("data: "):
                lines.append(line)
                break
        response = unload(client, "busy")
        assert response.status_code == 200 and "once its running requests finish" in response.text
        refused = complete(client, "busy")
        assert refused.status_code == 404  # new requests are refused at once
        assert "busy" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
        lines += [line for line in iterator if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2].replace(" ", "")  # it finished normally
    assert unload(client, "busy").status_code == 404  # and is gone now


def test_prefix_cache_is_per_adapter(client: httpx.Client) -> None:
    assert load(client, "pa", adapter_root() / "good").status_code == 200
    assert load(client, "pb", adapter_root() / "other").status_code == 200
    prompt = list(range(1000, 1100))  # several full blocks

    def cached(model: str) -> int:
        response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("pa") == 0
    assert cached("pb") == 0  # same prompt, other adapter: no reuse
    assert cached("tiny") == 0  # nor for the base model
    assert cached("pa") > 0  # the same adapter does hit
    for name in ("pa", "pb"):
        assert unload(client, name).status_code == 200


def test_lora_requests_info_metric(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    assert "tidal:lora_requests_info" in text
    assert metric_value(text, "tidal:lora_requests_info", max_lora="2", running_lora_adapters="",
                        waiting_lora_adapters="") is not None


def test_runtime_loading_needs_allowed_roots_and_lora() -> None:
    without_roots = make_engine(enable_lora=True, lora_modules={"boot": str(adapter_root() / "good")})
    with LiveServer(without_roots, served_model_names=["tiny"]) as live, live.client() as c:
        assert "boot" in {m["id"] for m in c.get("/v1/models").json()["data"]}  # start-up modules load
        assert tokens_of(complete(c, "boot", max_tokens=2))
        response = load(c, "late", adapter_root() / "good")
        assert response.status_code == 400 and "--allowed-lora-roots" in response.json()["error"]["message"]
    with LiveServer(make_engine(), served_model_names=["tiny"]) as live, live.client() as c:
        response = load(c, "late", adapter_root() / "good")
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
        assert complete(c, "late").status_code == 404


def test_max_loras_limits_the_batch_not_the_answers() -> None:
    """One device slot, two adapters in flight: the scheduler runs them in turn; every answer
    equals the adapter's answer alone, and the base request runs alongside either."""
    root = adapter_root()
    engine = make_engine(enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                         lora_modules={"a": str(root / "good"), "b": str(root / "other")})
    with LiveServer(engine, served_model_names=["tiny"]) as live, live.client() as c:
        solo = {m: tokens_of(complete(c, m, max_tokens=12)) for m in ("a", "b", "tiny")}
        assert len(set(solo.values())) == 3
        results: dict[str, str] = {}

        def run(model: str, key: str) -> None:
            with live.client() as own:
                results[key] = tokens_of(complete(own, model, max_tokens=12))

        jobs = [("a", "a0"), ("b", "b0"), ("tiny", "t0"), ("a", "a1"), ("b", "b1")]
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {key: solo[model] for model, key in jobs}
        manager = live.raw_engine().lora_manager
        assert manager.refs("a") == manager.refs("b") == 0
        assert len(manager.host_cached()) == 1  # the host cache holds one when nothing pins more


def test_adapters_survive_deep_sleep(client: httpx.Client) -> None:
    assert load(client, "sleepy", adapter_root() / "good").status_code == 200
    before = tokens_of(complete(client, "sleepy"))
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up").status_code == 200
    assert wait_until(lambda: not client.get("/is_sleeping").json()["is_sleeping"])
    assert tokens_of(complete(client, "sleepy")) == before
    assert unload(client, "sleepy").status_code == 200


def test_smollm2_runtime_load_mixed_batch_and_unload(tmp_path: Path) -> None:
    """The acceptance case on the real SmolLM2-135M: a random adapter loaded at run time
    changes the answer, base requests in the same batch are unaffected, unload → 404."""
    from tidal_engine import LLM, SamplingParams
    from tidal_engine.lora import LoRAError

    root = tmp_path / "adapters"
    dims = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192), "mlp.down_proj": (1536, 576)}
    write_adapter(root / "rand", random_lora_tensors(dims, rank=8, layers=30, seed=7), rank=8, alpha=32,
                  targets=["q_proj", "v_proj", "down_proj"])
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20,
              enable_lora=True, max_loras=1, max_lora_rank=8, allowed_lora_roots=[str(root)])
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = "The capital of France is"
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    engine.add_lora(engine.read_lora("rand", str(root / "rand")))
    # One batch: base, adapter, base (engine.add_request directly, so they run together).
    for i, lora in enumerate([None, "rand", None]):
        engine.add_request(f"m{i}", prompt, params, lora_name=lora)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished["m0"] == finished["m2"] == alone
    assert finished["m1"] != alone
    assert engine.remove_lora("rand") is True
    with pytest.raises(LoRAError) as missing:
        engine.add_request("gone", prompt, params, lora_name="rand")
    assert missing.value.status == 404
