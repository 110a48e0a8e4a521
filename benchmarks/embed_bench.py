"""Embedding throughput: Tidal's pooling engine against sentence-transformers, same machine, same run.

Workloads (issue 19):
  minilm-cpu      all-minilm-l6-v2 (the bundled alias), 2,000 short texts, torch on 2 threads, fp32
  qwen3-0.6b-gpu  Qwen3-Embedding-0.6B's shape (Qwen3-0.6B backbone, random bf16 weights from
                  gpu_bench.make_model_folder), last-token pooling, 10,000 texts of 256 tokens

Both sides tokenize the same texts with the same tokenizer inside the timed region, and return
normalised float32 vectors on the host. sentence-transformers runs with its defaults (fp32,
batch 32; sentence-transformers 6 loads the checkpoint's own dtype: fp32 for MiniLM, bf16 for the
Qwen3 folder) and, on the GPU, also with batch 128 (and in fp32 with ``--with-fp32``).
Tidal runs its offline path (the pooling engine core in process: longest first, token-budget
steps) and the server's path (the API server's client against a real engine-core process, requests
of 64 texts tokenized and sent while the core computes; see ``tidal_runners``). Each side first warms up on 512 texts; then ``--repeats`` rounds run every side once each
(interleaved), and the reported time is each side's best.

  python benchmarks/embed_bench.py --workload minilm-cpu --out benchmarks/results/embed_cpu_minilm.json
  python benchmarks/embed_bench.py --workload qwen3-0.6b-gpu --out /tmp/embed_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

WORDS = ("tide moon harbour engine kubernetes operator model vector cosine search query answer document river "
         "ocean wave sleep scale router token batch prefill cache memory device kernel python fast slow small "
         "large bright quiet storm coast island light house ship sail wind north south east west morning night "
         "the a of and to in is it that was for on are with as they be at one have this from by").split()


def short_texts(count: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 32 words, as a RAG chunker or a search box produces."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 32))).capitalize() + "." for _ in range(count)]


def word_level_texts(count: int, length: int, vocab: int, seed: int = 0) -> list[str]:
    """Texts of exactly ``length`` tokens for gpu_bench's word-level tokenizer (``t<id>`` words)."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(1, vocab)}" for _ in range(length)) for _ in range(count)]


def best_of(repeats: int, run: Runner, texts: list[str]) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = run(texts)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


Runner = Callable[[list[str]], torch.Tensor]


SERVED_CHUNK = 64  # texts per request on the served path, as concurrent HTTP clients would post them


def tidal_runners(model: str, device: str, budget: int | None) -> dict[str, Runner]:
    """Tidal's offline path (``PoolingEngineCore.encode_offline`` in this process: tokenize
    everything, then longest-first token-budget steps) and its served path (``PoolingClient``,
    the API server's client, against a real engine-core process over ZeroMQ: requests of
    ``SERVED_CHUNK`` texts are tokenized and sent one after another while the core computes)."""
    import tempfile

    from tidal_engine.config import EngineConfig
    from tidal_engine.engine.core_proc import CoreAddresses
    from tidal_engine.pooling.client import PoolingClient
    from tidal_engine.pooling.core import PoolingEngineCore
    from tidal_engine.pooling.runner import PoolingInput
    from tidal_engine.server.launcher import start_engine_core

    engine = PoolingEngineCore.from_model(model, "bench", device=device, max_num_batched_tokens=budget)
    tokenizer, limit = engine.tokenizer, engine.max_model_len

    def inputs(texts: list[str]) -> list[PoolingInput]:
        encoded = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        return [PoolingInput(ids) for ids in encoded]

    def offline(texts: list[str]) -> torch.Tensor:
        return torch.stack(engine.encode_offline(inputs(texts)))

    workdir = tempfile.mkdtemp(prefix="embed-bench-")
    addresses = CoreAddresses(input=f"ipc://{workdir}/in", outputs=[f"ipc://{workdir}/out"])
    config = EngineConfig(model=model, runner="pooling", device=device, max_num_batched_tokens=budget)
    process, info = start_engine_core(config, addresses)
    client = PoolingClient(tokenizer, info, addresses, core_process=process)
    loop = asyncio.new_event_loop()

    async def start() -> None:
        client.start()

    loop.run_until_complete(start())

    async def send_all(texts: list[str]) -> list[torch.Tensor]:
        parts = []
        for first in range(0, len(texts), SERVED_CHUNK):
            parts.append(asyncio.ensure_future(client.encode(inputs(texts[first : first + SERVED_CHUNK]))))
            await asyncio.sleep(0)  # send it now; read what the core has answered so far
        return [vector for part in await asyncio.gather(*parts) for vector in part]

    def served(texts: list[str]) -> torch.Tensor:
        return torch.stack(loop.run_until_complete(send_all(texts)))

    def stop() -> None:
        loop.run_until_complete(client.shutdown(10))
        loop.close()

    STOPS.append(stop)
    return {"tidal_offline": offline, "tidal_served_path": served}


STOPS: list[Callable[[], None]] = []  # the served path's engine core, stopped at the end


run_dtypes: dict[str, str] = {}  # what each sentence-transformers baseline actually ran in


