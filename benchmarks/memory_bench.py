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

Further stages: ``basics`` (seconds for the CUDA context, importing Triton and transformers, the
tokenizer, locking 1 GiB of host memory), ``profile`` (a warm construction under cProfile: the
functions that took the time), ``nowarm`` (the CUDA graphs' single warm-up run checked with an
empty cache dir: replays against eager runs), ``switch`` (``gpu_share_switch_bench.py``: two engines of a GPU-share group taking turns through the
router), ``construct_tokfirst`` (``construct`` with the tokenizer loaded before the workers, as
before), ``cold_plain`` (a cold construction in a fresh cache dir the way start-up ran before:
tokenizer first, no compile-ahead). The stages that generate record the greedy tokens of the
same prompts; ``greedy_equal_across_stages`` compares them. ``--dummy`` runs on a config-only folder with ``load_format="dummy"`` (nothing read from
disk; a quick look, not the figures).

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


def _folder(args: argparse.Namespace) -> Path:
    return Path(args.models) / (f"{args.shape}-dummy" if args.dummy else args.shape)


def _llm(folder: Path, **options: Any) -> tuple[Any, float]:
    from tidal_engine import LLM

    opts: dict[str, Any] = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, seed=0)
    if folder.name.endswith("-dummy"):
        opts["load_format"] = "dummy"
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
    if args.dummy:  # config, tokenizer and a one-tensor stand-in: the engine makes up the weights
        from gpu_bench import hf_config, make_config_folder, save_tokenizer

        made = make_config_folder(args.shape, Path(args.models))
        folder = _folder(args)
        if not folder.exists():
            made.rename(folder)
        save_tokenizer(folder, hf_config(args.shape)["vocab_size"])
    else:
        folder = make_model_folder(args.shape, Path(args.models))
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"folder": str(folder), "checkpoint_bytes": size, "write_s": time.perf_counter() - start}


def _weights_match_checkpoint(model: Any, folder: Path) -> dict[str, bool]:
    """A few parameters, as loaded on the device, against the checkpoint read with safetensors."""
    import torch
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    params = dict(model.named_parameters())
    last = max(int(n.split(".")[2]) for n in index if n.startswith("model.layers."))
    out = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.weight",
                 f"model.layers.{last}.mlp.down_proj.weight"):
        ours = params.get(name.removeprefix("model."))
        if name not in index or ours is None:
            continue
        with safe_open(str(folder / index[name]), framework="pt") as handle:
            out[name] = bool(torch.equal(ours.detach().cpu(), handle.get_tensor(name)))
    return out


