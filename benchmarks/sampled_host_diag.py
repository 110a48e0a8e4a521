"""Why is offline sampled 256 x (256 -> 128) slower than greedy on the same engine (issue 13)?

Runs the workload of `gpu_bench.py --suite sampled` in the order sampled, greedy, sampled, greedy
(fresh prompts each time) on one LLM, and records for each run the throughput, the host time split
of gpu_bench's StepCounter, the CUDA caching allocator's counters (device mallocs/frees and
retries: each can stall the host) and the Triton kernels compiled during the run.
A fourth sampled run goes through torch.profiler: the CUDA runtime calls the host spent most time
in, and how long the GPU sat idle between kernels (gaps over 0.2 ms, summed).

    python3 benchmarks/sampled_host_diag.py --shape qwen3-8b --out sampled_host_diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402

ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
COMPILES: list[list[Any]] = []  # [kernel, start, seconds]: Triton JIT compiles (or disk-cache loads)


def watch_triton_compiles() -> None:
    from triton import knobs

    def before(*args: Any, **kwargs: Any) -> bool:
        COMPILES.append([str(kwargs.get("repr", "?"))[:160], time.perf_counter(), None])
        return False  # go on and compile

    def after(*args: Any, **kwargs: Any) -> bool:
        if COMPILES and COMPILES[-1][2] is None:
            COMPILES[-1][2] = time.perf_counter() - COMPILES[-1][1]
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_KEYS}


def run(llm: Any, shape: str, counter: Any, seed: int, sampling: dict[str, Any] | None) -> dict[str, Any]:
    vocab = gb.SHAPES[shape]["vocab_size"]
    prompts = gb.rand_prompts(256, [256] * 256, seed, vocab)
    before = allocator_counts()
    compiles_before = len(COMPILES)
    result = gb.bench_throughput(llm, shape, prompts, [128] * 256, counter, sampling)
    after = allocator_counts()
    result["allocator_delta"] = {k: after[k] - before[k] for k in ALLOCATOR_KEYS}
    new = COMPILES[compiles_before:]
    result["triton_compiles"] = {"count": len(new), "seconds": sum(c[2] or 0.0 for c in new),
                                 "kernels": [[c[0], c[2]] for c in new]}
    return result


def gpu_idle_gaps(events: list[Any], threshold_us: float = 200.0) -> dict[str, float]:
    """Kernel intervals on the device → busy time (their union) and the idle gaps between them."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy = 0.0
    gaps: list[float] = []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    big = [g for g in gaps if g > threshold_us]
    return {"span_ms": (spans[-1][1] - spans[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "gaps_over_threshold": len(big), "gap_ms_over_threshold": sum(big) / 1e3, "threshold_us": threshold_us}


def profiled_run(llm: Any, shape: str, counter: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = run(llm, shape, counter, 21, gb.SAMPLED)
    runtime = [e for e in prof.key_averages() if e.key.startswith("cuda") and not e.key.startswith("cudaLaunch")]
    runtime.sort(key=lambda e: e.cpu_time_total, reverse=True)
    result["cuda_runtime_calls"] = [{"name": e.key, "count": e.count, "total_ms": e.cpu_time_total / 1e3}
                                    for e in runtime[:12]]
    result["gpu"] = gpu_idle_gaps(list(prof.events()))
    return result


def cprofiled_run(llm: Any, shape: str, counter: Any, seed: int, sampling: dict[str, Any] | None,
                  out: Path) -> dict[str, Any]:
    """One run under cProfile (the host slows ~2x, so the run is host-bound throughout): where the
    engine's host time goes, written to ``out`` by own and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    result = run(llm, shape, counter, seed, sampling)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(60)
    out.write_text(text.getvalue())
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(gb.SHAPES), default="qwen3-8b")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cprofile", action="store_true",
                    help="instead: a warm-up greedy run, then a sampled and a greedy run under cProfile "
                         "(their profiles next to --out)")
    args = ap.parse_args()
    results: dict[str, Any] = {**gb.run_header("sampled_host_diag"), "sampling": gb.SAMPLED}
    out = Path(args.out)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    watch_triton_compiles()
    folder = gb.make_model_folder(args.shape, Path(args.models))
    llm, construct_s = gb.make_llm(folder)
    results["llm_construct_s"] = construct_s
    results["triton_compiles_at_start"] = len(COMPILES)
    counter = gb.StepCounter(llm.engine.runner)
    if args.cprofile:
        gb.run_guarded(results, "greedy_warm_up", lambda: run(llm, args.shape, counter, 31, None), save)
        for name, seed, sampling in (("sampled_cprofile", 33, gb.SAMPLED), ("greedy_cprofile", 35, None)):
            target = out.with_name(f"{out.stem}_{name}.txt")
            gb.run_guarded(results, name, lambda s=seed, p=sampling, t=target: cprofiled_run(
                llm, args.shape, counter, s, p, t), save)
        save()
        print("done", out, flush=True)
        return
    # Fresh prompts for every run (the same ones again would hit the prefix cache).
    for name, seed, sampling in (("sampled_first", 11, gb.SAMPLED), ("greedy", 13, None),
                                 ("sampled_second", 15, gb.SAMPLED), ("greedy_second", 17, None)):
        gb.run_guarded(results, name, lambda s=seed, p=sampling: run(llm, args.shape, counter, s, p), save)
    gb.run_guarded(results, "sampled_profiled", lambda: profiled_run(llm, args.shape, counter), save)
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