def st_runner(model_dir: str, device: str, pooling: str | None, dtype: torch.dtype | None,
              batch_size: int, pad_with_eos: bool) -> Runner:
    from sentence_transformers import SentenceTransformer

    if pooling is None:  # the folder is a sentence-transformers model: its own modules
        st = SentenceTransformer(model_dir, device=device)
    else:
        from sentence_transformers.models import Normalize, Pooling, Transformer

        kwargs = {"dtype": dtype} if dtype is not None else {}
        transformer = Transformer(model_dir, model_kwargs=kwargs)
        width = transformer.auto_model.config.hidden_size
        st = SentenceTransformer(modules=[transformer, Pooling(width, pooling), Normalize()], device=device)
    if pad_with_eos:
        tok = st[0].tokenizer
        tok.pad_token = tok.eos_token
    if dtype is not None and pooling is None:
        st = st.to(dtype)

    run_dtypes[f"st {pooling or 'own modules'} {dtype} b{batch_size}"] = str(next(st.parameters()).dtype)

    def run(texts: list[str]) -> torch.Tensor:
        return torch.from_numpy(st.encode(texts, batch_size=batch_size, normalize_embeddings=True)).float()

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("minilm-cpu", "qwen3-0.6b-gpu"), required=True)
    ap.add_argument("--texts", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--shape", default="qwen3-0.6b", help="gpu_bench shape (tiny-test: a CPU dry run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--st-batch-sizes", type=int, nargs="*", default=[32, 128],
                    help="GPU: sentence-transformers batch sizes to time (32, its default, always)")
    ap.add_argument("--with-fp32", action="store_true", help="GPU: also time sentence-transformers in fp32")
    ap.add_argument("--profile", action="store_true",
                    help="after timing: profile the offline path on 1,024 texts, top ops to <out>.profile.txt")
    args = ap.parse_args()
    gpu = args.workload.endswith("gpu")
    results: dict[str, Any] = {
        "benchmark": f"embed_bench {args.workload}",
        "command": " ".join(["python", *sys.argv]),
        "commit": os.environ.get("TIDAL_COMMIT", "unknown"),
        "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
        "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=str))

    if gpu:
        from gpu_bench import make_model_folder

        count, repeats = args.texts or 10_000, args.repeats or 1
        folder = str(make_model_folder(args.shape, Path(args.models)))
        texts = word_level_texts(count, 256, 4000 if args.shape == "tiny-test" else 151_000)
        device = args.device
        results["shape"] = args.shape
        tidal = tidal_runners(folder, device, None)
        baselines = {  # default: the checkpoint's dtype (bf16), as sentence-transformers 6 loads it
            f"st_default_b{size}": st_runner(folder, device, "lasttoken", None, size, True)
            for size in sorted({32, *args.st_batch_sizes})
        }
        if args.with_fp32:  # about 70 s on the H200 for 10,000 texts: opt-in
            baselines["st_fp32_b32"] = st_runner(folder, device, "lasttoken", torch.float32, 32, True)
        tokens_per_text = 256
    else:
        from tidal_engine.models.loader import resolve_model_path

        torch.set_num_threads(2)
        count, repeats = args.texts or 2_000, args.repeats or 3
        texts = short_texts(count)
        device = "cpu"
        tidal = tidal_runners("all-minilm-l6-v2", device, None)
        baselines = {"st_default_b32": st_runner(str(resolve_model_path("all-minilm-l6-v2")), device,
                                                 None, None, 32, False)}
        tokens_per_text = None
    results.update(texts=count, repeats=repeats, threads=torch.get_num_threads(), st_dtypes=run_dtypes)
    runs: dict[str, Runner] = {**tidal, **baselines}
    timings: dict[str, dict[str, float]] = {}
    vectors: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for run in runs.values():
        best_of(1, run, texts[:512])  # warm-up (kernel compiles, allocator growth)
    # Rounds interleave the runners, so a load change on a shared machine hits all of them alike.
    for _ in range(repeats):
        for name, run in runs.items():
            took, vectors[name] = best_of(1, run, texts)
            seconds[name] = min(took, seconds.get(name, float("inf")))
            timings[name] = {"seconds": seconds[name], "texts_per_s": count / seconds[name]}
            if tokens_per_text:
                timings[name]["tokens_per_s"] = count * tokens_per_text / seconds[name]
            results["timings"] = timings
            print(name, round(took, 3), flush=True)
            save()
    reference = vectors["st_default_b32"]
    results["min_cosine_vs_st_default"] = {
        name: float(torch.nn.functional.cosine_similarity(v, reference).min()) for name, v in vectors.items()
    }
    base = timings["st_default_b32"]["seconds"]
    results["speedup_vs_st"] = {
        tidal_name: {st_name: timings[st_name]["seconds"] / timings[tidal_name]["seconds"] for st_name in baselines}
        for tidal_name in tidal
    }
    results["speedup_vs_st_default"] = {name: base / t["seconds"] for name, t in timings.items()}
    save()
    print(json.dumps({k: results[k] for k in ("speedup_vs_st", "min_cosine_vs_st_default")}, indent=1))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            best_of(1, tidal["tidal_offline"], texts[:1024])
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        Path(f"{out}.profile.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    for stop in STOPS:
        stop()


if __name__ == "__main__":
    main()
