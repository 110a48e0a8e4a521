"""KV offload to host memory (issue 18): TTFT from the host tier, decode cost, multi-turn chat.

Usage (on the GPU machine, from the repository root; docs/kv-offload.md reads the results):

    PYTHONPATH=engine TIDAL_COMMIT=<sha> TIDAL_BENCH_DATE=<date> python3 benchmarks/kv_offload_bench.py \
        --shape qwen3-8b --host-gib 16 --out out/kv-offload-qwen3-8b.json

Two engines on one GPU, random weights of the real shape (``--load-format dummy``), bf16,
decode CUDA graphs (sizes 1..128), mixed-step graphs as the engine's default (--no-mixed-graphs:
eager short prefill steps, as the first run of 2026-12-01 had), the same for both:
``on`` with ``--kv-offloading-size``, ``off`` without; both have the same device KV pool.
The ``on`` engine runs every section under both saving policies, write-through (``wt``) and
save-on-eviction (``ev``): the policy is switched on its connector between runs, with the
host pool emptied (one pinned pool: host memory would not hold two of the multi-turn size).
A smaller device pool is made by taking blocks out of the pool (``limit_device_blocks``:
they are held, as a request would hold them), so one engine serves every pool size.

  ttft          a 3,200-token prompt, max_tokens=1 (median of 3 prompts): computed from scratch
                (``off``, and ``on`` with a fresh prompt); served from the host tier after other
                3,200-token prompts evicted it from a 400-block device pool; a device hit.
  decode        64 requests of 128 -> 256 tokens at once, pool big enough (no eviction):
                output tok/s, ``off``/``on`` alternated twice, best of each.
  multi_turn    U users x T turns: each user has its own H-token history; a turn appends a
                64-token user message to the conversation so far, 64 tokens are generated and
                appended; all users' turn t at once. The device pool is limited to a quarter
                of the working set (users x final conversation). Wall time, tokens/s, TTFT p50
                (first_token_time - arrival_time of the offline requests).
Every section is guarded: a failure is recorded and the others still run; a wall-time
budget (--budget-s) skips what would not fit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import SHAPES, hf_config  # noqa: E402

from tidal_engine import LLM, SamplingParams  # noqa: E402


def config_folder(shape: str, root: Path) -> Path:
    """config.json and one small tensor file (the loader wants a checkpoint to exist; with
    load_format dummy it reads none of it): the weights are random, prompts are token ids."""
    from safetensors.torch import save_file

    folder = root / f"{shape}-config"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"model.norm.weight": torch.ones(cfg["hidden_size"], dtype=torch.bfloat16)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_llm(folder: Path, num_blocks: int, host_gib: float | None, device: str, mixed_graphs: bool = True,
             kv_cache_dtype: str = "auto") -> LLM:
    options: dict[str, Any] = dict(dtype="bfloat16", device=device, max_model_len=8192, load_format="dummy",
                                   skip_tokenizer_init=True, num_gpu_blocks_override=num_blocks,
                                   max_num_seqs=128, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
                                   mixed_cuda_graphs=mixed_graphs, kv_cache_dtype=kv_cache_dtype)  # both alike
    if host_gib:
        options["kv_offloading_size"] = host_gib
    return LLM(str(folder), **options)


def limit_device_blocks(llm: LLM, usable: int) -> Callable[[], None]:
    """Hold all but ``usable`` free device blocks; returns the undo."""
    core = llm.engine.core
    core.kv_cache_manager.reset_prefix_cache()
    pool = core.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(max(0, pool.num_free_blocks - usable))
    return lambda: pool.free_blocks(taken)


def settle(llm: LLM) -> None:
    core = llm.engine.core
    core.settle()
    core.finish_kv_transfers()


def use_policy(llm: LLM, policy: str) -> None:
    """Switch the ``on`` engine's saving policy, starting from an empty host pool."""
    settle(llm)
    connector = llm.engine.core.scheduler.connector
    connector.reset()
    connector.save_policy = policy


