"""Logit parity of our Llama/Qwen2/Qwen3 module with HF transformers, over a paged KV cache.

Every test compares against HF's own full-sequence logits in float32 (max abs diff
<= 1e-4), however the sequence is cut into forwards: one prefill, prefill plus decode
steps, chunked prefill crossing block boundaries, a prefix-cache hit, a mixed batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tidal_engine.models.llama import LlamaForCausalLM
from tidal_engine.models.loader import load_model, resolve_model
from tiny_models import (
    TINY_MODELS,
    SeqStep,
    allocate_kv_caches,
    forward_batch,
    hf_logits,
    make_tiny_model,
    run_chunks,
)

TOL = 1e-4
SEQ_LEN = 40


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, LlamaForCausalLM]:
    """(HF reference, our model loaded from the saved folder), both float32 on CPU."""
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_model(request.param, folder)
    ours = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    return hf_model, ours


def _prompt(model: LlamaForCausalLM, length: int = SEQ_LEN, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff:.3g} > {TOL}"


def test_full_prefill(pair: tuple[PreTrainedModel, LlamaForCausalLM]) -> None:
    hf_model, ours = pair
    ids = _prompt(ours)
    _assert_close(run_chunks(ours, ids, [len(ids)], block_size=16), hf_logits(hf_model, ids))


def test_prefill_then_decode(pair: tuple[PreTrainedModel, LlamaForCausalLM]) -> None:
    hf_model, ours = pair
    ids = _prompt(ours)
    # 33-token prefill, then 7 one-token decode steps (the 33rd token opens a third block).
    _assert_close(run_chunks(ours, ids, [33] + [1] * 7, block_size=16), hf_logits(hf_model, ids))


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_chunked_prefill(pair: tuple[PreTrainedModel, LlamaForCausalLM], chunk_size: int, block_size: int) -> None:
    hf_model, ours = pair
    ids = _prompt(ours)
    _assert_close(run_chunks(ours, ids, chunk_size, block_size=block_size), hf_logits(hf_model, ids))


@pytest.mark.parametrize("block_size", [16, 4])
def test_prefix_cache_hit(pair: tuple[PreTrainedModel, LlamaForCausalLM], block_size: int) -> None:
    """Request A fills its blocks; request B shares A's first k full blocks and computes
    only its own suffix, reading the prefix K/V from A's blocks."""
    hf_model, ours = pair
    k = 2
    prefix = _prompt(ours, k * block_size, seed=2)
    ids_a = prefix + _prompt(ours, 5, seed=3)
    ids_b = prefix + _prompt(ours, 11, seed=4)
    kv_caches = allocate_kv_caches(ours, num_blocks=16, block_size=block_size)
    table_a = [3, 7, 1, 9, 12][: -(-len(ids_a) // block_size)]
    forward_batch(ours, kv_caches, [SeqStep(ids_a, 0, table_a)], block_size)
    # B's table: A's prefix blocks, then blocks of its own.
    table_b = table_a[:k] + [5, 14, 2, 11][: -(-len(ids_b) // block_size) - k]
    (logits_b,) = forward_batch(ours, kv_caches, [SeqStep(ids_b[len(prefix) :], len(prefix), table_b)], block_size)
    _assert_close(logits_b, hf_logits(hf_model, ids_b)[len(prefix) :])


def test_mixed_batch(pair: tuple[PreTrainedModel, LlamaForCausalLM]) -> None:
    """One step carrying a prefill chunk of one request and a decode of another."""
    hf_model, ours = pair
    block_size = 4
    ids_a, ids_b = _prompt(ours, 20, seed=5), _prompt(ours, 13, seed=6)
    table_a, table_b = [0, 2, 4, 6, 8], [1, 3, 5, 7]
    kv_caches = allocate_kv_caches(ours, num_blocks=10, block_size=block_size)
    first_a, first_b = forward_batch(
        ours, kv_caches, [SeqStep(ids_a[:9], 0, table_a), SeqStep(ids_b[:12], 0, table_b)], block_size
    )
    rest_a, last_b = forward_batch(
        ours, kv_caches, [SeqStep(ids_a[9:], 9, table_a), SeqStep(ids_b[12:], 12, table_b)], block_size
    )
    _assert_close(torch.cat([first_a, rest_a]), hf_logits(hf_model, ids_a))
    _assert_close(torch.cat([first_b, last_b]), hf_logits(hf_model, ids_b))


def test_rope_scaling_matters(tmp_path: Path) -> None:
    """Guards the parity test of llama3 rope: without the scaling, logits differ clearly."""
    hf_model = make_tiny_model("llama3_rope_tied", tmp_path)
    source = resolve_model(str(tmp_path))
    source.arch_config.rope_scaling = None
    unscaled = load_model(source, torch.float32, torch.device("cpu"))
    ids = _prompt(unscaled)
    diff = (run_chunks(unscaled, ids, [len(ids)], block_size=16) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff > 1e-2


def test_bfloat16_runs_close(tmp_path: Path) -> None:
    """A bf16 model gives finite logits near the fp32 reference (loose: bf16 rounding)."""
    hf_model = make_tiny_model("qwen3", tmp_path)
    ours = load_model(resolve_model(str(tmp_path)), torch.bfloat16, torch.device("cpu"))
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.rotary_emb.cos_cache.dtype == torch.float32
    ids = _prompt(ours)
    logits = run_chunks(ours, ids, 7, block_size=4)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits - hf_logits(hf_model, ids)).abs().max().item() < 0.5
