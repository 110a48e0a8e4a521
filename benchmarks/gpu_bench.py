"""Tidal on one GPU (H200) against Hugging Face transformers and the hardware limit.

Usage (on the GPU machine, from the repository root):

    PYTHONPATH=engine TRITON_INTERPRET=0 python benchmarks/gpu_bench.py \
        --shape qwen3-0.6b --suite tidal --out results/tidal-0.6b.json
    ... --suite hf   (the transformers baseline, same shapes and weights)
    ... --suite smoke (a quick single-stream check: graphs vs eager)
    ... --suite sampled (offline sampled throughput, see below)

The model is never downloaded: ``make_model_folder`` writes an HF folder (config.json of
the real Qwen3 shape, random bf16 safetensors of small magnitude, a word-level tokenizer
of the same vocabulary size) to local disk, so our loader path runs as it would for the
real checkpoint. Every prompt is random token ids (fixed seed); every request ignores
EOS, so output lengths are exact. Each benchmark is wrapped: a failure is recorded in
the JSON with its error and the rest still run.

Benchmarks (suite tidal):
  single_stream      128 -> 256 tokens, batch 1: end-to-end output tok/s and the decode-only
                     rate (inter-token time); variants: CUDA graphs + fused Triton kernels
                     (default), --enforce-eager, and graphs without the fused kernels.
  throughput_fixed   256 requests of 256 -> 128, all submitted at once (LLM.generate).
  throughput_mixed   256 requests, input 100..1024, output 100..1024 (seed 0).
  ttft               a 3,200-token prompt: cold (fresh prompt) and prefix-cache hit (same
                     prompt again), max_tokens=1, median of 3.
  sleep              device memory before/after sleep level 1 and 2, and wake-up time.
  startup            LLM() construction (load, KV profile, graph capture) seconds.
Benchmarks (suite long-decode: the KV cache's dtype, issue 15; random weights via --load-format
dummy, no tokenizer, nothing written to disk but config.json):
  long_decode_<dtype>  one decode step of 64 sequences at 8,192 tokens of context each, for every
                     dtype of --kv-cache-dtype (e.g. auto,fp8): GPU time of the captured decode
                     graph (embedding to logits, sampling excluded) over a KV cache filled with
                     random values through a shuffled block table; the KV blocks the same
                     gpu_memory_utilization budget holds; and (attention_sweep, --skip takes it)
                     the paged-attention kernel alone on layer 0's cache: the engine's launch,
                     then the launches of ATTENTION_SETTINGS (KV splits, key tiles, warps, stages,
                     register caps, 64-bit offsets, block ids a tile ahead) and,
                     over an fp8 cache, of each FP8_DECODE_PRESETS entry (preset_<name>);
                     --attention-settings picks some; and
                     (attention_sweep_short) the same at issue 13's decode shape, 256
                     sequences x 320 keys. TIDAL_FP8_DECODE (a preset name of
                     paged_attention's FP8_DECODE_PRESETS) forces the fp8 cache's decode launch
                     of the engine; it is recorded in long_decode_options.
Benchmarks (suite quant: weight quantization, issue 15; --load-format dummy, random weights through
Tidal's quantizer, nothing on disk but config.json): quant_<format> for each of --quantization
(default none,fp8; awq/gptq: asymmetric g128 through a config.json that names the format): single_stream
and throughput_fixed as above, one_row_kernels (the small-batch kernel choices of layer 0), and
decode_gpu (the captured decode step's GPU time and one eager decode forward's top 40 kernels;
--skip takes decode_gpu and throughput_fixed).
Benchmarks (suite sampled: the issue-13 offline sampled workloads, t=0.8, top_p=0.95, top_k=50):
  throughput_fixed_sampled   256 requests of 256 -> 128, all submitted at once.
  throughput_long_sampled    256 requests of 32 -> 512, all submitted at once.
  throughput_fixed_greedy    the greedy 256 x (256 -> 128) again, same LLM: the reference.
TIDAL_BENCH_LLM_OPTS (JSON) adds engine options to every LLM of the run; --kv-cache-dtype sets
the KV cache's dtype of every LLM (the first of a list; long-decode runs each).
Hardware limit: an HBM read rate of 4.16 TB/s (measured on this machine type, see
docs/performance.md) and a bf16 matrix rate of 790 TFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

HBM_READ_BYTES_PER_S = 4.16e12
BF16_FLOPS_PER_S = 790e12

SHAPES: dict[str, dict[str, Any]] = {
    # The real configs (Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json), weights random.
    "qwen3-0.6b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
    ),
    # For trying the script on a CPU: not a real model.
    "tiny-test": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=128, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=16384,
    ),
}
EOS_ID = 151645


# ------------------------------------------------------------------ model folder

def hf_config(shape: str) -> dict[str, Any]:
    cfg = dict(SHAPES[shape])
    cfg.update(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=EOS_ID, torch_dtype="bfloat16", use_cache=True,
        use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"],
        initializer_range=0.02,
    )
    return cfg


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def make_model_folder(shape: str, root: Path) -> Path:
    """config.json + random bf16 safetensors (std 0.02, norms 1) + a word-level tokenizer."""
    from safetensors.torch import save_file

    folder = root / shape
    if (folder / "done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "bos_token_id": 151643}))
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    dev = gen.device
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, shard_bytes, index = {}, 0, index + 1

    for name, shp in weight_shapes(cfg).items():
        if len(shp) == 1:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shp, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes > (2 << 30):
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_tokenizer(folder, cfg["vocab_size"])
    (folder / "done").write_text("ok")
    return folder


def make_config_folder(shape: str, root: Path) -> Path:
    """config.json only, plus a one-tensor stand-in weights file so the folder passes the
    loader's checks: for ``load_format="dummy"`` engines, which read no weights."""
    from safetensors.torch import save_file

    folder = root / f"{shape}-config-only"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    save_file({"model.norm.weight": torch.ones(SHAPES[shape]["hidden_size"], dtype=torch.bfloat16)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the full vocabulary (ids decode to ``t<id>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{EOS_ID}", unk_token="t0")
    fast.save_pretrained(str(folder))


# ------------------------------------------------------------------ roofline helpers

def param_counts(shape: str) -> dict[str, int]:
    cfg = hf_config(shape)
    shapes = weight_shapes(cfg)
    total = sum(_numel(s) for s in shapes.values())
    embed = _numel(shapes["model.embed_tokens.weight"])
    # Read per decode step: everything but the embedding table (one row of it), and the
    # LM head, which for tied models IS the embedding table.
    read = total - embed + (embed if cfg["tie_word_embeddings"] else 0)
    matmul = read  # the layers' matrices + the LM head (norms are noise)
    return {"total": total, "read_per_step": read, "matmul": matmul}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def kv_bytes_per_token(shape: str, element_bytes: int = 2) -> int:
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * element_bytes


def decode_roofline(shape: str, context: float) -> dict[str, float]:
    """tok/s limit of batch-1 decode: weights read once per step + the KV of the context."""
    weights = 2 * param_counts(shape)["read_per_step"]
    bytes_step = weights + kv_bytes_per_token(shape) * context
    return {
        "weight_bytes_read_per_step": weights,
        "kv_bytes_per_step_at_mean_context": kv_bytes_per_token(shape) * context,
        "roofline_tok_s": HBM_READ_BYTES_PER_S / bytes_step,
        "roofline_tok_s_all_weights": HBM_READ_BYTES_PER_S / (2 * param_counts(shape)["total"]),
    }


# ------------------------------------------------------------------ tidal

def rand_prompts(n: int, lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(min(1000, vocab // 4), vocab - min(1000, vocab // 4), (lengths[i],), generator=g).tolist() for i in range(n)]


class StepCounter:
    """Wraps runner.execute: counts steps, decode-only steps, and context tokens read."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inner = runner.execute
        self.reset()
        runner.execute = self

    def reset(self) -> None:
        self.steps = 0
        self.decode_steps = 0
        self.context_tokens = 0
        self.tokens = 0
        mixed = getattr(self.runner, "mixed_graphs", None)
        self.mixed_replays_at_reset = mixed.num_replays if mixed is not None else 0
        # Host wall time inside runner.execute: staging and launching (it waits for the GPU only
        # when a buffer is still in use; the wait for the sampled ids is in the engine).
        self.execute_s = 0.0
        self.decode_execute_s = 0.0
        self.replay_events: list[tuple[Any, Any]] = []
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None and not getattr(graphs, "_timed", False):
            inner_replay = graphs.replay

            def timed_replay(*args: Any, **kwargs: Any) -> Any:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = inner_replay(*args, **kwargs)
                end.record()
                if len(self.replay_events) < 5000:
                    self.replay_events.append((start, end))
                return out

            graphs.replay = timed_replay
            graphs._timed = True

    def replay_gpu_s(self) -> float:
        sync()
        return sum(a.elapsed_time(b) for a, b in self.replay_events) / 1e3

    def __call__(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Wraps ModelRunner.execute(step: StepInput, sample_req_ids, ...)."""
        self.steps += 1
        decode = bool((step.q_lens == 1).all())
        if decode:
            self.decode_steps += 1
        self.context_tokens += int((step.starts + step.q_lens).sum())
        self.tokens += int(step.q_lens.sum())
        t0 = time.perf_counter()
        out = self.inner(step, *args, **kwargs)
        dt = time.perf_counter() - t0
        self.execute_s += dt
        if decode:
            self.decode_execute_s += dt
        return out

    def summary(self, elapsed: float) -> dict[str, Any]:
        gpu = self.replay_gpu_s()
        return {
            "steps": self.steps, "decode_only_steps": self.decode_steps,
            "runner_execute_s": self.execute_s, "decode_steps_execute_s": self.decode_execute_s,
            "engine_outside_runner_s": elapsed - self.execute_s,
            "graph_replays_timed": len(self.replay_events), "graph_replay_gpu_s": gpu,
            "mixed_graph_replays": (mixed.num_replays - self.mixed_replays_at_reset)
            if (mixed := getattr(self.runner, "mixed_graphs", None)) is not None else 0,
        }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        sync()
        torch.cuda.empty_cache()


def make_llm(folder: Path, **options: Any) -> tuple[Any, float]:
    from tidal_engine import LLM

    opts: dict[str, Any] = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, seed=0,
                                kv_cache_dtype=KV_CACHE_DTYPES[0])
    # Extra engine options for a whole run, e.g. '{"mixed_cuda_graphs": false}'.
    opts.update(json.loads(os.environ.get("TIDAL_BENCH_LLM_OPTS") or "{}"))
    opts.update(options)
    start = time.perf_counter()
    llm = LLM(str(folder), **opts)
    return llm, time.perf_counter() - start


def greedy(n: int) -> Any:
    from tidal_engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def bench_single_stream(llm: Any, shape: str, reps: int = 3, counter: StepCounter | None = None) -> dict[str, Any]:
    vocab = SHAPES[shape]["vocab_size"]
    llm.generate(rand_prompts(1, [128], 99, vocab), greedy(16))  # warm-up
    runs = []
    for r in range(reps):
        prompt = rand_prompts(1, [128], 100 + r, vocab)
        if counter is not None:
            counter.reset()
        sync()
        t0 = time.perf_counter()
        out = llm.generate(prompt, greedy(256))[0]
        elapsed = time.perf_counter() - t0
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        assert n == 256, n
        decode_s = m.last_token_time - m.first_token_time
        runs.append({
            "elapsed_s": elapsed,
            "output_tok_s": n / elapsed,
            "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None,
            "ttft_s": m.first_token_time - m.arrival_time,
            **(counter.summary(elapsed) if counter is not None else {}),
        })
    best = max(runs, key=lambda x: x["output_tok_s"])
    med = statistics.median(x["output_tok_s"] for x in runs)
    med_dec = statistics.median(x["decode_tok_s"] for x in runs)
    roof = decode_roofline(shape, context=128 + 128)  # mean context over the 256 steps
    return {
        "in_tokens": 128, "out_tokens": 256, "runs": runs,
        "output_tok_s_median": med, "decode_tok_s_median": med_dec,
        "best": best, **roof,
        "fraction_of_roofline_decode": med_dec / roof["roofline_tok_s"],
    }


def bench_throughput(llm: Any, shape: str, prompts: list[list[int]], outs: list[int], counter: StepCounter,
                     sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """``sampling``: SamplingParams options (default greedy); the warm-up uses the same ones."""
    from tidal_engine import SamplingParams

    vocab = SHAPES[shape]["vocab_size"]
    opts = dict(sampling or {"temperature": 0.0})
    llm.generate(rand_prompts(8, [64] * 8, 5, vocab), SamplingParams(max_tokens=8, ignore_eos=True, **opts))  # warm-up
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **opts) for n in outs]
    counter.reset()
    sync()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in results)
    assert n_out == sum(outs), (n_out, sum(outs))
    n_in = sum(len(p) for p in prompts)
    pc = param_counts(shape)
    weight_bytes = 2 * pc["read_per_step"] * counter.steps
    kv_bytes = kv_bytes_per_token(shape) * counter.context_tokens
    flops = 2 * pc["matmul"] * (n_in + n_out)  # matmuls only; attention adds a few percent
    stats = llm.engine.get_stats()
    return {
        "requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "elapsed_s": elapsed,
        "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed, "sampling": opts,
        **counter.summary(elapsed),
        "max_running": stats.max_num_running_seen, "preemptions": stats.num_preemptions,
        "bytes_moved_estimate": weight_bytes + kv_bytes,
        "achieved_read_bandwidth_TB_s": (weight_bytes + kv_bytes) / elapsed / 1e12,
        "fraction_of_hbm_read_bw": (weight_bytes + kv_bytes) / elapsed / HBM_READ_BYTES_PER_S,
        "achieved_matmul_TFLOP_s": flops / elapsed / 1e12,
        "fraction_of_bf16_matmul_peak": flops / elapsed / BF16_FLOPS_PER_S,
    }


def bench_decode_gpu(runner: Any, shape: str, top_kernels: int = 12) -> dict[str, Any]:
    """GPU time of one captured decode step (graph replay alone, no host work), at a few
    batch sizes and contexts, and the ``top_kernels`` kernels of one eager decode forward (with the
    forward's kernel total)."""
    graphs = runner.graphs
    if graphs is None:
        return {"error": "no CUDA graphs"}
    bs = runner.config.block_size
    out: dict[str, Any] = {}
    for b in (1, 64, 256):
        if b not in graphs.graphs:
            continue
        for ctx in (256, 1024):
            blocks_per = -(-ctx // bs)
            if b * blocks_per > runner.num_blocks or blocks_per > graphs.max_blocks_per_seq:
                continue
            graphs._dummy_inputs(b)
            s = graphs.scalars
            graphs._span(b, "seq_lens").fill_(ctx)  # slots stay -1: nothing is written
            graphs.block_tables[:b, :blocks_per].copy_(
                torch.arange(b * blocks_per, device=s.device).view(b, blocks_per))
            g = graphs.graphs[b].graph
            for _ in range(3):
                g.replay()
            sync()
            times = []
            for _ in range(20):
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                e.record()
                times.append((a, e))
            sync()
            ms = statistics.median(x.elapsed_time(y) for x, y in times)
            roof = 2 * param_counts(shape)["read_per_step"] + kv_bytes_per_token(shape) * b * ctx
            out[f"b{b}_ctx{ctx}"] = {"gpu_ms": ms, "tok_s_gpu_only": b / ms * 1e3,
                                     "roofline_ms": roof / HBM_READ_BYTES_PER_S * 1e3,
                                     "fraction_of_roofline": roof / HBM_READ_BYTES_PER_S * 1e3 / ms}
    # Per-kernel split of one eager decode forward (same kernels as the graph).
    try:
        from torch.profiler import ProfilerActivity, profile

        for b in (1, 256):
            if b not in graphs.graphs:
                continue
            graphs._dummy_inputs(b)
            graphs._span(b, "seq_lens").fill_(256)
            with torch.inference_mode():
                graphs._forward(b)
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graphs._forward(b)
                    sync()
            rows = []
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            for evt in events[:top_kernels]:
                rows.append({"kernel": evt.key[:90], "calls": evt.count, "total_us": round(evt.device_time_total, 1)})
            out[f"eager_kernels_b{b}_ctx256"] = rows
            out[f"eager_kernel_total_us_b{b}_ctx256"] = round(sum(e.device_time_total for e in events), 1)
    except Exception as exc:
        out["profile_error"] = f"{type(exc).__name__}: {exc}"
    return out


def bench_ttft(llm: Any, shape: str) -> dict[str, Any]:
    vocab = SHAPES[shape]["vocab_size"]
    warm = rand_prompts(1, [3200], 300, vocab)
    llm.generate(warm, greedy(1))  # warm-up: cold and prefix-hit shapes
    llm.generate(warm, greedy(1))
    cold, hit = [], []
    for r in range(3):
        prompt = rand_prompts(1, [3200], 310 + r, vocab)
        sync()
        t0 = time.perf_counter()
        out = llm.generate(prompt, greedy(1))[0]
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out2 = llm.generate(prompt, greedy(1))[0]
        hit.append(time.perf_counter() - t0)
        assert out2.num_cached_tokens > 0
    c, h = statistics.median(cold), statistics.median(hit)
    return {"prompt_tokens": 3200, "cold_s": cold, "hit_s": hit, "cold_median_s": c, "hit_median_s": h,
            "hit_over_cold": h / c, "cached_tokens_on_hit": out2.num_cached_tokens}


def bench_sleep(llm: Any) -> dict[str, Any]:
    engine = llm.engine
    res: dict[str, Any] = {}

    def used() -> int:
        free_cuda()
        if not torch.cuda.is_available():
            return -1
        free, total = torch.cuda.mem_get_info()
        return total - free

    res["device_used_awake_bytes"] = used()
    for level in (1, 2):
        t0 = time.perf_counter()
        engine.sleep(level)
        res[f"sleep{level}_s"] = time.perf_counter() - t0
        res[f"device_used_sleep{level}_bytes"] = used()
        t0 = time.perf_counter()
        engine.wake_up()
        sync()
        res[f"wake{level}_s"] = time.perf_counter() - t0
        res[f"device_used_after_wake{level}_bytes"] = used()
    return res


SKIP: set[str] = set()
KV_CACHE_DTYPES: list[str] = ["auto"]  # --kv-cache-dtype


def run_guarded(results: dict[str, Any], name: str, fn: Callable[[], Any], save: Callable[[], None]) -> None:
    if name in SKIP:
        print(f"--- {name}: skipped", flush=True)
        return
    print(f"--- {name}", flush=True)
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # record and go on
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    results.setdefault("_wall_s", {})[name] = time.perf_counter() - t0
    print(json.dumps({name: results[name]}, default=str)[:1500], flush=True)
    save()


def suite_tidal(shape: str, folder: Path, results: dict[str, Any], save: Callable[[], None], smoke: bool) -> None:
    vocab = SHAPES[shape]["vocab_size"]
    llm, startup = make_llm(folder)
    runner = llm.engine.runner
    results["startup"] = {
        "llm_construct_s_first": startup,
        "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
        "num_graphs": len(runner.graphs.graphs) if runner.graphs else 0,
        "mixed_graph_capture_s": runner.mixed_graphs.capture_seconds if runner.mixed_graphs else None,
        "num_mixed_graphs": len(runner.mixed_graphs.graphs) if runner.mixed_graphs else 0,
        "llm_options_from_env": os.environ.get("TIDAL_BENCH_LLM_OPTS") or None,
        "kv_blocks": runner.num_blocks,
        "one_row_linear_choice": {f"{n}x{k}": str(c) if c is not None else "cuBLAS"
                                  for (n, k, _dtype, _bias), c in getattr(runner, "_gemv_choices", {}).items()},
        # Small shapes' shortlisted tiles, each timed inside the batch-1 decode step (seconds a step).
        "one_row_step_timings_s": getattr(runner, "gemv_step_timings", {}),
    }
    save()
    counter = StepCounter(runner)
    run_guarded(results, "single_stream", lambda: bench_single_stream(llm, shape, counter=counter), save)
    run_guarded(results, "decode_step_gpu", lambda: bench_decode_gpu(runner, shape), save)
    if not smoke:
        fixed = rand_prompts(256, [256] * 256, 1, vocab)
        run_guarded(results, "throughput_fixed", lambda: bench_throughput(llm, shape, fixed, [128] * 256, counter), save)
        g = torch.Generator().manual_seed(0)
        ins = torch.randint(100, 1025, (256,), generator=g).tolist()
        outs = torch.randint(100, 1025, (256,), generator=g).tolist()
        mixed = rand_prompts(256, ins, 2, vocab)
        run_guarded(results, "throughput_mixed", lambda: bench_throughput(llm, shape, mixed, outs, counter), save)
        run_guarded(results, "ttft", lambda: bench_ttft(llm, shape), save)
        run_guarded(results, "sleep", lambda: bench_sleep(llm), save)
    del llm, runner, counter
    free_cuda()

    # Variants, single stream only: what the graphs and the fused kernels buy.
    def variant(**opts: Any) -> dict[str, Any]:
        llm2, t = make_llm(folder, **opts)
        try:
            r = bench_single_stream(llm2, shape, reps=2)
            r["llm_construct_s"] = t
            return r
        finally:
            del llm2
            free_cuda()

    run_guarded(results, "single_stream_eager", lambda: variant(enforce_eager=True), save)
    run_guarded(results, "single_stream_sync_scheduling", lambda: variant(async_scheduling=False), save)
    os.environ["TIDAL_GEMV"] = "0"  # every one-row linear on cuBLAS
    run_guarded(results, "single_stream_no_gemv", lambda: variant(), save)
    os.environ["TIDAL_GEMV"] = "1"
    from tidal_engine.kernels import fused

    os.environ["TIDAL_FUSED_KERNELS"] = "0"
    fused.reset_fused_kernels_cache()
    run_guarded(results, "single_stream_graphs_no_fused_kernels", lambda: variant(), save)
    os.environ["TIDAL_FUSED_KERNELS"] = "1"
    fused.reset_fused_kernels_cache()
    # Warm start: same process, Triton's compile cache filled.
    run_guarded(results, "startup_warm", lambda: {"llm_construct_s": _construct_only(folder)}, save)


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}  # the sampled workloads


def suite_sampled(shape: str, folder: Path, results: dict[str, Any], save: Callable[[], None]) -> None:
    """Offline sampled throughput (issue 13): 256 x (256 -> 128) and 256 x (32 -> 512) at t=0.8,
    top_p=0.95, top_k=50 on fresh seeded random prompts, and the greedy 256 x (256 -> 128) on the
    same LLM as the reference. --skip takes their names."""
    vocab = SHAPES[shape]["vocab_size"]
    llm, startup = make_llm(folder)
    results["startup"] = {"llm_construct_s_first": startup, "kv_blocks": llm.engine.runner.num_blocks,
                          "llm_options_from_env": os.environ.get("TIDAL_BENCH_LLM_OPTS") or None}
    results["sampling"] = SAMPLED
    save()
    counter = StepCounter(llm.engine.runner)
    fixed = rand_prompts(256, [256] * 256, 11, vocab)
    run_guarded(results, "throughput_fixed_sampled",
                lambda: bench_throughput(llm, shape, fixed, [128] * 256, counter, SAMPLED), save)
    long_out = rand_prompts(256, [32] * 256, 12, vocab)
    run_guarded(results, "throughput_long_sampled",
                lambda: bench_throughput(llm, shape, long_out, [512] * 256, counter, SAMPLED), save)
    fixed_greedy = rand_prompts(256, [256] * 256, 13, vocab)
    run_guarded(results, "throughput_fixed_greedy",
                lambda: bench_throughput(llm, shape, fixed_greedy, [128] * 256, counter), save)
    long_greedy = rand_prompts(256, [32] * 256, 14, vocab)
    run_guarded(results, "throughput_long_greedy",
                lambda: bench_throughput(llm, shape, long_greedy, [512] * 256, counter), save)
    # The offline single stream (greedy, 128 -> 256) on the same engine: the regression check.
    run_guarded(results, "single_stream", lambda: bench_single_stream(llm, shape, counter=counter), save)
    del llm, counter
    free_cuda()


def fill_kv_random(caches: list[torch.Tensor], num_blocks: int) -> None:
    """Random N(0, 1) keys and values in the first ``num_blocks`` blocks of every layer (fp8
    caches get them rounded to e4m3), one layer at a time."""
    gen = torch.Generator(device=caches[0].device).manual_seed(0)
    for cache in caches:
        part = cache[:, :num_blocks]
        part.copy_(torch.randn(part.shape, generator=gen, device=part.device, dtype=torch.bfloat16).to(part.dtype))


def bench_long_decode(runner: Any, shape: str, batch: int, context: int, reps: int = 20) -> dict[str, Any]:
    """GPU time of one captured decode step of ``batch`` sequences at ``context`` tokens each."""
    graphs = runner.graphs
    if graphs is None or batch not in graphs.graphs:
        return {"error": f"no decode CUDA graph for batch {batch}"}
    blocks_per = -(-context // runner.config.block_size)
    need = batch * blocks_per
    if need > runner.num_blocks or blocks_per > graphs.max_blocks_per_seq:
        return {"error": f"{need} blocks needed, {runner.num_blocks} in the cache"}
    fill_kv_random(runner.kv_caches, need)
    # A shuffled block table, as a cache shared by many requests over time ends up.
    order = torch.randperm(need, generator=torch.Generator().manual_seed(1)).to(graphs.block_tables.device)
    graphs._dummy_inputs(batch)  # slots -1: the step reads the cache and writes nothing
    graphs._span(batch, "seq_lens").fill_(context)
    graphs.block_tables[:batch, :blocks_per].copy_(order.view(batch, blocks_per))
    g = graphs.graphs[batch].graph
    for _ in range(3):
        g.replay()
    sync()
    events = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        events.append((a, e))
    sync()
    times = [a.elapsed_time(e) for a, e in events]
    ms = statistics.median(times)
    element = runner.kv_caches[0].element_size()
    kv_bytes = kv_bytes_per_token(shape, element) * batch * context
    weight_bytes = 2 * param_counts(shape)["read_per_step"]
    roofline_ms = (kv_bytes + weight_bytes) / HBM_READ_BYTES_PER_S * 1e3
    result = {
        "batch": batch, "context": context, "kv_cache_dtype": str(runner.kv_caches[0].dtype),
        "kv_blocks": runner.num_blocks, "kv_bytes_per_block": runner.kv_spec.bytes_per_block,
        "gpu_ms_median": ms, "gpu_ms_min": min(times), "gpu_ms_max": max(times), "replays": reps,
        "decode_tok_s_gpu": batch / ms * 1e3,
        "kv_bytes_read_per_step": kv_bytes, "weight_bytes_read_per_step": weight_bytes,
        "roofline_ms": roofline_ms, "fraction_of_roofline": roofline_ms / ms,
    }
    if "attention_sweep" not in SKIP:
        result["attention_sweep"] = sweep_attention(runner, graphs.block_tables[:batch], batch, context)
    if "attention_sweep_short" not in SKIP:
        # Issue 13's decode shape: 256 sequences of ~320 keys (the 8B 256 x (256 -> 128) run's
        # mid-point), on blocks of the same filled cache.
        short_batch, short_context = 256, 320
        short_blocks = -(-short_context // runner.config.block_size)
        if short_batch * short_blocks <= need:
            table = order[: short_batch * short_blocks].view(short_batch, short_blocks).to(torch.int32)
            result["attention_sweep_short"] = sweep_attention(runner, table, short_batch, short_context)
    return result


def gpu_ms(fn: Callable[[], Any], reps: int = 10, warmup: int = 2) -> float:
    """Median device time of one call (CUDA events around each)."""
    for _ in range(warmup):
        fn()
    sync()
    events = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        e.record()
        events.append((a, e))
    sync()
    return statistics.median(a.elapsed_time(e) for a, e in events)


# The launches attention_sweep times after the engine's own (paged_attention's overrides): KV
# splits, key tiles, warps, pipeline stages and register caps (maxnreg), and the two launches
# before 32-bit offsets (offsets_i32=False): bf16's (1 split of 128-key tiles at these batches)
# and fp8's (2 splits of 128-key tiles). (h200-2026-12-01e-attn also timed a register-prefetched
# key loop, since removed: it lost everywhere.)
ATTENTION_SETTINGS: dict[str, dict[str, Any]] = {
    "block_n128_i64": {"block_n": 128, "offsets_i32": False},
    "splits2_block_n128_i64": {"num_splits": 2, "block_n": 128, "offsets_i32": False},
    **{f"splits{n}_block_n{bn}": {"num_splits": n, "block_n": bn} for n in (1, 2) for bn in (64, 128)},
    "splits4_block_n128": {"num_splits": 4, "block_n": 128},
    "splits1_block_n64_r128": {"num_splits": 1, "block_n": 64, "maxnreg": 128},
    "splits1_block_n128_r128": {"num_splits": 1, "block_n": 128, "maxnreg": 128},
    "splits2_block_n128_r168": {"num_splits": 2, "block_n": 128, "maxnreg": 168},
    "splits1_block_n128_w8": {"num_splits": 1, "block_n": 128, "num_warps": 8},
    "splits1_block_n64_s3": {"num_splits": 1, "block_n": 64, "num_stages": 3},
    "splits1_block_n32_s3": {"num_splits": 1, "block_n": 32, "num_stages": 3},
    # Block ids a tile ahead (bt_ahead: the K/V gather never waits on a block-table load of its
    # own iteration; with 3+ stages two tiles are in flight). h200-2026-12-01g-kvfp8 also timed a
    # keys-major decode kernel (keys_*, S^T = K q^T on wgmma), since removed: it lost to bt_ahead.
    "bt_ahead_block_n64_r128": {"num_splits": 1, "block_n": 64, "maxnreg": 128, "num_stages": 2, "bt_ahead": True},
    "bt_ahead_block_n64_s3_r128": {"num_splits": 1, "block_n": 64, "maxnreg": 128, "num_stages": 3,
                                   "bt_ahead": True},
    "bt_ahead_block_n32_s4_r128": {"num_splits": 1, "block_n": 32, "maxnreg": 128, "num_stages": 4,
                                   "bt_ahead": True},
}
# --attention-settings: the names the sweeps time (empty: all), of ATTENTION_SETTINGS or
# preset_<name>: over an fp8 cache the sweep also times each of paged_attention's
# FP8_DECODE_PRESETS at the engine's 64-key tiles and register cap, one split.
# (h200-2026-12-02-kvfp8u also timed an L2 prefetch of the K/V rows 2-4 tiles ahead, since
# removed: at most 2% of the kernel, nothing in the step.)
SWEEP_SETTINGS: list[str] = []


def fp8_preset_settings() -> dict[str, dict[str, Any]]:
    from tidal_engine.kernels.triton.paged_attention import FP8_DECODE_PRESETS

    return {f"preset_{name}": {"num_splits": 1, "block_n": 64, "maxnreg": 128, **preset}
            for name, preset in FP8_DECODE_PRESETS.items()}


def sweep_attention(runner: Any, block_tables: torch.Tensor, batch: int, context: int,
                    settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The paged-attention kernel alone at a decode shape (``batch`` sequences of ``context``
    keys through ``block_tables``), over layer 0's cache: first the engine's own launch
    (``engine_default``: no overrides), then ``settings`` (default ``ATTENTION_SETTINGS`` and,
    over an fp8 cache, the fp8 decode presets, as --attention-settings filters them): how far
    from the read rate one layer's attention is, and what helps."""
    from tidal_engine.kernels.triton.paged_attention import paged_attention

    attn = runner.model.layers[runner.model.start_layer].self_attn
    cache = runner.kv_caches[0]
    heads, dim = attn.num_heads, attn.head_dim
    dev = cache.device
    q = torch.randn(batch, heads, dim, device=dev, dtype=runner.dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=dev)
    starts = torch.arange(batch + 1, dtype=torch.int64, device=dev)
    layer_bytes = cache.element_size() * 2 * batch * context * cache.shape[3] * dim
    out: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes_per_layer": layer_bytes}
    if settings is None:
        every = {**ATTENTION_SETTINGS, **(fp8_preset_settings() if cache.element_size() == 1 else {})}
        settings = {k: v for k, v in every.items() if not SWEEP_SETTINGS or k in SWEEP_SETTINGS}
    for name, kwargs in {"engine_default": {}, **settings}.items():
        def call(kwargs: dict[str, Any] = kwargs) -> Any:
            return paged_attention(q, cache, block_tables, seq_lens, starts, dim**-0.5, 1,
                                   k_scale=attn.attn.k_scale, v_scale=attn.attn.v_scale, **kwargs)
        try:
            us = gpu_ms(call) * 1e3
            out[name] = {"us": us, "read_TB_s": layer_bytes / us / 1e6}
        except Exception as exc:  # e.g. a tile that runs out of shared memory: record, go on
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if "CUDA error" in str(exc):  # a device fault is sticky: nothing after it would run
                break
    timed = {k: v for k, v in out.items() if isinstance(v, dict) and "us" in v}
    if timed:
        best = min(timed, key=lambda k: timed[k]["us"])
        out["best"] = {"setting": best, **timed[best]}
        print(f"attention {batch}x{context} {cache.dtype}: engine_default {out['engine_default']}, best {best} "
              f"{timed[best]}", flush=True)
    return out


def suite_long_decode(shape: str, root: Path, results: dict[str, Any], save: Callable[[], None],
                      batch: int = 64, context: int = 8192) -> None:
    """64 sequences x 8k context, one LLM per --kv-cache-dtype, then the ratios to the first."""
    folder = make_config_folder(shape, root)
    os.environ["TIDAL_GEMV"] = "0"  # one-row GEMV choice: irrelevant at batch 64, and it takes seconds
    opts = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=context + 128, max_num_seqs=batch,
                cuda_graph_sizes=[batch], mixed_cuda_graphs=False, max_num_batched_tokens=2048)
    # The fp8 one-query decode preset forced by paged_attention's TIDAL_FP8_DECODE (None: its
    # choose_fp8_decode picks; "rows_bt_v_ss" at this batch).
    results["long_decode_options"] = {**opts, "TIDAL_FP8_DECODE": os.environ.get("TIDAL_FP8_DECODE")}
    for kv in KV_CACHE_DTYPES:
        def run(kv: str = kv) -> dict[str, Any]:
            llm, startup = make_llm(folder, kv_cache_dtype=kv, **opts)
            try:
                r = bench_long_decode(llm.engine.runner, shape, batch, context)
                r["llm_construct_s"] = startup
                return r
            finally:
                llm.engine.shutdown()
                del llm
                free_cuda()

        run_guarded(results, f"long_decode_{kv}", run, save)
    base = results.get(f"long_decode_{KV_CACHE_DTYPES[0]}", {})
    for kv in KV_CACHE_DTYPES[1:]:
        other = results.get(f"long_decode_{kv}", {})
        if "gpu_ms_median" in base and "gpu_ms_median" in other:
            results[f"{kv}_vs_{KV_CACHE_DTYPES[0]}"] = {
                "decode_speedup": base["gpu_ms_median"] / other["gpu_ms_median"],
                "kv_blocks_ratio": other["kv_blocks"] / base["kv_blocks"],
            }
    save()


def quantized_config_folder(shape: str, root: Path, quant: str, group_size: int = 128) -> Path:
    """``make_config_folder`` whose config.json carries an INT4 format's quantization_config
    (AWQ/GPTQ cannot quantize a plain checkpoint while loading; dummy weights go through Tidal's
    quantizer instead), asymmetric, groups of 128."""
    from tidal_engine.quantization.quantizer import quantization_config

    plain = make_config_folder(shape, root)
    folder = root / f"{shape}-config-only-{quant}-g{group_size}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(quant, group_size=group_size, symmetric=False)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "model.safetensors").write_bytes((plain / "model.safetensors").read_bytes())
    return folder


def one_row_kernels(llm: Any) -> dict[str, Any]:
    """How the engine's linears run one-row and few-row inputs (kernels/gemv_choice.py): per
    kind of layer, the chosen tile or None (cuBLAS / the format's general path)."""
    from tidal_engine.layers.linear import LinearBase

    runner = llm.engine.runner
    chosen: dict[str, Any] = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, LinearBase) and ".layers.0." in f".{name}.":
            chosen[name.split(".layers.0.")[-1]] = {
                "one_row": repr(module.gemv_config), "few_rows": repr(getattr(module, "gemv_config_few", None)),
                "method": type(module.method).__name__,
            }
    return chosen


def suite_quant(shape: str, root: Path, results: dict[str, Any], save: Callable[[], None],
                quantizations: list[str], skip: set[str]) -> None:
    """Weight quantization (issue 15): per --quantization value, random weights through Tidal's
    quantizer (--load-format dummy, nothing on disk but config.json; awq/gptq: a config.json
    that names the format, asymmetric g128), the single stream 128 -> 256 and the greedy
    256 x (256 -> 128); then each format's ratio to the first."""
    vocab = SHAPES[shape]["vocab_size"]
    for quant in quantizations:
        def run(quant: str = quant) -> dict[str, Any]:
            if quant in ("awq", "gptq"):
                folder, flag = quantized_config_folder(shape, root, quant), None
            else:
                folder, flag = make_config_folder(shape, root), None if quant == "none" else quant
            llm, startup = make_llm(folder, load_format="dummy", skip_tokenizer_init=True, quantization=flag)
            try:
                r: dict[str, Any] = {"llm_construct_s": startup}
                try:
                    r["one_row_kernels"] = one_row_kernels(llm)
                except Exception as exc:  # a report only: never lose the timings to it
                    r["one_row_kernels"] = f"unavailable: {exc!r}"
                r["single_stream"] = bench_single_stream(llm, shape)
                if "decode_gpu" not in skip:
                    r["decode_gpu"] = bench_decode_gpu(llm.engine.runner, shape, top_kernels=40)
                if "throughput_fixed" not in skip:
                    counter = StepCounter(llm.engine.runner)
                    r["throughput_fixed"] = bench_throughput(llm, shape, rand_prompts(256, [256] * 256, 1, vocab),
                                                             [128] * 256, counter)
                return r
            finally:
                llm.engine.shutdown()
                del llm
                free_cuda()

        run_guarded(results, f"quant_{quant}", run, save)
    base = results.get(f"quant_{quantizations[0]}", {})
    for quant in quantizations[1:]:
        other = results.get(f"quant_{quant}", {})
        ratios: dict[str, float] = {}
        for part, field in (("single_stream", "output_tok_s_median"), ("throughput_fixed", "output_tok_s")):
            a, b = base.get(part, {}), other.get(part, {})
            if isinstance(a, dict) and isinstance(b, dict) and a.get(field) and b.get(field):
                ratios[part] = b[field] / a[field]
        if ratios:
            results[f"{quant}_vs_{quantizations[0]}"] = ratios
    save()


def _construct_only(folder: Path) -> float:
    llm, t = make_llm(folder)
    del llm
    free_cuda()
    return t


# ------------------------------------------------------------------ transformers baseline

def suite_hf(shape: str, folder: Path, results: dict[str, Any], save: Callable[[], None], parts: list[str]) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    results["transformers_version"] = transformers.__version__
    vocab = SHAPES[shape]["vocab_size"]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    results["load_s"] = time.perf_counter() - t0
    model.generation_config.eos_token_id = None  # fixed output lengths
    model.generation_config.pad_token_id = 0
    save()

    def generate_b1(cache: str | None) -> dict[str, Any]:
        prompt = torch.tensor(rand_prompts(1, [128], 100, vocab), device="cuda")
        kwargs: dict[str, Any] = dict(max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=None)
        if cache:
            kwargs["cache_implementation"] = cache
        times = []
        for r in range(2):  # the first run compiles (static cache) / warms up
            sync()
            s = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
            sync()
            times.append(time.perf_counter() - s)
            n = out.shape[1] - prompt.shape[1]
            if not cache:
                break  # eager: one run is plenty at ~13 tok/s (cudnn/cublas were warmed by load)
        return {"in_tokens": 128, "out_tokens": n, "run_s": times, "output_tok_s": n / times[-1],
                **decode_roofline(shape, 256)}

    def generate_batch(n_req: int, in_len: int, out_len: int) -> dict[str, Any]:
        prompts = rand_prompts(n_req, [in_len] * n_req, 1, vocab)
        cfg = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        # No inference_mode here: generate_batch runs its loop in a thread of its own.
        model.generate_batch(inputs=prompts[:8], generation_config=GenerationConfig(
            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0))  # warm-up
        sync()
        s = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=cfg)
        sync()
        elapsed = time.perf_counter() - s
        n_out = sum(len(o.generated_tokens) for o in outs.values())
        if n_out == 0:
            raise RuntimeError("generate_batch produced no tokens (see the log)")
        return {"requests": n_req, "in_tokens": in_len, "out_tokens_each": out_len, "output_tokens": n_out,
                "elapsed_s": elapsed, "output_tok_s": n_out / elapsed}

    if "eager" in parts:
        run_guarded(results, "generate_b1_eager", lambda: generate_b1(None), save)
    if "static" in parts:
        run_guarded(results, "generate_b1_static_compiled", lambda: generate_b1("static"), save)
    if "batch" in parts:
        run_guarded(results, "generate_batch_256x256to128", lambda: generate_batch(256, 256, 128), save)


# ------------------------------------------------------------------ main

def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return os.environ.get("TIDAL_COMMIT", "unknown")


def run_header(benchmark: str) -> dict[str, Any]:
    """What every result JSON starts with: the benchmark, the exact command, commit, date, GPU and torch."""
    return {
        "benchmark": benchmark,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "commit": os.environ.get("TIDAL_COMMIT") or git_commit(),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--suite", choices=["tidal", "hf", "smoke", "sampled", "long-decode", "quant"], required=True)
    ap.add_argument("--quantization", default="none,fp8",
                    help="suite quant: comma-separated weight formats to run (none = the run dtype)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV cache dtype of every LLM (auto, fp8); long-decode takes a list (auto,fp8) and "
                         "compares them")
    ap.add_argument("--hf-parts", default="eager,static,batch")
    ap.add_argument("--skip", default="", help="comma-separated tidal benchmarks to skip")
    ap.add_argument("--attention-settings", default="",
                    help="suite long-decode: comma-separated names (of ATTENTION_SETTINGS, or preset_<name> of "
                         "FP8_DECODE_PRESETS) the sweeps time (default all)")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if os.environ.get("TIDAL_BENCH_LOG"):  # e.g. INFO: the engine's start-up choices and timings on stderr
        import logging

        logging.basicConfig(level=os.environ["TIDAL_BENCH_LOG"].upper(), format="%(asctime)s %(name)s: %(message)s")
    SKIP.update(x for x in args.skip.split(",") if x)
    SWEEP_SETTINGS[:] = [x for x in args.attention_settings.split(",") if x]
    unknown = {x for x in SWEEP_SETTINGS if x not in ATTENTION_SETTINGS and not x.startswith("preset_")}
    if unknown:
        ap.error(f"--attention-settings: unknown {sorted(unknown)}")
    KV_CACHE_DTYPES[:] = [x for x in args.kv_cache_dtype.split(",") if x]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        **run_header(f"gpu_bench {args.suite} {args.shape}"),
        "shape": {"name": args.shape, **SHAPES[args.shape], "params": param_counts(args.shape)},
        "hbm_read_bytes_per_s": HBM_READ_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S,
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    if args.suite == "quant":
        suite_quant(args.shape, Path(args.models), results, save, args.quantization.split(","),
                    set(filter(None, args.skip.split(","))))
        print("done", out, flush=True)
        return
    if args.suite == "long-decode":
        suite_long_decode(args.shape, Path(args.models), results, save)
        save()
        print("done", out, flush=True)
        return
    t0 = time.perf_counter()
    folder = make_model_folder(args.shape, Path(args.models))
    results["model_folder_build_s"] = time.perf_counter() - t0
    save()
    if args.suite in ("tidal", "smoke"):
        suite_tidal(args.shape, folder, results, save, smoke=args.suite == "smoke")
    elif args.suite == "sampled":
        suite_sampled(args.shape, folder, results, save)
    else:
        suite_hf(args.shape, folder, results, save, args.hf_parts.split(","))
    save()
    print("done", out, flush=True)


if __name__ == "__main__":
    main()
