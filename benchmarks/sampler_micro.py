"""Sampler micro-benchmark: time per ``Sampler.sample()`` step on one GPU (CUDA events).

Usage: python benchmarks/sampler_micro.py --out benchmarks/results/sampler_micro_h200.json
       [--batch 256] [--vocab 151936] [--iters 50] [--dtype bfloat16] [--device cuda]

Workloads (every row of the batch alike, unless said):
  greedy        temperature 0: the single-argmax fast path
  topk_topp     temperature 0.8, top_k 50, top_p 0.95: topk candidates, no full sort
  topp_only     temperature 0.8, top_p 0.95: the stable-sort path
  plain         temperature 1.0: inverse CDF over the whole vocabulary
  seeded        temperature 0.8, top_k 50, top_p 0.95, a seed per row (hashed counters)
  penalties     temperature 0.8, top_k 50, top_p 0.95, repetition 1.1, frequency 0.2,
                presence 0.2 (device counts, updated every step)
  logprobs      temperature 0.8, top_k 50, top_p 0.95, logprobs 5
  mixed         a quarter each of greedy, topk_topp, topp_only and seeded+penalties rows

Each step samples from the same logits; the sampler's device state advances every step.
``ms`` is the device time per step between CUDA events around ``iters`` back-to-back
``sample()`` calls (no ``result()`` inside, as with async scheduling); ``ms_with_result``
waits for the host copy each step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from tidal_engine.executor.plan import SamplingOptions
from tidal_engine.runner.sampler import Sampler

TOPK_TOPP = dict(temperature=0.8, top_k=50, top_p=0.95)


def workloads(batch: int) -> dict[str, list[SamplingOptions]]:
    def same(**kwargs: object) -> list[SamplingOptions]:
        return [SamplingOptions(**kwargs) for _ in range(batch)]  # type: ignore[arg-type]

    quarter = batch // 4
    mixed = (
        [SamplingOptions(temperature=0.0)] * quarter
        + [SamplingOptions(**TOPK_TOPP)] * quarter  # type: ignore[arg-type]
        + [SamplingOptions(temperature=0.8, top_p=0.95)] * quarter
        + [SamplingOptions(seed=i, repetition_penalty=1.1, frequency_penalty=0.2, **TOPK_TOPP)  # type: ignore[arg-type]
           for i in range(batch - 3 * quarter)]
    )
    return {
        "greedy": same(temperature=0.0),
        "topk_topp": same(**TOPK_TOPP),
        "topp_only": same(temperature=0.8, top_p=0.95),
        "plain": same(temperature=1.0),
        "seeded": [SamplingOptions(seed=1000 + i, **TOPK_TOPP) for i in range(batch)],  # type: ignore[arg-type]
        "penalties": same(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2, **TOPK_TOPP),
        "logprobs": same(logprobs=5, **TOPK_TOPP),
        "mixed": mixed,
    }


def bench(name: str, options: list[SamplingOptions], logits: torch.Tensor, iters: int, device: torch.device) -> dict:
    batch, vocab = logits.shape
    sampler = Sampler(vocab, batch, device)
    req_ids = [f"{name}-{i}" for i in range(batch)]
    prompt = list(range(0, 2000, 7))
    for req_id, opts in zip(req_ids, options):
        sampler.add_request(req_id, opts, prompt)
    for _ in range(5):  # warm-up (pinned buffers, lazily allocated tensors)
        sampler.sample(logits, req_ids).result()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    last = None
    for _ in range(iters):
        last = sampler.sample(logits, req_ids)
    end.record()
    end.synchronize()
    assert last is not None
    last.result()
    ms = start.elapsed_time(end) / iters
    start.record()
    for _ in range(iters):
        sampler.sample(logits, req_ids).result()
    end.record()
    end.synchronize()
    return {"ms": round(ms, 4), "ms_with_result": round(start.elapsed_time(end) / iters, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="*", help="run only these workloads")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    # Model-like logits: a few strong candidates over a long tail.
    logits = (torch.randn(args.batch, args.vocab, device=device) * 2.0).to(getattr(torch, args.dtype))
    results: dict[str, dict] = {}
    for name, options in workloads(args.batch).items():
        if args.only and name not in args.only:
            continue
        results[name] = bench(name, options, logits, args.iters, device)
        print(f"{name:12s} {results[name]['ms']:8.3f} ms/step  ({results[name]['ms_with_result']:.3f} with result())")
    report = {
        "benchmark": "sampler_micro",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "batch": args.batch,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "iters": args.iters,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
