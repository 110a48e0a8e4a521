"""The pooling HTTP API in process: MiniLM and a tiny BERT cross-encoder behind the real
pooling engine core (its loop on a thread, over ZeroMQ) and FastAPI app, driven with the openai
client and plain JSON."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))
from tiny_pooling_models import make_bert_cross_encoder  # noqa: E402

from tidal_engine.pooling.client import LocalPoolingCore, PoolingClient  # noqa: E402
from tidal_engine.pooling.core import PoolingEngineCore  # noqa: E402
from tidal_engine.server.app import ServerSettings, build_app  # noqa: E402
from tidal_engine.server.pooling import build_pooling_app  # noqa: E402

MINILM = "all-minilm-l6-v2"


def local_client(model: str, name: str, **options: Any) -> PoolingClient:
    """A CPU pooling core with its loop on a thread, and the API server's client to it."""
    return LocalPoolingCore(PoolingEngineCore.from_model(model, name, device="cpu", **options)).client


@pytest.fixture(scope="module")
def embed_http() -> Iterator[TestClient]:
    engine = local_client(MINILM, MINILM)
    with TestClient(build_pooling_app(engine, ServerSettings(served_model_names=[MINILM]))) as http:
        yield http


@pytest.fixture(scope="module")
def rerank_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("cross-encoder")
    make_bert_cross_encoder(folder)
    engine = local_client(str(folder), "reranker")
    with TestClient(build_pooling_app(engine, ServerSettings(served_model_names=["reranker"]))) as http:
        yield http


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_openai_embeddings_float_base64_and_dimensions(embed_http: TestClient) -> None:
    client = openai_client(embed_http)
    texts = ["The tide comes in.", "The tide goes out.", "Kubernetes schedules pods."]
    floats = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and len(floats.data[0].embedding) == 384
    vectors = np.array([d.embedding for d in floats.data])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # the paraphrase is closer
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0

    raw = embed_http.post("/v1/embeddings", json={"model": MINILM, "input": texts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0], atol=1e-6)
    sdk_default = client.embeddings.create(model=MINILM, input=texts[0])  # the SDK asks for base64 and decodes
    np.testing.assert_allclose(sdk_default.data[0].embedding, vectors[0], atol=1e-6)

    short = client.embeddings.create(model=MINILM, input=texts, dimensions=64, encoding_format="float")
    truncated = np.array([d.embedding for d in short.data])
    assert truncated.shape == (3, 64)
    expected = vectors[:, :64] / np.linalg.norm(vectors[:, :64], axis=1, keepdims=True)  # Matryoshka: renormalised
    np.testing.assert_allclose(truncated, expected, atol=1e-5)


def test_token_array_inputs_match_text(embed_http: TestClient) -> None:
    client = openai_client(embed_http)
    ids = embed_http.app.state.engine.tokenizer("hello there")["input_ids"]
    by_text = client.embeddings.create(model=MINILM, input="hello there", encoding_format="float").data[0].embedding
    one = client.embeddings.create(model=MINILM, input=ids, encoding_format="float").data[0].embedding
    many = client.embeddings.create(model=MINILM, input=[ids, ids[:3]], encoding_format="float").data
    np.testing.assert_allclose(one, by_text, atol=1e-6)
    np.testing.assert_allclose(many[0].embedding, by_text, atol=1e-6)


