"""Tensor parallelism on two GPUs (NCCL), in bf16: marked ``gpu``, skipped with fewer than 2.

Run on a 2-GPU machine: ``TRITON_INTERPRET=0 pytest tests/engine/test_tensor_parallel_gpu.py -m gpu``.
TP=2 (NCCL all-reduces captured in the decode and mixed-step CUDA graphs) against TP=1 on
the same tiny random Qwen3: the greedy tokens agree, except that a sequence may take another
token where the reference's two best nearly tie (the two sum in different orders, and bf16
rounds that into a different argmax), and the chosen tokens' logprobs stay within a bf16
tolerance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal_engine import LLM, SamplingParams

from tiny_models import make_tiny_model
from tiny_tokenizer import EOS_ID, save_byte_tokenizer

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(INTERPRETING, reason="GPU tests run compiled: set TRITON_INTERPRET=0"),
]
BF16_LOGPROB_TOL = 0.1
PROMPTS = [[5, 17, 99, 3, 25, 8, 41] * 3, [1, 2, 3], list(range(100, 160))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-gpu-qwen3")
    make_tiny_model("qwen3", path, eos_token_id=EOS_ID, bos_token_id=None, hidden_size=256, intermediate_size=512,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
    save_byte_tokenizer(path, vocab_size=1000)
    return path


def _run(folder: Path, **options: Any) -> tuple[list[Any], Any]:
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20, **options)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPTS, params)  # prefills (mixed graphs), then decodes (decode graphs)
    single = llm.generate(PROMPTS[1:2], params)  # batch 1: the one-row path
    graphs = llm.engine.core.executor.collective_rpc("cuda_graph_counts")
    llm.engine.shutdown()
    return out + single, graphs


def _assert_close(reference: list[Any], got: list[Any]) -> None:
    agreed = 0
    for ref, mine in zip(reference, got):
        for pos, (a, b) in enumerate(zip(ref.outputs[0].logprobs, mine.outputs[0].logprobs)):
            ref_token, got_token = ref.outputs[0].token_ids[pos], mine.outputs[0].token_ids[pos]
            if ref_token != got_token:
                # bf16 sums in another order: the argmax may flip only where two logits nearly tie.
                assert got_token in a and a[ref_token].logprob - a[got_token].logprob <= BF16_LOGPROB_TOL, (pos, a, b)
                break  # the continuations differ from here on
            assert abs(a[ref_token].logprob - b[got_token].logprob) <= BF16_LOGPROB_TOL
            agreed += 1
    assert agreed >= len(reference)  # flips are rare: on average a sequence agrees for a while first


def test_tp2_bf16_greedy_matches_tp1_with_graphs(folder: Path) -> None:
    reference, _ = _run(folder)
    got, graphs = _run(folder, tensor_parallel_size=2)
    assert len(graphs) == 2 and all(g["decode"] > 0 for g in graphs), graphs  # the all-reduces were captured
    _assert_close(reference, got)


def test_tp2_eager_matches_graphs(folder: Path) -> None:
    graphed, _ = _run(folder, tensor_parallel_size=2)
    eager, graphs = _run(folder, tensor_parallel_size=2, enforce_eager=True)
    assert all(g["decode"] == 0 for g in graphs)
    assert [o.outputs[0].token_ids for o in eager] == [o.outputs[0].token_ids for o in graphed]


def test_pp2_bf16_matches_tp1_with_stage_graphs(folder: Path) -> None:
    # Each stage replays its own decode graph; activations cross between replays (NCCL send/recv).
    reference, _ = _run(folder)
    got, graphs = _run(folder, pipeline_parallel_size=2)
    assert len(graphs) == 2 and all(g["decode"] > 0 and g["mixed"] == 0 for g in graphs), graphs
    _assert_close(reference, got)
