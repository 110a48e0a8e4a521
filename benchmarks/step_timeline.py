"""Where does each step's time go on the device, and does the GPU wait for the host? (issue 13)

Runs the offline 256 x (256 -> 128) workload of `gpu_bench.py --suite sampled` (fresh prompts each
run) on one LLM, greedy and sampled, with three CUDA events per step on the compute stream:
at ModelRunner.execute's entry, right after the forward (graph replay or eager model), and at its
return (sampling queued). An event's timestamp is when the GPU reaches it, so per step:

- ``gap_before_ms``: entry event minus the previous step's return event: the GPU idled waiting for
  the host to start this step (scheduling, output processing, staging);
- ``forward_ms``: entry to after-forward (staging copies + forward);
- ``after_forward_ms``: after-forward to return: the sampler's kernels, or, when the host is slower
  at launching them than the GPU at running them, the host's launch time.

Also a micro-benchmark of ``Sampler.sample`` alone on random logits of the batch's shape: host
microseconds per call (launch cost) and device microseconds per call.

    python3 benchmarks/step_timeline.py --shape qwen3-8b --out step_timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402


class StepEvents:
    """Wraps runner.execute and the forward (graph replays, eager model) with CUDA events;
    ``restore()`` puts the wrapped attributes back."""

    def __init__(self, runner: Any, counter: Any) -> None:
        self.steps: list[tuple[Any, Any, Any, bool]] = []
        self._after_forward: Any = None
        self._saved: list[tuple[Any, str, Any]] = []
        inner_execute = runner.execute

        def execute(step: Any, *args: Any, **kwargs: Any) -> Any:
            decode = bool((step.q_lens == 1).all())
            entry = self._event()
            self._after_forward = None
            out = inner_execute(step, *args, **kwargs)
            done = self._event()
            self.steps.append((entry, self._after_forward or done, done, decode))
            return out

        def after_forward(inner: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = inner(*args, **kwargs)
                self._after_forward = self._event()
                return out
            return wrapped

        inner_reset = counter.reset

        def reset() -> None:  # bench_throughput resets after its warm-up: drop the warm-up's steps
            inner_reset()
            self.steps.clear()

        self._patch(runner, "execute", execute)
        self._patch(counter, "reset", reset)
        for holder in (runner.graphs, runner.mixed_graphs):
            if holder is not None:
                self._patch(holder, "replay", after_forward(holder.replay))
        self._patch(runner.model, "forward", after_forward(runner.model.forward))

    def _patch(self, holder: Any, name: str, value: Any) -> None:
        self._saved.append((holder, name, holder.__dict__.get(name)))
        setattr(holder, name, value)

    def restore(self) -> None:
        for holder, name, previous in reversed(self._saved):
            if previous is None:
                holder.__dict__.pop(name, None)
            else:
                setattr(holder, name, previous)

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def summary(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        rows = []
        previous_done = None
        for entry, after, done, decode in self.steps:
            gap = previous_done.elapsed_time(entry) if previous_done is not None else 0.0
            rows.append({"gap_before_ms": gap, "forward_ms": entry.elapsed_time(after),
                         "after_forward_ms": after.elapsed_time(done), "decode": decode})
            previous_done = done

        def part(selected: list[dict[str, Any]]) -> dict[str, Any]:
            if not selected:
                return {}
            out: dict[str, Any] = {"steps": len(selected)}
            for key in ("gap_before_ms", "forward_ms", "after_forward_ms"):
                values = [r[key] for r in selected]
                out[key] = {"sum": sum(values), "median": statistics.median(values), "max": max(values)}
            return out

        return {"all": part(rows), "decode": part([r for r in rows if r["decode"]]),
                "other": part([r for r in rows if not r["decode"]])}


class CollectorWatch:
    """Python's garbage collections during a run: how many of each generation, and their time."""

    def __init__(self) -> None:
        import gc

        self._gc = gc
        self._start = 0.0
        self.collections: list[tuple[int, float]] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections.append((int(info["generation"]), time.perf_counter() - self._start))

    def summary(self) -> dict[str, Any]:
        self._gc.callbacks.remove(self._callback)
        by_gen: dict[str, Any] = {}
        for gen in (0, 1, 2):
            times = [t for g, t in self.collections if g == gen]
            by_gen[f"gen{gen}"] = {"count": len(times), "total_ms": 1e3 * sum(times),
                                   "max_ms": 1e3 * max(times, default=0.0)}
        return {**by_gen, "frozen_objects": self._gc.get_freeze_count()}


