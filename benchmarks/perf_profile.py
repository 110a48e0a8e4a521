"""Where the 8B step's GPU time goes (issue 13's speed targets): a diagnostic, not a speed claim.

Usage (on the GPU machine, from the repository root):

    PYTHONPATH=engine TRITON_INTERPRET=0 python benchmarks/perf_profile.py --shape qwen3-8b --out prof.json

Random weights (``--load-format dummy``: nothing on disk but config.json), no tokenizer, the
engine's defaults otherwise (8,192-token step budget, 256 sequences). Parts (``--skip`` takes
their names):

  profile     the offline sampled 256 x (256 -> 128) under torch.profiler:
              wall time, GPU busy time (union of kernel intervals) and the kernels by total time
  attention   the paged-attention kernel alone, over a shuffled block table, at a 256-row decode
              (context 320) and an 8,192-token prefill (32 x 256), for tile / warp / stage
              variants; torch SDPA (flash) on the same prefill as the bar
  gemm        the decoder's matmuls (F.linear) at 256 and 8,192 rows: TFLOP/s
  sampler     top-k candidates of 256 rows x the vocabulary: torch.topk against the chunk
              prefilter (``sampler.top_k_candidates``), and the whole top-k/top-p draw
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu_bench import SHAPES, gpu_ms, make_config_folder, make_llm, rand_prompts, sync  # noqa: E402

SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)


def kernel_table(trace_path: Path, top: int = 45) -> dict[str, Any]:
    """Kernels of a chrome trace: busy time (union of intervals), span, and the top by time."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        return {"error": "no kernel events in the trace"}
    kernels.sort(key=lambda e: e["ts"])
    busy = 0.0
    cur_start, cur_end = kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"]
    for e in kernels[1:]:
        s, t = e["ts"], e["ts"] + e["dur"]
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    busy += cur_end - cur_start
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        row = by_name[e["name"][:160]]
        row[0] += e["dur"]
        row[1] += 1
    total = sum(v[0] for v in by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
        "kernel_ms_total": total / 1e3,
        "top": [{"name": n, "ms": v[0] / 1e3, "count": v[1], "share": v[0] / total} for n, v in rows],
    }


def part_profile(llm: Any, vocab: int, out_dir: Path) -> dict[str, Any]:
    from tidal_engine import SamplingParams

    res: dict[str, Any] = {}
    llm.generate(rand_prompts(8, [64] * 8, 5, vocab), SamplingParams(max_tokens=8, ignore_eos=True, **SAMPLED))
    for name, n_in, n_out, seed in (("fixed_256_128", 256, 128, 11),):
        params = SamplingParams(max_tokens=n_out, ignore_eos=True, **SAMPLED)
        prompts = rand_prompts(256, [n_in] * 256, seed, vocab)
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        plain_s = time.perf_counter() - t0
        prompts = rand_prompts(256, [n_in] * 256, seed + 100, vocab)  # fresh: no prefix hits
        trace = out_dir / f"trace-{name}.json"
        kinds = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=kinds) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            prof_s = time.perf_counter() - t0
        prof.export_chrome_trace(str(trace))
        table = kernel_table(trace)
        trace.unlink()
        res[name] = {"unprofiled_s": plain_s, "unprofiled_out_tok_s": 256 * n_out / plain_s,
                     "profiled_s": prof_s, **table}
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "top"}), flush=True)
        for row in table.get("top", [])[:25]:
            print(f"  {row['ms']:9.2f} ms {row['count']:6d}  {row['name'][:110]}", flush=True)
    return res


def part_attention(llm: Any) -> dict[str, Any]:
    from tidal_engine.kernels.triton.paged_attention import paged_attention

    runner = llm.engine.runner
    attn = runner.model.layers[0].self_attn
    cache = runner.kv_caches[0]
    heads, dim, bs = attn.num_heads, attn.head_dim, cache.shape[2]
    dev = cache.device
    res: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    cases = {"decode_256x320": (256, 1, 320), "prefill_32x256": (32, 256, 256)}
    for case, (seqs, q_len, ctx) in cases.items():
        blocks_per = -(-ctx // bs)
        need = seqs * blocks_per
        cache[:, :need].normal_()
        order = torch.randperm(need, generator=gen).to(dev).view(seqs, blocks_per).to(torch.int32)
        tokens = seqs * q_len
        q = torch.randn(tokens, heads, dim, device=dev, dtype=cache.dtype)
        seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=dev)
        starts = (torch.arange(seqs + 1, dtype=torch.int32, device=dev) * q_len)
        kv_bytes = 2 * seqs * ctx * cache.shape[3] * dim * cache.element_size()
        flops = 4 * heads * dim * (seqs * q_len * (ctx - q_len) + seqs * q_len * (q_len + 1) / 2)
        out: dict[str, Any] = {"kv_bytes": kv_bytes, "flops": flops}
        variants: list[dict[str, int | None]] = [dict(block_m=None, block_n=None, num_warps=None, num_stages=None)]
        block_ms = (16,) if q_len == 1 else (64, 128)
        for bm in block_ms:
            for bn in (32, 64, 128) if q_len == 1 else (64, 128):
                for w in (2, 4) if q_len == 1 else (4, 8):
                    for st in (2, 3):
                        variants.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
        for v in variants:
            key = "default" if v["block_m"] is None else f"m{v['block_m']}_n{v['block_n']}_w{v['num_warps']}_s{v['num_stages']}"
            try:
                ms = gpu_ms(lambda v=v: paged_attention(q, cache, order, seq_lens, starts, dim**-0.5, q_len, **v))
                out[key] = {"us": ms * 1e3, "TB_s": kv_bytes / ms / 1e9, "TFLOP_s": flops / ms / 1e9}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        if q_len > 1:  # the bar: dense causal flash attention of the same prefill
            qd = torch.randn(seqs, heads, q_len, dim, device=dev, dtype=cache.dtype)
            kd = torch.randn(seqs, heads, q_len, dim, device=dev, dtype=cache.dtype)
            ms = gpu_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, kd, is_causal=True))
            out["torch_sdpa_causal"] = {"us": ms * 1e3, "TFLOP_s": flops / ms / 1e9}
        ok = {k: r for k, r in out.items() if isinstance(r, dict) and "us" in r and k != "torch_sdpa_causal"}
        best = min(ok, key=lambda k: ok[k]["us"])
        out["best"] = best
        print(case, "default", out["default"], "best", best, ok[best], out.get("torch_sdpa_causal"), flush=True)
        res[case] = out
    return res