@pytest.mark.parametrize("body, status, fragment", [
    ({"input": ""}, 400, "empty"),
    ({"input": []}, 400, "empty"),
    ({"input": ["ok", ""]}, 400, "empty"),
    ({"input": "word " * 400}, 400, "maximum context length is 256"),
    ({"input": "x", "dimensions": 1000}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": [[1, 2, 999999]]}, 400, "vocabulary"),
    ({"input": "x", "model": "nope"}, 404, "does not exist"),
])
def test_bad_embedding_requests(embed_http: TestClient, body: dict, status: int, fragment: str) -> None:
    answer = embed_http.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    assert fragment in answer.json()["error"]["message"]


def test_truncation_on_request(embed_http: TestClient) -> None:
    body = {"input": "word " * 400, "truncate_prompt_tokens": -1}
    answer = embed_http.post("/v1/embeddings", json=body)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 256


def test_wrong_task_is_400(embed_http: TestClient, rerank_http: TestClient) -> None:
    chat = embed_http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "does not generate" in chat.json()["error"]["message"]
    responses = embed_http.post("/v1/responses", json={"input": "hi"})
    assert responses.status_code == 400 and "does not generate" in responses.json()["error"]["message"]
    embeddings = rerank_http.post("/v1/embeddings", json={"input": "hi"})
    assert embeddings.status_code == 400 and "classify model" in embeddings.json()["error"]["message"]


def test_generative_model_refuses_pooling_endpoints() -> None:
    from test_server_support import make_engine

    app = build_app(make_engine(), ServerSettings(served_model_names=["tiny"]))
    with TestClient(app) as http:
        for path in ("/v1/embeddings", "/score", "/rerank", "/v2/rerank", "/pooling"):
            answer = http.post(path, json={"input": "hi"})
            assert answer.status_code == 400 and "generative model" in answer.json()["error"]["message"]


def test_score_and_rerank_with_a_cross_encoder(rerank_http: TestClient) -> None:
    docs = ["The tide is the rise and fall of the sea.", "Pods run containers.", "Bananas are yellow."]
    score = rerank_http.post("/score", json={"model": "reranker", "text_1": "what is a tide?", "text_2": docs})
    assert score.status_code == 200, score.text
    scores = [d["score"] for d in score.json()["data"]]
    assert len(scores) == 3 and all(0 < s < 1 for s in scores)  # one label: sigmoid

    jina = rerank_http.post("/v1/rerank", json={"model": "reranker", "query": "what is a tide?",
                                                 "documents": docs, "top_n": 2})
    results = jina.json()["results"]
    ranked = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in results] == ranked
    assert [r["relevance_score"] for r in results] == pytest.approx([scores[i] for i in ranked], abs=1e-6)
    assert results[0]["document"]["text"] == docs[ranked[0]] and jina.json()["usage"]["total_tokens"] > 0

    cohere = rerank_http.post("/v2/rerank", json={"model": "reranker", "query": "what is a tide?",
                                                   "documents": [{"text": d} for d in docs],
                                                   "return_documents": False})
    body = cohere.json()
    assert body["id"] and body["meta"]["billed_units"]["search_units"] == 1
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -scores[i])
    assert all("document" not in r for r in body["results"])


def test_score_with_an_embedding_model_is_cosine(embed_http: TestClient) -> None:
    answer = embed_http.post("/score", json={"text_1": ["a cat", "a dog"], "text_2": ["a kitten", "a dog"]})
    scores = [d["score"] for d in answer.json()["data"]]
    assert scores[1] == pytest.approx(1.0, abs=1e-5) and 0 < scores[0] < 1
    mismatch = embed_http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatch.status_code == 400
    empty = embed_http.post("/rerank", json={"query": "q", "documents": []})
    assert empty.status_code == 400


def test_pooling_endpoint_and_metrics(embed_http: TestClient, rerank_http: TestClient) -> None:
    pooled = embed_http.post("/pooling", json={"input": ["hello"]}).json()
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 384
    probs = rerank_http.post("/pooling", json={"input": "hello"}).json()
    assert len(probs["data"][0]["data"]) == 1
    text = embed_http.get("/metrics").text
    assert f'tidal:num_requests_waiting{{model_name="{MINILM}"}} 0.0' in text
    assert "tidal:prompt_tokens_total" in text
    models = embed_http.get("/v1/models").json()
    assert models["data"][0]["id"] == MINILM and models["data"][0]["max_model_len"] == 256


