"""Logit parity: our model with PEFT adapters in device slots vs HF transformers + PEFT.

Two random adapters of different ranks (one plain over every target, one rsLoRA over a
subset), on tiny Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models, in one mixed batch
with base-model rows and a repeated adapter, each row within 1e-4 of the reference in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_support import chunk, make_peft_adapter  # noqa: E402
from tiny_models import SeqStep, allocate_kv_caches, forward_batch, hf_logits, make_tiny_model  # noqa: E402

from tidal_engine.lora import BaseModelShape, LoRAManager, LoRAModelSlots, LoRASettings  # noqa: E402
from tidal_engine.models.loader import load_model, resolve_model  # noqa: E402

TOL = 1e-4
BLOCK = 4


def _setup(name: str, tmp_path: Path, max_loras: int = 3) -> dict[str, Any]:
    torch.set_num_threads(1)
    hf = make_tiny_model(name, tmp_path / "base")
    peft_a = make_peft_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=1)
    peft_b = make_peft_adapter(hf, tmp_path / "b", rank=8, alpha=16, seed=2, use_rslora=True,
                               targets=["q_proj", "v_proj", "down_proj", "up_proj"])
    source = resolve_model(str(tmp_path / "base"))
    model = load_model(source, torch.float32, "cpu")
    slots = LoRAModelSlots(model, max_loras=max_loras, max_rank=8)
    manager = LoRAManager(BaseModelShape.from_arch(source.arch_config), LoRASettings(max_loras=max_loras, max_lora_rank=8),
                          slots)
    manager.load("a", str(tmp_path / "a"))
    manager.load("b", str(tmp_path / "b"))
    return {"hf": hf, "peft": {"a": peft_a, "b": peft_b}, "model": model, "manager": manager,
            "vocab": source.arch_config.vocab_size}


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3"])
def test_mixed_batch_matches_peft(name: str, tmp_path: Path) -> None:
    s = _setup(name, tmp_path)
    model, manager = s["model"], s["manager"]
    adapters = [None, "a", "b", "a", None, "b"]  # base rows, two adapters, each repeated apart
    prompts = _prompts(s["vocab"], [7, 5, 9, 6, 3, 4])
    caches = allocate_kv_caches(model, num_blocks=64, block_size=BLOCK)
    steps, next_block = [], 0
    for prompt in prompts:
        blocks = -(-len(prompt) // BLOCK)
        steps.append(SeqStep(prompt, 0, list(range(next_block, next_block + blocks))))
        next_block += blocks
    with torch.no_grad():
        assert manager.begin_step([chunk(a, len(p)) for a, p in zip(adapters, prompts)])
        logits = forward_batch(model, caches, steps, BLOCK)
        manager.end_step()
    for adapter, prompt, ours in zip(adapters, prompts, logits):
        reference = hf_logits(s["hf"] if adapter is None else s["peft"][adapter], prompt)
        torch.testing.assert_close(ours, reference, atol=TOL, rtol=0)
    # The adapters really change the output (a no-op adapter would pass trivially).
    base = hf_logits(s["hf"], prompts[1])
    assert (logits[1] - base).abs().max() > 1e-2


def test_prefill_then_decode_across_steps_and_slot_reuse(tmp_path: Path) -> None:
    """Chunked prefill and decode steps keep each request's adapter; with one slot the two
    adapters take turns in it, and the results still match PEFT's."""
    s = _setup("llama", tmp_path, max_loras=1)
    model, manager = s["model"], s["manager"]
    prompt = _prompts(s["vocab"], [10])[0]
    for adapter in ("a", "b", "a"):
        caches = allocate_kv_caches(model, num_blocks=16, block_size=BLOCK)
        table = [3, 1, 7]
        outputs = []
        with torch.no_grad():
            for start, size in ((0, 6), (6, 3), (9, 1)):
                manager.begin_step([chunk(adapter, size)])
                outputs.append(forward_batch(model, caches, [SeqStep(prompt[start:start + size], start, table)],
                                             BLOCK)[0])
                manager.end_step()
        assert manager.slot_table() == [adapter]
        reference = hf_logits(s["peft"][adapter], prompt)
        torch.testing.assert_close(torch.cat(outputs), reference, atol=TOL, rtol=0)


def test_mixed_batch_equals_each_request_alone(tmp_path: Path) -> None:
    s = _setup("qwen3", tmp_path)
    model, manager = s["model"], s["manager"]
    adapters = ["b", None, "a", "a"]
    prompts = _prompts(s["vocab"], [5, 6, 4, 8], seed=3)

    def run(batch: list[int]) -> list[torch.Tensor]:
        caches = allocate_kv_caches(model, num_blocks=64, block_size=BLOCK)
        steps, next_block = [], 0
        for i in batch:
            blocks = -(-len(prompts[i]) // BLOCK)
            steps.append(SeqStep(prompts[i], 0, list(range(next_block, next_block + blocks))))
            next_block += blocks
        with torch.no_grad():
            manager.begin_step([chunk(adapters[i], len(prompts[i])) for i in batch])
            out = forward_batch(model, caches, steps, BLOCK)
            manager.end_step()
        return out

    mixed = run([0, 1, 2, 3])
    for i in range(4):
        torch.testing.assert_close(mixed[i], run([i])[0], atol=1e-5, rtol=0)


def test_base_only_step_leaves_hooks_off(tmp_path: Path) -> None:
    s = _setup("llama", tmp_path)
    manager = s["manager"]
    assert not manager.begin_step([chunk(None, 3)])
    assert manager.slots.context.batch is None
