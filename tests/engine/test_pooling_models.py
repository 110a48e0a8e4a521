"""Pooling models against their references: MiniLM against sentence-transformers, tiny random
Qwen3-Embedding, BERT and Qwen3 cross-encoders against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidal_engine.layers.dense_attention import packed_attention, packed_qkv_attention
from tidal_engine.models.loader import resolve_model_path
from tidal_engine.pooling.core import PoolingEngineCore
from tidal_engine.pooling.params import PoolingParams
from tidal_engine.pooling.pooler import finish_embedding, pool
from tidal_engine.pooling.runner import PoolingInput
from tiny_pooling_models import make_bert_cross_encoder, make_qwen3_classifier, make_qwen3_embedding


def varied_texts(count: int) -> list[str]:
    """Short and long, cased, accented, numeric, code, emoji, and one past MiniLM's 256 tokens."""
    seeds = [
        "hello", "Hello, World!", "The tide comes in and the tide goes out.", "Ça va? Très bien, merci.",
        "3.14159 is approximately pi; 2.71828 is e.", "def f(x):\n    return x * 2", "🌊 waves 🌊",
        "Kubernetes operators reconcile desired state.", "", "     spaces     ", "UPPER lower MiXeD",
        "Tokyo 東京 は日本の首都です。", "a " * 40, "Embeddings place similar sentences close together.",
    ]
    texts = [seeds[i % len(seeds)] + (f" variant {i}" if i >= len(seeds) else "") for i in range(count - 1)]
    texts.append("long document " * 200)  # truncated to 256 tokens, as sentence-transformers does
    return texts


def test_minilm_matches_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer

    texts = varied_texts(64)
    engine = PoolingEngineCore.from_model("all-minilm-l6-v2", "all-minilm-l6-v2", device="cpu", max_num_batched_tokens=700)
    assert (engine.info.task, engine.info.method, engine.max_model_len) == ("embed", "mean", 256)
    encoded = engine.tokenizer(texts, truncation=True, max_length=engine.max_model_len)["input_ids"]
    ours = torch.stack(engine.encode_offline([PoolingInput(ids) for ids in encoded]))
    reference = SentenceTransformer(str(resolve_model_path("all-minilm-l6-v2")), device="cpu")
    expected = torch.tensor(reference.encode(texts, batch_size=16))
    assert ours.shape == expected.shape == (64, 384)
    cosine = F.cosine_similarity(ours, expected)
    assert cosine.min().item() >= 0.9999, cosine


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    return folder, make_qwen3_embedding(folder)


PROMPTS = [[5, 17, 99, 3], [42], list(range(1, 40)), [7, 7, 7, 7, 7, 250, 8]]


def test_qwen3_embedding_last_token_matches_transformers(qwen3_embedding: tuple[Path, object]) -> None:
    folder, hf_model = qwen3_embedding
    engine = PoolingEngineCore.from_model(str(folder), "emb", device="cpu")
    assert (engine.info.task, engine.info.method) == ("embed", "last")
    ours = engine.encode_offline([PoolingInput(ids, params=PoolingParams(normalize=False)) for ids in PROMPTS])
    with torch.no_grad():
        for ids, vector in zip(PROMPTS, ours, strict=True):
            expected = hf_model(torch.tensor([ids])).last_hidden_state[0, -1]
            torch.testing.assert_close(vector, expected, atol=1e-4, rtol=1e-4)


def test_bert_cross_encoder_matches_transformers(tmp_path: Path) -> None:
    hf_model = make_bert_cross_encoder(tmp_path)
    engine = PoolingEngineCore.from_model(str(tmp_path), "rerank", device="cpu")
    assert (engine.info.task, engine.info.method, engine.info.num_labels) == ("classify", "cls", 1)
    pairs = [("what is a tide?", "The tide is the rise and fall of the sea."), ("hi", "unrelated text here"),
             ("a longer question about kubernetes operators", "k8s")]
    items = []
    for query, doc in pairs:
        enc = engine.tokenizer(query, doc)
        items.append(PoolingInput(enc["input_ids"], enc["token_type_ids"], PoolingParams(activation=False)))
    ours = engine.encode_offline(items)
    with torch.no_grad():
        for item, logits in zip(items, ours, strict=True):
            expected = hf_model(input_ids=torch.tensor([item.token_ids]),
                                token_type_ids=torch.tensor([item.token_type_ids])).logits[0]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    scored = engine.encode_offline([PoolingInput(items[0].token_ids, items[0].token_type_ids)])[0]
    torch.testing.assert_close(scored, torch.sigmoid(ours[0]))  # one label: sigmoid by default


def test_qwen3_classifier_matches_transformers(tmp_path: Path) -> None:
    hf_model = make_qwen3_classifier(tmp_path)
    engine = PoolingEngineCore.from_model(str(tmp_path), "rerank", device="cpu")
    assert (engine.info.task, engine.info.method) == ("classify", "last")
    ours = engine.encode_offline([PoolingInput(ids, params=PoolingParams(activation=False)) for ids in PROMPTS])
    with torch.no_grad():
        for ids, logits in zip(PROMPTS, ours, strict=True):
            torch.testing.assert_close(logits, hf_model(torch.tensor([ids])).logits[0], atol=1e-4, rtol=1e-4)


def test_embed_a_classifier_with_convert(tmp_path: Path) -> None:
    make_qwen3_classifier(tmp_path)
    engine = PoolingEngineCore.from_model(str(tmp_path), "emb", convert="embed", device="cpu")
    assert engine.info.task == "embed"
    assert engine.encode_offline([PoolingInput([1, 2, 3])])[0].shape == (64,)


def test_packed_attention_matches_one_sequence_at_a_time() -> None:
    torch.manual_seed(0)
    lens = [3, 7, 1, 5]
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    for causal in (False, True):
        out = packed_attention(q, k, v, lens, causal=causal, scale=0.3)
        start = 0
        for n in lens:
            sl = slice(start, start + n)
            one = packed_attention(q[sl], k[sl], v[sl], [n], causal=causal, scale=0.3)
            torch.testing.assert_close(out[sl], one)
            start += n


def test_pool_methods_and_matryoshka() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert pool(hidden, [2, 4], "cls").tolist() == [[0, 1], [4, 5]]
    assert pool(hidden, [2, 4], "last").tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, [2, 4], "mean").tolist() == [[1, 2], [7, 8]]
    vector = finish_embedding(torch.tensor([3.0, 4.0, 12.0]), PoolingParams(dimensions=2))
    assert vector.tolist() == pytest.approx([0.6, 0.8])


def test_packed_qkv_attention_matches_packed_attention() -> None:
    torch.manual_seed(0)
    lens = [3, 7, 1, 5]
    qkv = torch.randn(16, 3 * 4 * 8)
    q, k, v = (x.reshape(16, 4, 8) for x in qkv.split(32, dim=1))
    expected = packed_attention(q, k, v, lens, causal=False, scale=0.3).reshape(16, 32)
    torch.testing.assert_close(packed_qkv_attention(qkv, 4, lens, scale=0.3), expected)
    same = packed_attention(q[:12], k[:12], v[:12], [6, 6], causal=False, scale=0.3).reshape(12, 32)
    torch.testing.assert_close(packed_qkv_attention(qkv[:12], 4, [6, 6], scale=0.3), same)  # no padding
