"""SmolLM2-135M quantized to FP8 while loading: perplexity on a fixed text (tests/engine/data/
perplexity_text.txt) within +3% of float32, and it still answers "Paris". The same model written
by Tidal's quantizer as a GPTQ checkpoint (INT4, groups of 64) and loaded from disk: within
+25% (round-to-nearest, no calibration; benchmarks/results/cpu-2026-12-01-quant has every format),
and it answers "Paris" too.

(INT4 g128 cannot be tested on this model: its hidden size, 576, is not a multiple of 128.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tidal_engine import LLM, SamplingParams
from tidal_engine.models.loader import HFFolderSource, ModelSource, load_model, resolve_model
from tidal_engine.quantization.quantizer import write_quantized_model

from tiny_models import SeqStep, forward_batch

pytestmark = pytest.mark.slow
TEXT = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()


class CachedSource:
    """SmolLM2's GGUF weights dequantized once for both models (the slow part of loading)."""

    def __init__(self) -> None:
        source = resolve_model("smollm2-135m")
        self.arch_config, self.load_tokenizer = source.arch_config, source.load_tokenizer
        self.tokens = source.load_tokenizer()(TEXT)["input_ids"]
        self.weights = list(source.load_weights())

    def load_weights(self) -> list[tuple[str, torch.Tensor]]:
        return self.weights

    load_weight_slices = load_weights


@pytest.fixture(scope="module")
def smollm2() -> CachedSource:
    return CachedSource()


@pytest.fixture(scope="module")
def fp32_perplexity(smollm2: CachedSource) -> float:
    return perplexity(smollm2, smollm2.tokens, None)


def perplexity(source: ModelSource | CachedSource, tokens: list[int], quantization: str | None) -> float:
    model = load_model(source, torch.float32, "cpu", quantization=quantization)  # type: ignore[arg-type]
    cfg = model.config
    blocks = len(tokens) // 16 + 1
    caches = [torch.zeros(2, blocks, 16, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    logits = forward_batch(model, caches, [SeqStep(tokens, 0, list(range(blocks)))], 16)[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]))
    return math.exp(nll.item())


def test_fp8_perplexity_within_3_percent_of_fp32(smollm2: CachedSource, fp32_perplexity: float) -> None:
    fp32, fp8 = fp32_perplexity, perplexity(smollm2, smollm2.tokens, "fp8")
    print(f"perplexity fp32 {fp32:.3f} fp8 {fp8:.3f} ({fp8 / fp32 - 1:+.2%})")
    assert fp8 <= fp32 * 1.03


def test_fp8_answers_paris() -> None:
    llm = LLM("smollm2-135m", dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20, quantization="fp8")
    [output] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in output.outputs[0].text


def test_gptq_int4_g64_checkpoint_perplexity_and_answer(smollm2: CachedSource, fp32_perplexity: float,
                                                        tmp_path: Path) -> None:
    write_quantized_model(smollm2, tmp_path, "gptq", group_size=64, symmetric=True)  # type: ignore[arg-type]
    fp32 = fp32_perplexity
    int4 = perplexity(HFFolderSource(tmp_path), smollm2.tokens, None)  # gptq, from config.json
    print(f"perplexity fp32 {fp32:.3f} gptq g64 {int4:.3f} ({int4 / fp32 - 1:+.2%})")
    assert int4 <= fp32 * 1.25
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    # "The capital of France is Paris": 7 tokens (INT4 runs dequantize-then-multiply on CPU: slow).
    [output] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in output.outputs[0].text