def stage_basics(args: argparse.Namespace) -> dict[str, Any]:
    """What an engine pays before its own work: imports, the CUDA context, the tokenizer."""
    out: dict[str, Any] = {}
    t = time.perf_counter()
    import torch

    out["import_torch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out["cuda_context_s"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.is_bf16_supported()
    torch.cuda.mem_get_info()
    out["cuda_queries_s"] = time.perf_counter() - t
    t = time.perf_counter()
    import triton  # noqa: F401

    out["import_triton_s"] = time.perf_counter() - t
    t = time.perf_counter()
    import tidal_engine.runner.model_runner  # noqa: F401
    import tidal_engine.runner.sampler  # noqa: F401

    out["import_engine_s"] = time.perf_counter() - t
    t = time.perf_counter()
    from transformers import AutoTokenizer

    out["import_transformers_s"] = time.perf_counter() - t
    t = time.perf_counter()
    AutoTokenizer.from_pretrained(str(_folder(args)))
    out["tokenizer_load_s"] = time.perf_counter() - t
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    b = torch.empty(1 << 30, dtype=torch.uint8).fill_(0)
    out["host_fault_1gib_s"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.cudart().cudaHostRegister(b.data_ptr(), b.numel(), 0)
    out["host_register_1gib_s"] = time.perf_counter() - t
    t = time.perf_counter()
    b.copy_(a, non_blocking=True)
    torch.cuda.synchronize()
    out["d2h_1gib_s"] = time.perf_counter() - t
    torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    return out


def stage_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    folder = _folder(args)
    torch.cuda.init()
    before, total = _used()
    llm, construct_s = _llm(folder, gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=args.cache_dir)
    constructed_at = time.perf_counter()
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
        "engine_core_seconds": getattr(engine.core, "startup_seconds", None),
        "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
        "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None,
        "compile_ahead": getattr(runner, "compile_ahead_report", None),
        "gemv_choices": _gemv_choices(runner),
    }
    if not args.dummy:
        res["weights_equal_checkpoint"] = _weights_match_checkpoint(runner.model, folder)
    prompts = _prompts(4, 64, 1)
    reference = _greedy(llm, prompts, 32)
    res["greedy"] = reference
    graphs = runner.graphs
    checks: dict[str, bool] = {}
    # The level-1 host buffer is locked on a thread after start-up (runner/host_buffer.py): how
    # long that took, and whether it was done when the first sleep came. The first sleep is timed
    # once it is ready (an engine is put to sleep when idle, seconds at least after it started);
    # the wait, if any, is recorded beside it.
    host = runner.weights.host_buffer
    res["host_buffer_ready_before_wait"] = bool(host is not None and host.ready)
    t = time.perf_counter()
    if host is not None:
        host.get()
    res["host_buffer_wait_s"] = time.perf_counter() - t
    res["host_buffer_prepare_s"] = host.prepare_seconds if host is not None else None
    res["first_sleep_after_construct_s"] = time.perf_counter() - constructed_at
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
    # Level 1 once more, woken in two calls: where the wake's time goes (weights vs KV cache).
    engine.sleep(1)
    t = time.perf_counter()
    engine.wake_up(["weights"])
    torch.cuda.synchronize()
    res["wake1_weights_only_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine.wake_up(["kv_cache"])
    torch.cuda.synchronize()
    res["wake1_kv_cache_only_s"] = time.perf_counter() - t
    checks["greedy_equal_after_split_wake"] = _greedy(llm, prompts, 32) == reference
    res["checks"] = checks
    res["device_used_after_wakes_bytes"] = _used()[0]
    return res


def stage_profile(args: argparse.Namespace) -> dict[str, Any]:
    """A construction under cProfile: where the seconds went (cProfile slows Python-heavy parts)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    llm, construct_s = _llm(_folder(args), gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=args.cache_dir)
    profiler.disable()
    runner = llm.engine.runner
    result: dict[str, Any] = {"construct_s_under_cprofile": construct_s, "startup_seconds": runner.startup_seconds,
                              "engine_core_seconds": llm.engine.core.startup_seconds,
                              "greedy": _greedy(llm, _prompts(4, 64, 1, llm.engine.core.vocab_size), 16)}
    for key, order, restrict in (("by_cumulative", "cumulative", ()), ("by_own_time", "tottime", ()),
                                 # the start-up's own phases, past the imports that fill the lists above
                                 ("engine_by_cumulative", "cumulative", ("tidal_engine|cuda/graphs|triton/runtime",))):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*restrict, 45)
        result[key] = [line for line in text.getvalue().splitlines() if line.strip()][-46:]
    return result


def stage_nowarm(args: argparse.Namespace) -> dict[str, Any]:
    """The check behind capturing the CUDA graphs after one eager warm-up run (of the largest
    size) instead of one per size (``warm_up_each``), in a fresh process with an empty cache dir
    (so Triton compiles inside the captures): each replay against an eager run of the same
    inputs, and the greedy output (compare with the ``profile`` stage's: same seed and weights)."""
    import tempfile

    import torch

    from tidal_engine.runner.cuda_graphs import DecodeGraphs
    from tidal_engine.runner.mixed_graphs import MixedGraphs

    DecodeGraphs.warm_up_each = False
    MixedGraphs.warm_up_each = False
    cache = tempfile.mkdtemp(prefix="tidal-nowarm-")
    llm, construct_s = _llm(_folder(args), gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=cache)
    runner = llm.engine.runner
    graphs = runner.graphs
    diffs: dict[int, float] = {}
    with torch.inference_mode():
        for b in [x for x in (1, 2, 8, 24, 64, 136, 256) if graphs is not None and x in graphs.graphs]:
            graphs._dummy_inputs(b)
            graphs.graphs[b].graph.replay()
            replayed = graphs.graphs[b].logits.clone()
            eager = graphs._forward(b)
            diffs[b] = float((replayed.float() - eager.float()).abs().max())
    return {"construct_s": construct_s, "startup_seconds": runner.startup_seconds,
            "engine_core_seconds": llm.engine.core.startup_seconds,
            "graph_capture_s": graphs.capture_seconds if graphs else None,
            "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None,
            "replay_vs_eager_max_abs_diff": diffs, "greedy": _greedy(llm, _prompts(4, 64, 1, llm.engine.core.vocab_size), 16)}


def _gemv_choices(runner: Any) -> dict[str, str]:
    """The one-row-linear choice per weight shape (they set which kernel, so which sums, a
    one-row step runs: greedy outputs compare only between engines that chose alike)."""
    return {f"{k[0]}x{k[1]}": str(v) for k, v in sorted(getattr(runner, "_gemv_choices", {}).items(), key=str)}


def stage_construct(args: argparse.Namespace) -> dict[str, Any]:
    folder = _folder(args)
    llm, construct_s = _llm(folder, gpu_memory_utilization=0.9, enable_sleep_mode=True, cache_dir=args.cache_dir)
    runner = llm.engine.runner
    return {"construct_s": construct_s, "kv_blocks": runner.num_blocks,
            "startup_seconds": getattr(runner, "startup_seconds", None),
            "engine_core_seconds": getattr(llm.engine.core, "startup_seconds", None),
            "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
            "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None,
            "compile_ahead": getattr(runner, "compile_ahead_report", None), "gemv_choices": _gemv_choices(runner),
            "greedy": _greedy(llm, _prompts(4, 64, 1), 32)}


def stage_construct_tokfirst(args: argparse.Namespace) -> dict[str, Any]:
    """``construct`` with the tokenizer loaded before the workers start, as before 2026-12-01c."""
    from tidal_engine.engine.tokenizer_load import TokenizerLoad

    TokenizerLoad.alongside = False
    return stage_construct(args)


def stage_cold_plain(args: argparse.Namespace) -> dict[str, Any]:
    """A cold construction (a fresh, empty cache dir) the way start-up ran before 2026-12-01c:
    the tokenizer before the workers, each phase compiling its own kernels (no compile-ahead)."""
    import tempfile

    from tidal_engine.engine.tokenizer_load import TokenizerLoad
    from tidal_engine.kernels.compile_ahead import CompileAhead

    TokenizerLoad.alongside = False
    CompileAhead.enabled = False
    os.environ.pop("TRITON_CACHE_DIR", None)  # the fresh dir's own triton/ folder, not the shared one
    args.cache_dir = tempfile.mkdtemp(prefix="tidal-cold-plain-")
    return stage_construct(args)


def stage_load(args: argparse.Namespace) -> dict[str, Any]:
    """One engine of the pair: construct at ``--util``, say so, wait for the go, generate."""
    folder = _folder(args)
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
    return {"construct_s": construct_s, "startup_seconds": runner.startup_seconds,
            "engine_core_seconds": llm.engine.core.startup_seconds, "util": args.util, "memory_report": runner.memory_report,
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
               "--cache-dir", args.cache_dir or ""] + (["--dummy"] if args.dummy else [])
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


def stage_switch(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.models) / "switch.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "gpu_share_switch_bench.py"), "--model", str(_folder(args)), "--json", str(out),
           "--util", "0.45", "--rounds", str(args.switch_rounds), "--logs", args.out]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    if args.dummy:
        cmd += ["--load-format", "dummy"]
    rc = subprocess.run(cmd).returncode
    result = json.loads(out.read_text()) if out.exists() else {"error": f"exit {rc}"}
    return result


STAGES = {"write": stage_write, "basics": stage_basics, "engine": stage_engine, "construct": stage_construct,
          "construct_tokfirst": stage_construct_tokfirst, "cold_plain": stage_cold_plain,
          "profile": stage_profile, "nowarm": stage_nowarm, "load": stage_load, "pair": stage_pair, "switch": stage_switch}


def _git_commit() -> str:
    return os.environ.get("TIDAL_COMMIT") or "unknown"


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "python3 benchmarks/memory_bench.py " + " ".join(sys.argv[1:]),
        "commit": _git_commit(), "date": os.environ.get("TIDAL_BENCH_DATE") or time.strftime("%Y-%m-%d"),
        "shape": args.shape, "max_model_len": 4096, "max_num_seqs": 256, "dtype": "bfloat16",
        "dummy_weights": args.dummy,
    }
    path = out / (args.result_name or f"memory-{args.shape}.json")
    cache = args.cache_dir or str(Path(args.models) / "cache")
    for i, stage in enumerate(args.stages.split(",")):
        key = stage if stage not in result else f"{stage}_{i}"
        print(f"=== {key} {time.strftime('%T')}", flush=True)
        stage_json = Path(args.models) / f"{key}.json"
        stage_json.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, stage, "--shape", args.shape, "--models", args.models, "--out", args.out,
               "--json", str(stage_json), "--cache-dir", cache, "--switch-rounds", str(args.switch_rounds)]
        cmd += ["--dummy"] if args.dummy else []
        t = time.perf_counter()
        try:
            rc: int | str = subprocess.run(cmd, timeout=args.stage_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.stage_timeout} s"
        result[key] = json.loads(stage_json.read_text()) if stage_json.exists() else {"error": f"exit {rc}"}
        result[key]["stage_wall_s"] = time.perf_counter() - t
        path.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({key: result[key]}, default=str)[:3000], flush=True)
    greedy = {k: v["greedy"] for k, v in result.items() if isinstance(v, dict) and "greedy" in v}
    if len(greedy) > 1:  # the same prompts and weights: equal unless the kernels chose differently
        first = next(iter(greedy.values()))
        # a stage that generated fewer tokens (profile: 16) is compared with the others' first ones
        result["greedy_equal_across_stages"] = {
            k: len(v) == len(first) and all(row == ref[:len(row)] for row, ref in zip(v, first))
            for k, v in greedy.items()}
        path.write_text(json.dumps(result, indent=1, default=str))
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
    parser.add_argument("--dummy", action="store_true", help="a config-only folder, load_format=dummy (a quick look)")
    parser.add_argument("--switch-rounds", type=int, default=6, help="(switch) switches to time")
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