def sampler_micro(vocab: int, rows: int, sampling: dict[str, Any] | None, calls: int = 200) -> dict[str, Any]:
    """Sampler.sample alone: host µs per call (to return) and device µs per call."""
    from tidal_engine.executor.plan import SamplingOptions
    from tidal_engine.runner.sampler import Sampler
    from tidal_engine.sampling_params import SamplingParams

    sampler = Sampler(vocab, rows, torch.device("cuda"))
    params = SamplingParams(max_tokens=128, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    options = SamplingOptions(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              min_p=params.min_p)
    ids = [f"r{i}" for i in range(rows)]
    for rid in ids:
        sampler.add_request(rid, options, [1, 2, 3])
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        sampler.sample(logits, ids).result()
    torch.cuda.synchronize()
    host = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    pending = []
    for _ in range(calls):
        t0 = time.perf_counter()
        pending.append(sampler.sample(logits, ids))
        host.append(time.perf_counter() - t0)
        if len(pending) > 2:
            pending.pop(0).result()
    end.record()
    for p in pending:
        p.result()
    torch.cuda.synchronize()
    return {"rows": rows, "host_us_median": 1e6 * statistics.median(host), "host_us_mean": 1e6 * statistics.mean(host),
            "wall_per_call_us": 1e3 * start.elapsed_time(end) / calls}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(gb.SHAPES), default="qwen3-8b")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="greedy_warm,sampled,greedy,sampled_again,greedy_512_prompts",
                    help="which runs, in order (after the sampler micro-benchmark)")
    ap.add_argument("--no-micro", action="store_true", help="skip the sampler micro-benchmark")
    args = ap.parse_args()
    wanted = args.runs.split(",")
    results: dict[str, Any] = {**gb.run_header("step_timeline"), "sampling": gb.SAMPLED}
    out = Path(args.out)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    vocab = gb.SHAPES[args.shape]["vocab_size"]
    for name, sampling in (() if args.no_micro else (("greedy", None), ("sampled", gb.SAMPLED))):
        gb.run_guarded(results, f"sampler_micro_{name}", lambda s=sampling: sampler_micro(vocab, 256, s), save)
    folder = gb.make_model_folder(args.shape, Path(args.models))
    llm, construct_s = gb.make_llm(folder)
    results["llm_construct_s"] = construct_s
    counter = gb.StepCounter(llm.engine.runner)
    # The last run has the served benchmark's 512 prompts: the engine admits 256 and the rest as
    # slots free up, as the server does under 256 concurrent streams, without HTTP.
    for name, seed, sampling, n in (("greedy_warm", 41, None, 256), ("sampled", 43, gb.SAMPLED, 256),
                                    ("greedy", 45, None, 256), ("sampled_again", 47, gb.SAMPLED, 256),
                                    ("greedy_512_prompts", 49, None, 512)):
        if name not in wanted:
            continue
        def one(s: int = seed, p: dict[str, Any] | None = sampling, n: int = n) -> dict[str, Any]:
            events = StepEvents(llm.engine.runner, counter)
            collector = CollectorWatch()
            try:
                result = gb.bench_throughput(llm, args.shape, gb.rand_prompts(n, [256] * n, s, vocab),
                                             [128] * n, counter, p)
                result["timeline"] = events.summary()
            finally:
                events.restore()
                result_gc = collector.summary()
            result["collector"] = result_gc
            return result
        gb.run_guarded(results, name, one, save)
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