POLICIES = {"wt": "write-through", "ev": "eviction"}


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def timed(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[Any]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    return time.perf_counter() - t0, outs


def stats_delta(llm: LLM, before: Any) -> dict[str, float]:
    after = llm.engine.get_stats()
    names = ("prefix_cache_hits", "external_prefix_cache_hits", "prompt_tokens_computed", "kv_offload_bytes_loaded",
             "kv_offload_bytes_saved", "kv_offload_load_seconds", "kv_offload_save_seconds", "num_preemptions")
    return {n: getattr(after, n) - getattr(before, n) for n in names}


def bench_ttft(on: LLM, off: LLM, vocab: int, prompt_len: int) -> dict[str, Any]:
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "device_pool_blocks": 400}
    undo_on, undo_off = limit_device_blocks(on, 400), limit_device_blocks(off, 400)
    try:
        timed(on, prompts(rng, 1, prompt_len, vocab), one)  # warm-up both engines at this length
        timed(off, prompts(rng, 1, prompt_len, vocab), one)
        recompute_off = [timed(off, prompts(rng, 1, prompt_len, vocab), one)[0] for _ in range(3)]
        out["recompute_off_s"] = recompute_off
        out["median_s"] = {"recompute_off": statistics.median(recompute_off)}
        for tag, policy in POLICIES.items():
            use_policy(on, policy)
            recompute_on, host, device_hit, deltas = [], [], [], []
            for _ in range(3):
                target = prompts(rng, 1, prompt_len, vocab)
                recompute_on.append(timed(on, target, one)[0])
                device_hit.append(timed(on, target, one)[0])
                fillers = 400 // (prompt_len // 16) + 1  # enough to push it out of the 400-block device pool
                for filler in prompts(rng, fillers, prompt_len, vocab):
                    timed(on, [filler], one)
                settle(on)
                before = on.engine.get_stats()
                host.append(timed(on, target, one)[0])
                deltas.append(stats_delta(on, before))
            out[tag] = {"policy": policy, "recompute_on_s": recompute_on, "host_hit_s": host,
                        "device_hit_s": device_hit, "host_hit_counters": deltas}
            out["median_s"].update({f"recompute_on_{tag}": statistics.median(recompute_on),
                                    f"host_hit_{tag}": statistics.median(host),
                                    f"device_hit_{tag}": statistics.median(device_hit)})
            out[f"host_over_recompute_{tag}"] = statistics.median(host) / out["median_s"]["recompute_off"]
            out[f"device_hit_over_recompute_{tag}"] = statistics.median(device_hit) / out["median_s"]["recompute_off"]
        return out
    finally:
        undo_on()
        undo_off()


def bench_decode(on: LLM, off: LLM, vocab: int, n: int = 64) -> dict[str, Any]:
    rng = random.Random(2)
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    runs: dict[str, list[float]] = {"off": [], "wt": [], "ev": []}
    counters: dict[str, Any] = {}
    for _ in range(2):
        for name in runs:
            llm = off if name == "off" else on
            if name != "off":
                use_policy(on, POLICIES[name])
            llm.engine.core.kv_cache_manager.reset_prefix_cache()  # no eviction: nothing cached to evict
            batch = prompts(rng, n, 128, vocab)
            before = llm.engine.get_stats()
            seconds, outs = timed(llm, batch, params)
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            if name != "off":
                counters[name] = stats_delta(llm, before)
    best = {k: max(v) for k, v in runs.items()}
    return {"requests": n, "prompt": 128, "output": 256, "output_tok_s": runs, "best_tok_s": best,
            "wt_over_off": best["wt"] / best["off"], "ev_over_off": best["ev"] / best["off"],
            "counters_last_run": counters}


def run_turns(llm: LLM, users: int, turns: int, history: int, vocab: int, usable: int,
              msg: int, reply: int) -> dict[str, Any]:
    rng = random.Random(3)  # the same conversations for every engine and policy
    convs = prompts(rng, users, history, vocab)
    undo = limit_device_blocks(llm, usable)
    try:
        before = llm.engine.get_stats()
        params = SamplingParams(max_tokens=reply, ignore_eos=True)
        ttfts: list[float] = []
        total = 0.0
        generated = 0
        for _ in range(turns):
            for conv in convs:
                conv.extend(rng.randrange(1000, vocab - 1000) for _ in range(msg))
            seconds, outs = timed(llm, convs, params)
            total += seconds
            for conv, o in zip(convs, outs):
                conv.extend(o.outputs[0].token_ids)
                generated += len(o.outputs[0].token_ids)
                m = o.metrics
                if m is not None and m.first_token_time is not None:
                    ttfts.append(m.first_token_time - m.arrival_time)
        return {"wall_s": total, "output_tok_s": generated / total, "requests_per_s": users * turns / total,
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None, "counters": stats_delta(llm, before)}
    finally:
        undo()
        settle(llm)


