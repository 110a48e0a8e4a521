"""What the GPU does between two decode graphs of one stream (issue 15's single-stream target).

A diagnostic, not a speed claim. One LLM (Qwen3 shape, random weights, ``--quantization`` as in
``gpu_bench.py --suite quant``), one greedy 128 -> ``--tokens`` request under torch.profiler. The
trace's device events are split by what launched them: the kernels of a ``cudaGraphLaunch`` (the
captured decode step) and everything else. Per decode step, from the end of one graph's last
kernel to the end of the next graph's:

- ``graph_ms``: the graph's span on the device (first kernel start to last kernel end);
- ``between_ms``: from one graph's end to the next graph's start, split into ``ops_ms`` (the
  device time of the non-graph kernels and copies run there) and ``idle_ms`` (nothing ran);
- ``ops``: those kernels and copies by name, with their median time a step.

    python3 benchmarks/single_stream_timeline.py --shape qwen3-8b --quantization gptq --out t.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events_by_launch(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace's device events, split into those launched by a graph launch and the rest
    (matched on the runtime call's correlation id)."""
    events = trace["traceEvents"]
    graph_correlations = {e["args"]["correlation"] for e in events
                          if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")
                          and "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    in_graph = [e for e in device if e.get("args", {}).get("correlation") in graph_correlations]
    outside = [e for e in device if e.get("args", {}).get("correlation") not in graph_correlations]
    return in_graph, outside


def graph_spans(in_graph: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) in µs of each graph launch's kernels on the device."""
    by_launch: dict[int, list[float]] = defaultdict(lambda: [float("inf"), 0.0])
    for e in in_graph:
        span = by_launch[e["args"]["correlation"]]
        span[0] = min(span[0], e["ts"])
        span[1] = max(span[1], e["ts"] + e["dur"])
    return sorted((a, b) for a, b in by_launch.values())


def between_graphs(spans: list[tuple[float, float]], outside: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair of consecutive graphs: the graph's span, the gap after it, the non-graph ops in
    that gap (device time and names) and the idle rest."""
    steps = []
    names: dict[str, list[float]] = defaultdict(list)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        ops = [e for e in outside if a1 <= e["ts"] < b0]
        per_name: dict[str, float] = defaultdict(float)
        for e in ops:
            per_name[e["name"][:100]] += e["dur"]
        for name, dur in per_name.items():
            names[name].append(dur)
        busy = _union([(max(e["ts"], a1), min(e["ts"] + e["dur"], b0)) for e in ops])
        steps.append({"graph_ms": (a1 - a0) / 1e3, "between_ms": (b0 - a1) / 1e3, "ops_ms": busy / 1e3,
                      "idle_ms": (b0 - a1 - busy) / 1e3, "ops": len(ops)})
    if not steps:
        return {"error": "fewer than two graph launches in the trace"}

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    return {
        "steps": len(steps),
        "graph_ms_median": median("graph_ms"), "between_ms_median": median("between_ms"),
        "ops_ms_median": median("ops_ms"), "idle_ms_median": median("idle_ms"),
        "ops_per_step_median": median("ops"),
        "ops": sorted(({"name": n, "steps_seen": len(d), "us_median": statistics.median(d)} for n, d in names.items()),
                      key=lambda r: -r["us_median"] * r["steps_seen"]),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, t in sorted(intervals):
        if t <= end:
            continue
        total += t - max(s, end)
        end = t
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(gb.SHAPES), default="qwen3-8b")
    ap.add_argument("--quantization", default="gptq", help="none, fp8, awq or gptq (as gpu_bench --suite quant)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    root = Path(args.models)
    quant = args.quantization
    if quant in ("awq", "gptq"):
        folder, flag = gb.quantized_config_folder(args.shape, root, quant), None
    else:
        folder, flag = gb.make_config_folder(args.shape, root), None if quant == "none" else quant
    llm, _ = gb.make_llm(folder, load_format="dummy", skip_tokenizer_init=True, quantization=flag)
    vocab = gb.SHAPES[args.shape]["vocab_size"]
    llm.generate(gb.rand_prompts(1, [128], 99, vocab), gb.greedy(16))  # warm-up
    gb.sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(gb.rand_prompts(1, [128], 100, vocab), gb.greedy(args.tokens))
        gb.sync()
    trace_path = Path(args.out).with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace_path))
    in_graph, outside = device_events_by_launch(json.loads(trace_path.read_text()))
    trace_path.unlink()
    results = {**gb.run_header(f"single_stream_timeline {args.shape} {quant}"), "quantization": quant,
               "tokens": args.tokens, **between_graphs(graph_spans(in_graph), outside)}
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "ops"}), flush=True)
    for row in results.get("ops", [])[:20]:
        print(f"  {row['us_median']:8.2f} us x{row['steps_seen']:4d}  {row['name']}", flush=True)
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
