"""SmolLM2-135M quantized to FP8 while loading: perplexity on a fixed text (tests/engine/data/
perplexity_text.txt) within +3% of float32, and it still answers "Paris".

(INT4 g128 cannot be tested on this model: its hidden size, 576, is not a multiple of 128.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tidal_engine import LLM, SamplingParams
from tidal_engine.models.loader import load_model, resolve_model

from tiny_models import SeqStep, forward_batch

pytestmark = pytest.mark.slow
TEXT = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()


class CachedSource:
    """SmolLM2's GGUF weights dequantized once for both models (the slow part of loading)."""

    def __init__(self) -> None:
        source = resolve_model("smollm2-135m")
        self.arch_config = source.arch_config
        self.tokens = source.load_tokenizer()(TEXT)["input_ids"]
        self.weights = list(source.load_weights())

    def load_weight_slices(self) -> list[tuple[str, torch.Tensor]]:
        return self.weights


@pytest.fixture(scope="module")
def smollm2() -> CachedSource:
    return CachedSource()


def perplexity(source: CachedSource, quantization: str | None) -> float:
    tokens = source.tokens
    model = load_model(source, torch.float32, "cpu", quantization=quantization)  # type: ignore[arg-type]
    cfg = model.config
    blocks = len(tokens) // 16 + 1
    caches = [torch.zeros(2, blocks, 16, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    logits = forward_batch(model, caches, [SeqStep(tokens, 0, list(range(blocks)))], 16)[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]))
    return math.exp(nll.item())


def test_fp8_perplexity_within_3_percent_of_fp32(smollm2: CachedSource) -> None:
    fp32, fp8 = perplexity(smollm2, None), perplexity(smollm2, "fp8")
    print(f"perplexity fp32 {fp32:.3f} fp8 {fp8:.3f} ({fp8 / fp32 - 1:+.2%})")
    assert fp8 <= fp32 * 1.03


def test_fp8_answers_paris() -> None:
    llm = LLM("smollm2-135m", dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20, quantization="fp8")
    [output] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in output.outputs[0].text