def part_gemm(shape: str, dev: torch.device) -> dict[str, Any]:
    s = SHAPES[shape]
    h, inter, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd
    mats = {"qkv": (qkv, h), "o": (h, s["num_attention_heads"] * hd), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (s["vocab_size"], h)}
    res: dict[str, Any] = {}
    for rows in (256, 8192):
        for name, (n, k) in mats.items():
            if name == "lm_head" and rows > 256:
                continue
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ms = gpu_ms(lambda: torch.nn.functional.linear(x, w), reps=20)
            res[f"{name}_m{rows}"] = {"us": ms * 1e3, "TFLOP_s": 2 * rows * n * k / ms / 1e9,
                                      "TB_s": 2 * (n * k + rows * (n + k)) / ms / 1e9}
            del w, x
    per_layer = {rows: sum(res[f"{m}_m{rows}"]["us"] for m in ("qkv", "o", "gate_up", "down")) for rows in (256, 8192)}
    res["per_layer_us"] = per_layer
    print("gemm", json.dumps(res), flush=True)
    return res


def part_sampler(dev: torch.device, vocab: int) -> dict[str, Any]:
    from tidal_engine.executor.plan import SamplingOptions
    from tidal_engine.runner import sampler as sm

    torch.manual_seed(0)
    logits = (torch.randn(256, vocab, device=dev) * 2.0).to(torch.bfloat16)
    res: dict[str, Any] = {
        "torch_topk_bf16_us": gpu_ms(lambda: logits.topk(50, dim=-1, sorted=True)) * 1e3,
    }
    for chunk in (64, 128, 256):
        res[f"prefilter_chunk{chunk}_us"] = gpu_ms(lambda c=chunk: sm.top_k_candidates(logits, 50, c)) * 1e3
    v1, i1 = logits.topk(50, dim=-1, sorted=True)
    v2, i2 = sm.top_k_candidates(logits, 50)
    res["prefilter_values_equal"] = bool(torch.equal(v1, v2))
    res["prefilter_ids_equal"] = bool(torch.equal(i1, i2))
    s = sm.Sampler(vocab, 256, dev)
    ids = [f"r{i}" for i in range(256)]
    for r in ids:
        s.add_request(r, SamplingOptions(**SAMPLED), [1, 2, 3])
    res["sample_topk_topp_us"] = gpu_ms(lambda: s.sample(logits, ids), reps=20) * 1e3
    print("sampler", json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--skip", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "benchmark": f"perf_profile {args.shape}",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "commit": os.environ.get("TIDAL_COMMIT", "unknown"),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
    }

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    def guarded(name: str, fn: Callable[[], Any]) -> None:
        if name in skip:
            return
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()[-2000:]}
            print(results[name]["error"], flush=True)
        print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    dev = torch.device("cuda")
    vocab = SHAPES[args.shape]["vocab_size"]
    guarded("gemm", lambda: part_gemm(args.shape, dev))
    guarded("sampler", lambda: part_sampler(dev, vocab))
    os.environ.setdefault("TIDAL_GEMV", "0")  # the one-row choice: irrelevant here, and it takes seconds
    folder = make_config_folder(args.shape, Path(args.models))
    t0 = time.perf_counter()
    llm, startup = make_llm(folder, load_format="dummy", skip_tokenizer_init=True)
    results["llm_construct_s"] = startup
    print(f"== LLM: {time.perf_counter() - t0:.1f} s", flush=True)
    guarded("profile", lambda: part_profile(llm, vocab, out.parent))
    guarded("attention", lambda: part_attention(llm))
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
