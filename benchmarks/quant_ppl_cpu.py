"""SmolLM2-135M quantized by Tidal's quantizer into each weight format, loaded by the engine
from the written folder: perplexity on tests/engine/data/perplexity_text.txt and the greedy
answer to a factual question, against the same model in float32 (CPU).

Usage: TIDAL_COMMIT=<sha> TIDAL_BENCH_DATE=2026-12-01 \\
       python benchmarks/quant_ppl_cpu.py --out benchmarks/results/cpu-2026-12-01-quant/smollm2-int4-ppl.json

INT4 uses group size 64: SmolLM2's hidden size (576) is not a multiple of 128. The GGUF file
the model comes from is itself 4-bit (Q4_1, groups of 32); "float32" is its dequantized
weights, and every format here is quantized again from those.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from tidal_engine import LLM, SamplingParams
from tidal_engine.models.loader import resolve_model
from tidal_engine.quantization.quantizer import write_quantized_model

TEXT = Path(__file__).resolve().parents[1] / "tests" / "engine" / "data" / "perplexity_text.txt"
QUESTION = "What is the capital of France?"
# (label, --quantization or the checkpoint's method, group size, symmetric); None: plain float32.
FORMATS: list[tuple[str, str | None, int, bool]] = [
    ("float32", None, 0, False),
    ("fp8-online", "fp8", 0, False),
    ("awq-g64-asym", "awq", 64, False),
    ("awq-g64-sym", "awq", 64, True),
    ("gptq-g64-asym", "gptq", 64, False),
    ("gptq-g64-sym", "gptq", 64, True),
]


class CachedSource:
    """The GGUF's weights dequantized once for every format (the slow part)."""

    def __init__(self, model: str) -> None:
        source = resolve_model(model)
        self.arch_config, self.load_tokenizer = source.arch_config, source.load_tokenizer
        self.weights = list(source.load_weights())

    def load_weights(self) -> list:
        return self.weights


def measure(llm: LLM, tokens: list[int]) -> dict:
    (scored,) = llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    logprobs = [position[token].logprob for position, token in zip(scored.prompt_logprobs[1:], tokens[1:])]
    [answer] = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0.0, max_tokens=24))
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "scored_tokens": len(logprobs),
            "answer": answer.outputs[0].text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    source = CachedSource(args.model)
    tokens = source.load_tokenizer()(TEXT.read_text())["input_ids"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = resolve_model(args.model).path
        for label, method, group, symmetric in FORMATS:
            model, quantization = str(plain), method
            if method in ("awq", "gptq"):
                folder = Path(tmp) / label
                write_quantized_model(source, folder, method, group_size=group, symmetric=symmetric)  # type: ignore[arg-type]
                model, quantization = str(folder), None  # the method comes from the checkpoint
            llm = LLM(model, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=32 << 20,
                      quantization=quantization)
            results[label] = measure(llm, tokens)
            del llm
            print(label, results[label], flush=True)
    base = results["float32"]["perplexity"]
    for row in results.values():
        row["vs_float32"] = round(row["perplexity"] / base - 1, 4)
    commit = os.environ.get("TIDAL_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "quant_ppl_cpu", "model": args.model, "text": "tests/engine/data/perplexity_text.txt",
        "command": f"python benchmarks/quant_ppl_cpu.py --out {args.out}",
        "commit": commit, "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(), "threads": os.cpu_count(), "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