def test_runner_and_convert_flags() -> None:
    from tidal_engine.cli import build_parser, engine_config, resolve_runner

    parser = build_parser()

    def config(*argv: str) -> object:
        args = parser.parse_args(["serve", *argv])
        return engine_config(args.subparser, args, args.model, None)

    assert resolve_runner(config(MINILM)) == "pooling"  # --runner auto: an encoder pools
    assert resolve_runner(config("smollm2-135m")) == "generate"
    assert resolve_runner(config(MINILM, "--runner", "generate")) == "generate"
    with pytest.raises(SystemExit):
        config(MINILM, "--runner", "generate", "--convert", "embed")


def test_sleep_and_wake(tmp_path: Path) -> None:
    make_bert_cross_encoder(tmp_path)
    engine = local_client(str(tmp_path), "reranker", enable_sleep_mode=True)
    body = {"text_1": "what is a tide?", "text_2": ["the sea rises", "pods run"]}
    with TestClient(build_pooling_app(engine, ServerSettings(served_model_names=["reranker"]))) as http:
        awake = http.post("/score", json=body).json()["data"]
        for level in (1, 2):
            assert http.post(f"/sleep?level={level}").json() == {"is_sleeping": True, "level": level}
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            refused = http.post("/score", json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert f'tidal:engine_sleep_state{{model_name="reranker",sleep_state="{"weights_offloaded" if level == 1 else "discard_all"}"}} 1.0' in http.get("/metrics").text
            assert http.post("/wake_up").json() == {"is_sleeping": False}
            assert http.post("/score", json=body).json()["data"] == awake  # the same weights back
        assert http.post("/sleep?level=3").status_code == 400


def test_sleep_needs_sleep_mode(embed_http: TestClient) -> None:
    refused = embed_http.post("/sleep")
    assert refused.status_code == 400 and "--enable-sleep-mode" in refused.json()["error"]["message"]


def test_lora_is_refused_on_a_pooling_model() -> None:
    from tidal_engine.config import EngineConfig
    from tidal_engine.server.pooling import serve_pooling

    config = EngineConfig(model=MINILM, runner="pooling", enable_lora=True)
    with pytest.raises(ValueError, match="--enable-lora needs --runner generate"):
        serve_pooling(config, ServerSettings())


def test_start_up_hint_matches_the_task() -> None:
    from tidal_engine.server.pooling import pooling_curl_hint

    settings = ServerSettings(host="0.0.0.0", port=8001, api_key="secret")
    embed = pooling_curl_hint(settings, MINILM, "embed")
    assert "http://localhost:8001/v1/embeddings" in embed and "$TIDAL_API_KEY" in embed and "secret" not in embed
    assert "/rerank" in pooling_curl_hint(settings, "reranker", "classify")


def test_operator_reads_the_pooling_servers_metrics(tmp_path: Path) -> None:
    """The autoscaler and idle policy read a pooling engine as they read a chat engine."""
    from tidal_operator.engine_client import EngineMetrics

    make_bert_cross_encoder(tmp_path)
    engine = local_client(str(tmp_path), "reranker", enable_sleep_mode=True)
    with TestClient(build_pooling_app(engine, ServerSettings(served_model_names=["reranker"]))) as http:
        idle = EngineMetrics.parse(http.get("/metrics").text)
        assert (idle.running, idle.waiting, idle.sleep_level, idle.activity) == (0, 0, 0, 0)
        http.post("/rerank", json={"query": "q", "documents": ["a", "b"]})
        busy = EngineMetrics.parse(http.get("/metrics").text)
        assert busy.activity is not None and busy.activity > 0  # the idle policy sees work happened
        http.post("/sleep?level=1")
        assert EngineMetrics.parse(http.get("/metrics").text).sleep_level == 1


def test_the_launcher_prepares_a_pooling_api_server() -> None:
    """`tidal-engine serve` loads the API server's tokenizer while the core loads the model: for
    a pooling model, the pooling tokenizer (BERT has no generation architecture to resolve)."""
    from tidal_engine.config import EngineConfig
    from tidal_engine.server.launcher import prepare_api_server

    prepared = prepare_api_server(EngineConfig(model=MINILM, runner="pooling"), ServerSettings())
    assert prepared.tokenizer("hello there")["input_ids"][0] == prepared.tokenizer.cls_token_id
