"""GPU memory, sleep/wake and start-up figures for issue 22, on one GPU (the H200).

    python3 benchmarks/memory_bench.py all --out OUT_DIR [--shape qwen3-8b] [--models /tmp/tidal-models]

Stages, each in its own process so that nothing (CUDA context, Triton's in-memory kernels,
torch's caching allocator) carries over between them:

1. ``write``: a random-weight checkpoint of the shape on local disk (``gpu_bench.make_model_folder``:
   real Qwen3 config, bf16 safetensors in 2 GiB shards); the files stay in the page cache.
2. ``engine`` (cold: an empty ``--cache-dir``): ``LLM()`` construction at
   ``gpu_memory_utilization`` 0.9 with sleep mode; the device memory used awake; sleep level 1
   twice (the first allocates the pinned host buffer, the second reuses it), wake from level 1,
   sleep and wake level 2; the greedy output of four prompts after every wake against before.
3. ``construct`` (warm: the cache dir that stage 2 filled): ``LLM()`` construction only.
4. ``pair``: two engines at ``gpu_memory_utilization`` 0.45 each, the second started once the
   first is up, then both generating at once (256 × 256 → 128 tokens each); the device's used
   memory is polled with nvidia-smi throughout. Passes when both finish every request (no OOM).

``all`` runs the four (``--stages`` picks others) and writes ``memory-<shape>.json`` with the command, commit and date
(``TIDAL_COMMIT``, ``TIDAL_BENCH_DATE``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GiB = float(1 << 30)


def _llm(folder: Path, **options: Any) -> tuple[Any, float]:
    from tidal_engine import LLM

    opts: dict[str, Any] = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, seed=0)
    opts.update(options)
    start = time.perf_counter()
    llm = LLM(str(folder), **opts)
    return llm, time.perf_counter() - start


def _used() -> tuple[int, int]:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free, total


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from tidal_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(n: int, length: int, seed: int, vocab: int = 151936) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------- stages

def stage_write(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from gpu_bench import make_model_folder

    start = time.perf_counter()
    folder = make_model_folder(args.shape, Path(args.models))
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"folder": str(folder), "checkpoint_bytes": size, "write_s": time.perf_counter() - start}


def stage_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    folder = Path(args.models) / args.shape
    torch.cuda.init()
    before, total = _used()
    llm, construct_s = _llm(folder, gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=args.cache_dir)
    engine = llm.engine
    runner = engine.runner
    used_awake, _ = _used()
    res: dict[str, Any] = {
        "construct_s": construct_s,
        "device_total_bytes": total,
        "device_used_before_bytes": before,
        "device_used_awake_bytes": used_awake,
        "device_used_awake_fraction": used_awake / total,
        "memory_report": runner.memory_report,
        "kv_blocks": runner.num_blocks,
        "fixed_address_weights": runner.weights.stable_addresses,
        "startup_seconds": getattr(runner, "startup_seconds", None),
        "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
        "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None,
    }
    prompts = _prompts(4, 64, 1)
    reference = _greedy(llm, prompts, 32)
    graphs = runner.graphs
    checks: dict[str, bool] = {}
    for label, level in (("sleep1_first", 1), ("sleep1_again", 1), ("sleep2", 2)):
        t = time.perf_counter()
        engine.sleep(level)
        res[f"{label}_s"] = time.perf_counter() - t
        res[f"{label}_device_used_bytes"] = _used()[0]
        t = time.perf_counter()
        engine.wake_up()
        torch.cuda.synchronize()
        res[f"wake_after_{label}_s"] = time.perf_counter() - t
        checks[f"greedy_equal_after_{label}"] = _greedy(llm, prompts, 32) == reference
        checks[f"graphs_kept_after_{label}"] = runner.graphs is graphs
    res["checks"] = checks
    res["device_used_after_wakes_bytes"] = _used()[0]
    return res


def stage_construct(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.models) / args.shape
    llm, construct_s = _llm(folder, gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=args.cache_dir)
    runner = llm.engine.runner
    return {"construct_s": construct_s, "kv_blocks": runner.num_blocks,
            "startup_seconds": getattr(runner, "startup_seconds", None),
            "engine_core_seconds": getattr(llm.engine.core, "startup_seconds", None),
            "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
            "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None}


def stage_load(args: argparse.Namespace) -> dict[str, Any]:
    """One engine of the pair: construct at ``--util``, say so, wait for the go, generate."""
    folder = Path(args.models) / args.shape
    llm, construct_s = _llm(folder, gpu_memory_utilization=args.util, cache_dir=args.cache_dir)
    runner = llm.engine.runner
    Path(args.ready).write_text("ready")
    deadline = time.time() + 300
    while not Path(args.go).exists():
        if time.time() > deadline:
            raise TimeoutError("no go signal")
        time.sleep(0.05)
    from tidal_engine import SamplingParams

    prompts = _prompts(256, 256, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    return {"construct_s": construct_s, "util": args.util, "memory_report": runner.memory_report,
            "kv_blocks": runner.num_blocks, "requests": len(outs), "all_complete": all(n == 128 for n in lengths),
            "output_tokens": sum(lengths), "generate_s": elapsed, "output_tok_per_s": sum(lengths) / elapsed}


def _nvidia_used() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split(",")
        return int(float(out[0])) << 20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def stage_pair(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(args.models) / "pair"
    tmp.mkdir(parents=True, exist_ok=True)
    go = tmp / "go"
    go.unlink(missing_ok=True)
    procs, outs = [], []
    samples: list[int] = []
    for i in range(2):
        ready, out = tmp / f"ready{i}", tmp / f"engine{i}.json"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "load", "--shape", args.shape, "--models", args.models, "--util", "0.45",
               "--ready", str(ready), "--go", str(go), "--seed", str(10 + i), "--json", str(out),
               "--cache-dir", args.cache_dir or ""]
        procs.append(subprocess.Popen(cmd))
        outs.append(out)
        deadline = time.time() + 240
        while not ready.exists():  # the second starts once the first holds its share
            if procs[-1].poll() is not None or time.time() > deadline:
                break
            time.sleep(0.2)
    samples.append(_nvidia_used() or 0)
    go.write_text("go")
    while any(p.poll() is None for p in procs):
        used = _nvidia_used()
        if used is not None:
            samples.append(used)
        time.sleep(0.5)
    engines = [json.loads(o.read_text()) if o.exists() else {"error": "no result"} for o in outs]
    ok = all(p.returncode == 0 for p in procs) and all(e.get("all_complete") for e in engines)
    return {"engines": engines, "return_codes": [p.returncode for p in procs],
            "device_used_both_up_bytes": samples[0], "device_used_peak_bytes": max(samples),
            "passed": ok}


STAGES = {"write": stage_write, "engine": stage_engine, "construct": stage_construct, "load": stage_load,
          "pair": stage_pair}


def _git_commit() -> str:
    return os.environ.get("TIDAL_COMMIT") or "unknown"


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "python3 benchmarks/memory_bench.py " + " ".join(sys.argv[1:]),
        "commit": _git_commit(), "date": os.environ.get("TIDAL_BENCH_DATE") or time.strftime("%Y-%m-%d"),
        "shape": args.shape, "max_model_len": 4096, "max_num_seqs": 256, "dtype": "bfloat16",
    }
    path = out / (args.result_name or f"memory-{args.shape}.json")
    cache = args.cache_dir or str(Path(args.models) / "cache")
    for i, stage in enumerate(args.stages.split(",")):
        key = stage if stage not in result else f"{stage}_{i}"
        print(f"=== {key} {time.strftime('%T')}", flush=True)
        stage_json = Path(args.models) / f"{key}.json"
        stage_json.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, stage, "--shape", args.shape, "--models", args.models, "--out", args.out,
               "--json", str(stage_json), "--cache-dir", cache]
        t = time.perf_counter()
        try:
            rc: int | str = subprocess.run(cmd, timeout=args.stage_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.stage_timeout} s"
        result[key] = json.loads(stage_json.read_text()) if stage_json.exists() else {"error": f"exit {rc}"}
        result[key]["stage_wall_s"] = time.perf_counter() - t
        path.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({key: result[key]}, default=str)[:3000], flush=True)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["all", *STAGES])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--models", default="/tmp/tidal-models")
    parser.add_argument("--out", default="out")
    parser.add_argument("--json", default=None, help="(a stage) where to write its result")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--util", type=float, default=0.45)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--go", default=None)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--stage-timeout", type=int, default=240)
    parser.add_argument("--stages", default="write,engine,construct,pair",
                        help="(all) the stages in order; a repeated one is recorded as <stage>_<position>")
    parser.add_argument("--result-name", default=None, help="(all) the result file's name (default memory-<shape>.json)")
    args = parser.parse_args()
    args.cache_dir = args.cache_dir or None
    if args.stage == "all":
        run_all(args)
        return
    result = STAGES[args.stage](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
