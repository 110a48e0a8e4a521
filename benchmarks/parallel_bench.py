"""Tensor and pipeline parallelism on one multi-GPU machine (issue 14's table).

Usage (on the GPU machine, from the repository root; one configuration per process, so
each starts on empty GPUs):

    PYTHONPATH=engine TRITON_INTERPRET=0 python benchmarks/parallel_bench.py \
        --shape qwen3-8b --tp 2 --pp 1 --out results/tp2-8b.json [--skip throughput] [--dummy]

Benchmarks (the offline ``LLM``, greedy, EOS ignored, random token prompts, as gpu_bench):
  single_stream   128 -> 256 tokens, batch 1 (gpu_bench.bench_single_stream): end-to-end
                  output tok/s and the decode-only rate.
  throughput      256 requests of 256 -> 128, all submitted at once: output tok/s.

``--summarize DIR``: no benchmark; reads DIR's ``parallel-<shape>-tp<T>-pp<P>.json`` files and
writes ``DIR/summary.json`` (and prints it): each configuration's output tok/s and its ratio to
the same shape at TP=1 × PP=1, which is the issue's TP=2 vs TP=1 and PP=2 vs PP=1 figure. The
PP comparison on two GPUs, in one command (docs/parallelism.md):

    CONFIGS="qwen3-8b:1:1 qwen3-8b:1:2" TEST_FILES=tests/engine/test_tensor_parallel_gpu.py SERVE=0 \
        bash benchmarks/run_parallel_h200.sh

``max_batches_in_flight`` in each result: the most batches the engine core had in flight at once
(pipeline parallelism keeps up to PP; 1 otherwise).

``--dummy``: random weights made on the device (``load_format="dummy"``), for shapes whose
checkpoint would take minutes to write (Qwen3-32B: 65 GB); the folder then holds the
config, the tokenizer and one tiny safetensors file. Otherwise the weights are the random
bf16 checkpoint of gpu_bench.make_model_folder, read through the sharded loader.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench  # noqa: E402

gpu_bench.SHAPES.setdefault(
    "qwen3-32b",  # Qwen/Qwen3-32B config.json
    dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
         intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960),
)


def config_only_folder(shape: str, root: Path) -> Path:
    """config.json, tokenizer, and a one-tensor safetensors file (the loader wants one)."""
    from safetensors.torch import save_file

    folder = root / f"{shape}-config-only"
    if (folder / "done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = gpu_bench.hf_config(shape)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({"model.norm.weight": torch.ones(cfg["hidden_size"], dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    gpu_bench.save_tokenizer(folder, cfg["vocab_size"])
    (folder / "done").write_text("ok")
    return folder


def bench_throughput(llm: Any, shape: str) -> dict[str, Any]:
    from tidal_engine import SamplingParams

    vocab = gpu_bench.SHAPES[shape]["vocab_size"]
    llm.generate(gpu_bench.rand_prompts(8, [64] * 8, 5, vocab), gpu_bench.greedy(8))  # warm-up
    prompts = gpu_bench.rand_prompts(256, [256] * 256, 1, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    gpu_bench.sync()
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in out)
    assert n_out == 256 * 128, n_out
    stats = llm.engine.get_stats()
    return {"requests": 256, "input_tokens": 256 * 256, "output_tokens": n_out, "elapsed_s": elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (256 * 256 + n_out) / elapsed,
            "max_running": stats.max_num_running_seen, "preemptions": stats.num_preemptions,
            "max_batches_in_flight": llm.engine.core.max_batches_in_flight}


def summarize(folder: Path) -> dict[str, Any]:
    """Output tok/s per configuration and its ratio to TP=1 × PP=1 of the same shape."""
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("parallel-*-tp*-pp*.json")):
        r = json.loads(path.read_text())
        row: dict[str, Any] = {"shape": r["shape"]["name"], "tp": r["tensor_parallel_size"],
                               "pp": r["pipeline_parallel_size"], "commit": r.get("commit")}
        for bench in ("single_stream", "throughput"):
            got = r.get(bench) or {}
            tok_s = got.get("output_tok_s_median", got.get("output_tok_s"))
            if tok_s is not None:
                row[f"{bench}_output_tok_s"] = tok_s
        rows[path.stem] = row
    for row in rows.values():
        base = rows.get(f"parallel-{row['shape']}-tp1-pp1")
        for bench in ("single_stream", "throughput"):
            key = f"{bench}_output_tok_s"
            if base is not None and key in row and key in base:
                row[f"{bench}_vs_tp1_pp1"] = row[key] / base[key]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", metavar="DIR", help="write DIR/summary.json from DIR's results; no benchmark")
    ap.add_argument("--shape", choices=sorted(gpu_bench.SHAPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dummy", action="store_true")
    ap.add_argument("--skip", default="")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.summarize:
        summary = summarize(Path(args.summarize))
        (Path(args.summarize) / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        return
    if not args.shape or not args.out:
        ap.error("--shape and --out are required (or --summarize DIR)")
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "benchmark": f"parallel_bench {args.shape} tp={args.tp} pp={args.pp}",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "commit": os.environ.get("TIDAL_COMMIT", "unknown"),
        "date": os.environ.get("TIDAL_BENCH_DATE", "unknown"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__,
        "shape": {"name": args.shape, **gpu_bench.SHAPES[args.shape]},
        "tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
        "weights": "dummy (random, made on the device)" if args.dummy else "random bf16 checkpoint, sharded loader",
    }

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    root = Path(args.models)
    folder = config_only_folder(args.shape, root) if args.dummy else gpu_bench.make_model_folder(args.shape, root)
    options: dict[str, Any] = dict(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    if args.dummy:
        options["load_format"] = "dummy"
    llm, startup = gpu_bench.make_llm(folder, **options)
    results["startup_s"] = startup
    results["kv_blocks_per_rank"] = llm.engine.core.executor.num_kv_blocks
    save()
    if "single_stream" not in skip:
        gpu_bench.run_guarded(results, "single_stream", lambda: gpu_bench.bench_single_stream(llm, args.shape), save)
    if "throughput" not in skip:
        gpu_bench.run_guarded(results, "throughput", lambda: bench_throughput(llm, args.shape), save)
    llm.engine.shutdown()
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
