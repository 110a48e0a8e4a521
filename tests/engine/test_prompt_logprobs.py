"""prompt_logprobs from the prefill forward (runner/prompt_logprobs.py), against a full forward
of the HF model: a prompt longer than a prefill chunk (and than the old 512-token limit),
after its prefix was cached by another request, next to a request that asks nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tidal_engine import LLM, SamplingParams

from tiny_models import make_tiny_model
from tiny_tokenizer import save_byte_tokenizer

PROMPT_LEN = 600
TOP = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-prompt-logprobs")
    make_tiny_model("llama", path, max_position_embeddings=1024)
    save_byte_tokenizer(path, vocab_size=320)
    return path


def reference(folder: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax of the full forward's logits, [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_over_chunks_and_a_cached_prefix_match_a_full_forward(folder: Path) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(3, 320) for _ in range(PROMPT_LEN)]
    # Prefill chunks of 128 tokens: the prompt takes five steps.
    llm = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=128, max_num_batched_tokens=128,
              skip_tokenizer_init=True)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (warm,) = llm.generate([ids], greedy)  # caches the prompt's blocks
    assert warm.prompt_logprobs is None
    (again,) = llm.generate([ids], greedy)
    assert again.num_cached_tokens > 0  # the prefix is cached ...
    asked, other = llm.generate([ids, ids[:50]], [greedy.clone(prompt_logprobs=TOP), greedy])
    assert other.prompt_logprobs is None
    assert asked.num_cached_tokens == 0  # prompt_logprobs skip the prefix cache, as in vLLM
    assert asked.outputs[0].token_ids == warm.outputs[0].token_ids
    positions = asked.prompt_logprobs
    assert positions is not None and len(positions) == PROMPT_LEN and positions[0] is None
    expected = reference(folder, ids)
    for p in range(1, PROMPT_LEN):
        position, row = positions[p], expected[p - 1]
        assert position is not None
        token = ids[p]
        assert next(iter(position)) == token  # the prompt token first, as vLLM orders them
        assert abs(position[token].logprob - row[token].item()) < 1e-3
        assert position[token].rank == int((row > row[token]).sum()) + 1
        top = [t for t, lp in position.items() if t != token or lp.rank <= TOP]
        assert set(torch.topk(row, TOP).indices.tolist()) <= set(top) and len(top) <= TOP + 1


def test_prompt_logprobs_with_speculative_decoding_are_refused(folder: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, num_gpu_blocks_override=8,
              skip_tokenizer_init=True,
              speculative_config=spec)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with speculative decoding"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=1))


def test_prompt_logprobs_survive_a_preemption_mid_prefill(folder: Path) -> None:
    """Four KV blocks: the request with prompt_logprobs is preempted while its prompt is half
    computed (the decoding one needs its block), then computed again: no position twice."""
    rng = random.Random(1)
    decoding, asking = [rng.randrange(3, 320) for _ in range(32)], [rng.randrange(3, 320) for _ in range(40)]
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, num_gpu_blocks_override=4,
              max_num_batched_tokens=16, skip_tokenizer_init=True)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    _, output = llm.generate([decoding, asking], [greedy, greedy.clone(max_tokens=4, prompt_logprobs=0)])
    assert llm.engine.core.get_stats().num_preemptions > 0
    positions = output.prompt_logprobs
    assert positions is not None and len(positions) == len(asking)
    expected = reference(folder, asking)
    for p in range(1, len(asking)):
        assert abs(positions[p][asking[p]].logprob - expected[p - 1, asking[p]].item()) < 1e-3
