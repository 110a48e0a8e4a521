"""Where the host time of a decode step goes: cProfile over offline single-stream and batch-64
greedy decoding, sync and async scheduling (a diagnostic, not a speed claim).

    python benchmarks/profile_host.py --shape qwen3-0.6b [--out prof.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpu_bench import greedy, make_llm, make_model_folder, rand_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    folder = make_model_folder(args.shape, Path(args.models))
    report = io.StringIO()
    for async_scheduling in (False, True):
        llm, _ = make_llm(folder, async_scheduling=async_scheduling)
        vocab = llm.engine.core.vocab_size
        for batch in (1, 64):
            prompts = rand_prompts(batch, [128] * batch, 7, vocab)
            llm.generate(prompts, greedy(16))
            t0 = time.perf_counter()
            llm.generate(prompts, greedy(256))
            per_step = (time.perf_counter() - t0) / 256 * 1e3
            profile = cProfile.Profile()
            profile.enable()
            llm.generate(prompts, greedy(256))
            profile.disable()
            print(f"async={async_scheduling} batch={batch}: {per_step:.3f} ms/step (unprofiled)", file=report)
            stats = pstats.Stats(profile, stream=report)
            stats.sort_stats("tottime").print_stats(18)
        del llm
    text = report.getvalue()
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