def bench_multi_turn(on: LLM, off: LLM, vocab: int, users: int, turns: int, history: int,
                     save: Callable[[dict[str, Any]], None], policies: tuple[str, ...] = ("wt", "ev"),
                     block_size: int = 16) -> dict[str, Any]:
    msg, reply = 64, 64
    final_len = history + turns * (msg + reply)
    working_blocks = users * -(-final_len // block_size)
    usable = max(working_blocks // 4, -(-final_len // block_size) + 1)
    out: dict[str, Any] = {"users": users, "turns": turns, "history_tokens": history, "message_tokens": msg,
                           "reply_tokens": reply, "working_set_blocks": working_blocks, "device_pool_blocks": usable}
    for name in ("off", *policies):
        if name != "off":
            use_policy(on, POLICIES[name])
        out[name] = run_turns(off if name == "off" else on, users, turns, history, vocab, usable, msg, reply)
        save(out)  # each engine's figures survive a timeout in the next
    for name in policies:
        out[f"throughput_{name}_over_off"] = out[name]["requests_per_s"] / out["off"]["requests_per_s"]
        out[f"ttft_p50_{name}_over_off"] = out[name]["ttft_p50_s"] / out["off"]["ttft_p50_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--host-gib", type=float, default=16.0)
    ap.add_argument("--device-blocks", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=3200)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="capture mixed-step CUDA graphs, the engine's default (the first 2026-12-01 run had them off)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8 halves the bytes of a block, so twice the tokens fit in the same host memory")
    ap.add_argument("--multi-turn-policies", default="wt,ev",
                    help="the saving policies the multi_turn section runs on the `on` engine, in order")
    ap.add_argument("--skip", default="")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip sections that start after this many seconds")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {
        "benchmark": "kv_offload_bench", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "commit": os.environ.get("TIDAL_COMMIT", "unknown"),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
        "python": platform.python_version(), "shape": args.shape, "host_gib": args.host_gib,
        "device_blocks": args.device_blocks, "mixed_graphs": args.mixed_graphs,
        "kv_cache_dtype": args.kv_cache_dtype, "_wall_s": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    def guarded(name: str, fn: Callable[[], Any]) -> None:
        if name in args.skip.split(","):
            return
        if time.perf_counter() - started > args.budget_s:
            results[name] = {"skipped": f"over the {args.budget_s:.0f} s budget"}
            save()
            return
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # record and go on
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results["_wall_s"][name] = time.perf_counter() - t0
        print(json.dumps({name: results[name]}, default=str)[:2000], flush=True)
        save()

    folder = config_folder(args.shape, Path(args.models))
    vocab = SHAPES[args.shape]["vocab_size"]
    t0 = time.perf_counter()
    off = make_llm(folder, args.device_blocks, None, device, args.mixed_graphs, args.kv_cache_dtype)
    results["startup_off_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    on = make_llm(folder, args.device_blocks, args.host_gib, device, args.mixed_graphs, args.kv_cache_dtype)
    results["startup_on_s"] = time.perf_counter() - t0
    results["host_pool"] = on.engine.core.executor.collective_rpc("kv_connector_info")[0]
    save()
    guarded("ttft", lambda: bench_ttft(on, off, vocab, args.prompt_len))
    guarded("decode", lambda: bench_decode(on, off, vocab))
    def partial(section: dict[str, Any]) -> None:
        results["multi_turn"] = section
        save()

    policies = tuple(p for p in args.multi_turn_policies.split(",") if p)
    guarded("multi_turn", lambda: bench_multi_turn(on, off, vocab, args.users, args.turns, args.history, partial,
                                                   policies))
    results["total_wall_s"] = time.perf_counter() - started
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
