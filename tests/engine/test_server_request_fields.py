"""vLLM's request fields over HTTP, one test each, against the tiny in-process server
(docs/engine-api.md has the table of supported and refused fields)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_server_support import LiveServer, live_server  # noqa: E402

MSG = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def events(response: httpx.Response) -> list[Any]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, **GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, **GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(client: httpx.Client, **body: Any) -> list[int]:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSG})])
def test_usage_only_when_include_usage_asks(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    plain = events(client.post(path, json={**body, "max_tokens": 3, "stream": True}))
    assert all("usage" not in chunk for chunk in plain)
    asked = events(client.post(path, json={**body, "max_tokens": 3, "stream": True,
                                           "stream_options": {"include_usage": True}}))
    assert all(chunk["usage"] is None for chunk in asked[:-1])  # OpenAI's shape: null until the last
    assert asked[-1]["usage"]["completion_tokens"] == 3 and asked[-1]["choices"] == []


def test_max_tokens_at_the_context_edge_is_accepted(client: httpx.Client) -> None:
    prompt_tokens = len(tokenize(client, prompt="hello"))
    data = complete(client, max_tokens=256 - prompt_tokens)
    assert data["usage"]["completion_tokens"] == 256 - prompt_tokens
    refused = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 257 - prompt_tokens})
    assert refused.status_code == 400 and "maximum context length is 256" in refused.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: httpx.Client) -> None:
    long = "the tide comes in and the tide goes out"
    ids = tokenize(client, prompt=long)
    truncated = complete(client, prompt=long, truncate_prompt_tokens=3)
    assert truncated["usage"]["prompt_tokens"] == 3
    assert truncated["choices"][0]["text"] == complete(client, prompt=ids[-3:])["choices"][0]["text"]
    assert chat(client, truncate_prompt_tokens=5)["usage"]["prompt_tokens"] == 5


def test_min_tokens_holds_back_stop_tokens(client: httpx.Client) -> None:
    first = complete(client, max_tokens=1, logprobs=0)
    token = first["choices"][0]["logprobs"]["tokens"][0]
    token_id = tokenize(client, prompt=token, add_special_tokens=False)[0]
    stopped = complete(client, stop_token_ids=[token_id], max_tokens=6)
    assert stopped["usage"]["completion_tokens"] <= 1
    held = complete(client, stop_token_ids=[token_id], max_tokens=6, min_tokens=4)
    assert held["usage"]["completion_tokens"] >= 4


def test_include_stop_str_in_output(client: httpx.Client) -> None:
    text = complete(client, max_tokens=8)["choices"][0]["text"]
    stop = text[3:5]
    assert complete(client, max_tokens=8, stop=[stop])["choices"][0]["text"] == text[: text.index(stop)]
    kept = complete(client, max_tokens=8, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == text[: text.index(stop) + len(stop)]


def test_skip_and_space_special_tokens(client: httpx.Client) -> None:
    (special,) = tokenize(client, prompt="<|im_start|>", add_special_tokens=False)
    body = {"allowed_token_ids": [special], "max_tokens": 3}  # an answer of special tokens only
    assert complete(client, **body)["choices"][0]["text"] == ""
    shown = complete(client, skip_special_tokens=False, **body)["choices"][0]["text"]
    assert shown == "<|im_start|>" * 3
    # Accepted; a fast tokenizer puts no spaces between special tokens either way (vLLM's fast detokenizer too).
    assert complete(client, skip_special_tokens=False, spaces_between_special_tokens=False,
                    **body)["choices"][0]["text"] == shown


def test_completion_echo(client: httpx.Client) -> None:
    data = complete(client, echo=True)
    assert data["choices"][0]["text"].startswith("hello")


def test_chat_echo_and_continue_final_message(client: httpx.Client) -> None:
    messages = [*MSG, {"role": "assistant", "content": "Sure, here"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    plain = chat(client, **body)["choices"][0]["message"]["content"]
    echoed = chat(client, **body, echo=True)["choices"][0]["message"]["content"]
    assert echoed == "Sure, here" + plain
    streamed = events(client.post("/v1/chat/completions",
                                  json={**body, "max_tokens": 6, **GREEDY, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == echoed


def test_add_generation_prompt_changes_the_prompt(client: httpx.Client) -> None:
    with_prompt = tokenize(client, messages=MSG, add_generation_prompt=True)
    without = tokenize(client, messages=MSG, add_generation_prompt=False)
    assert len(with_prompt) > len(without) and with_prompt[: len(without)] == without


def test_chat_template_and_its_kwargs(client: httpx.Client) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ mood }}]{% endfor %}"
    ids = tokenize(client, messages=MSG, chat_template=template, chat_template_kwargs={"mood": "calm"})
    assert ids == tokenize(client, prompt="[user|Say something.|calm]", add_special_tokens=False)
    data = chat(client, chat_template=template, chat_template_kwargs={"mood": "calm"})
    assert data["usage"]["prompt_tokens"] == len(ids)


def test_generation_config_defaults_apply_to_fields_left_out() -> None:
    # A generation config with temperature 0: a request without temperature samples greedily.
    with live_server(default_sampling={"temperature": 0.0, "max_tokens": 5}) as live, live.client() as c:
        body = {"prompt": "hello", "ignore_eos": True}
        defaulted = c.post("/v1/completions", json={**body, "max_tokens": None}).json()
        explicit = c.post("/v1/completions", json={**body, "temperature": 0, "max_tokens": 5}).json()
        assert defaulted["choices"][0]["text"] == explicit["choices"][0]["text"]
        assert defaulted["usage"]["completion_tokens"] == 5


def test_generation_config_modes(tmp_path: Path) -> None:
    from tidal_engine.server.generation_config import load_sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}))
    model = str(tmp_path / "model")
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert load_sampling_defaults(str(tmp_path), model) == expected
    assert load_sampling_defaults(str(tmp_path / "generation_config.json"), model) == expected
    assert load_sampling_defaults("vllm", model) == {}  # vLLM's neutral defaults: greedy stays greedy
    with pytest.raises(ValueError, match="cannot read"):
        load_sampling_defaults(str(tmp_path / "missing"), model)


def test_tokenizer_flag_serves_with_that_tokenizer(tmp_path: Path) -> None:
    from tiny_tokenizer import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)  # a byte-level tokenizer: one id per byte
    with live_server(engine={"tokenizer": str(tmp_path)}) as live, live.client() as c:
        assert c.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()["tokens"] == \
            list(b"hello")
        data = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0}).json()
        assert data["usage"]["prompt_tokens"] == 5


def test_metrics_prefix_vllm_renames_every_vllm_family(client: httpx.Client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def families(text: str) -> set[str]:
        return {family.name for family in text_string_to_metric_families(text)}

    complete(client)
    tidal = families(client.get("/metrics").text)
    with live_server(metrics_prefix="vllm") as live, live.client() as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        text = c.get("/metrics").text
        vllm = families(text)
    tidal_only = {"tidal:num_requests_running_peak", "tidal:prompt_tokens_computed"}
    assert {name.replace("tidal:", "vllm:", 1) for name in tidal - tidal_only} == vllm - tidal_only
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds", "vllm:request_success", "vllm:prompt_tokens"} <= vllm
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert not [name for name in vllm if name.startswith("tidal:") and name not in tidal_only]


def test_priority_with_the_priority_policy(client: httpx.Client) -> None:
    refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 3})
    assert refused.status_code == 400 and "--scheduling-policy priority" in refused.json()["error"]["message"]
    with live_server(engine={"scheduling_policy": "priority"}) as live, live.client() as c:
        for body in ({"prompt": "hi", "max_tokens": 2, "priority": -5},
                     {"messages": MSG, "max_tokens": 2, "priority": 3}):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            response = c.post(path, json=body)
            assert response.status_code == 200, response.text


def test_allowed_token_ids(client: httpx.Client) -> None:
    ids = tokenize(client, prompt=" yes no maybe", add_special_tokens=False)
    pieces = {client.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids}
    data = complete(client, allowed_token_ids=ids, logprobs=0, max_tokens=8)
    tokens = data["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and set(tokens) <= pieces


def test_bad_words(client: httpx.Client) -> None:
    free = complete(client, logprobs=0, max_tokens=8)["choices"][0]["logprobs"]["tokens"]
    word = free[1].strip() or free[1]
    banned = complete(client, logprobs=0, max_tokens=8, bad_words=[word])["choices"][0]
    assert banned["logprobs"]["tokens"][0] == free[0]
    assert free[1] not in banned["logprobs"]["tokens"] and word not in banned["text"]


def test_prompt_logprobs_match_the_model(client: httpx.Client) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from test_server_support import tiny_model_dir

    prompt = "the tide comes in"
    ids = tokenize(client, prompt=prompt)
    data = complete(client, prompt=prompt, prompt_logprobs=2, max_tokens=2)
    entries = data["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), torch_dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert abs(entry[str(ids[i])]["logprob"] - expected[i - 1, ids[i]].item()) < 1e-3
        top = torch.topk(expected[i - 1], 2).indices.tolist()
        assert set(map(str, top)) <= set(entry) and len(entry) <= 3
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1
    # Streamed: the first chunk carries them.
    streamed = events(client.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 2, "max_tokens": 2,
                                                           "stream": True, **GREEDY}))
    assert streamed[0]["choices"][0]["prompt_logprobs"] == entries
    assert all(c["choices"][0]["prompt_logprobs"] is None for c in streamed[1:])
    chat_data = chat(client, prompt_logprobs=0, max_tokens=1)
    assert len(chat_data["prompt_logprobs"]) == chat_data["usage"]["prompt_tokens"]
    chat_streamed = events(client.post("/v1/chat/completions", json={"messages": MSG, "prompt_logprobs": 0,
                                                                      "max_tokens": 3, "stream": True, **GREEDY}))
    carried = [c["prompt_logprobs"] for c in chat_streamed if "prompt_logprobs" in c]
    assert carried == [chat_data["prompt_logprobs"]]
    assert complete(client)["choices"][0]["prompt_logprobs"] is None


def test_echo_with_logprobs_starts_with_the_prompt(client: httpx.Client) -> None:
    prompt = "the tide comes in"
    plain = complete(client, prompt=prompt, logprobs=1, max_tokens=3)["choices"][0]["logprobs"]
    data = complete(client, prompt=prompt, logprobs=1, max_tokens=3, echo=True)
    logprobs, usage = data["choices"][0]["logprobs"], data["usage"]
    num_prompt = usage["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert logprobs["tokens"][num_prompt:] == plain["tokens"]
    assert logprobs["token_logprobs"][num_prompt:] == plain["token_logprobs"]
    assert logprobs["text_offset"][num_prompt] == len(prompt)
    assert data["choices"][0]["text"].startswith(prompt)
    streamed = events(client.post("/v1/completions", json={"prompt": prompt, "logprobs": 1, "max_tokens": 3,
                                                           "echo": True, "stream": True, **GREEDY}))
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in streamed:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    assert joined == logprobs


def test_greedy_outputs_under_generation_config_vllm_are_unchanged(client: httpx.Client, tmp_path: Path) -> None:
    """A checkpoint whose generation_config.json sets sampling defaults (among them a repetition
    "penalty" below 1, which pulls the prompt's tokens into a greedy output): `--generation-config
    vllm` ignores the file, so greedy requests give the plain model's tokens; `auto` applies it to
    the fields a request leaves out."""
    from test_server_support import tiny_model_dir

    from tidal_engine.server.generation_config import load_sampling_defaults

    model = tmp_path / "model"
    model.mkdir()
    for item in Path(tiny_model_dir()).iterdir():
        if item.name != "generation_config.json":  # a link would write through to the shared model
            (model / item.name).symlink_to(item)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_k": 3, "repetition_penalty": 0.05, "max_new_tokens": 7}))
    body = {"prompt": "hello hello hello", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    served: dict[str, str] = {}
    for mode in ("vllm", "auto"):
        defaults = load_sampling_defaults(mode, str(model))
        with live_server(engine={"model": str(model)}, generation_config=mode, default_sampling=defaults) as live, \
                live.client() as c:
            served[mode] = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert served["vllm"] == plain
    assert served["auto"] != plain  # the file's repetition_penalty reaches greedy requests under auto
