"""n-gram speculative decoding on SmolLM2-135M, the copy task (CPU or GPU): tokens/s with and
without speculation on one engine (the proposer switched off for the baseline), after a warm-up
round, plus the acceptance rate. Prints one JSON object.

  PYTHONPATH=engine python benchmarks/spec_decode_copy.py [--device cpu] [--rounds 3] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    from test_spec_decode_smollm2 import COPY_PROMPT

    from tidal_engine import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3}
    llm = LLM(args.model, device=args.device, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              speculative_config=spec, **({"dtype": "float32"} if args.device == "cpu" else {}))
    core = llm.engine.core
    proposer = core.proposer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    times: dict[str, list[float]] = {"plain": [], "ngram": []}
    texts: dict[str, list[int]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up both paths
        for name in ("plain", "ngram"):
            core.proposer = proposer if name == "ngram" else None
            start = time.perf_counter()
            out = llm.generate([COPY_PROMPT], params)[0].outputs[0]
            elapsed = time.perf_counter() - start
            texts[name] = out.token_ids
            if round_:
                times[name].append(elapsed)
    stats = llm.engine.get_stats()
    best = {name: min(values) for name, values in times.items()}
    print(json.dumps({
        "benchmark": "spec_decode_copy", "model": args.model, "device": str(core.device), "k": args.k,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "tokens": len(texts["ngram"]), "same_tokens": texts["ngram"] == texts["plain"],
        "plain_s": best["plain"], "ngram_s": best["ngram"],
        "plain_tok_s": len(texts["plain"]) / best["plain"], "ngram_tok_s": len(texts["ngram"]) / best["ngram"],
        "speedup": best["plain"] / best["ngram"],
        "acceptance": stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_draft_tokens),
        "commit": os.environ.get("TIDAL_COMMIT"), "date": os.environ.get("TIDAL_BENCH_DATE"),
        "command": " ".join(sys.argv),
    }))


if __name__ == "__main__":
    main()
