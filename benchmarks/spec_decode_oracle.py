"""Speculative decoding mechanism on the GPU with a benchmark-only ORACLE proposer: random weights
never accept real drafts, so a first pass records the target's own greedy continuation, and the
oracle then proposes it with each draft token right with probability --accept (wrong: id + 1).
Greedy verification keeps the output identical to the first pass (checked, reported).

  PYTHONPATH=engine python benchmarks/spec_decode_oracle.py --shape qwen3-8b --out r.json
Cases: single stream 128 -> 256 at k = 4, acceptance 1.0 / 0.5 / 0.0, and 64 x (256 -> 256) at 0.7,
each against the same LLM without drafts (proposer switched off). Output tok/s, wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


class OracleProposer:
    """Proposes the recorded greedy continuation; each token right with probability ``accept``."""

    def __init__(self, k: int, recorded: dict[tuple[int, ...], list[int]], accept: float, seed: int = 0) -> None:
        self.num_speculative_tokens = k
        self.recorded = recorded  # prompt → its greedy output
        self.accept = accept
        self.rng = np.random.default_rng(seed)

    def release(self, request_id: str) -> None:
        """Stateless (the Proposer interface's hook for per-request state)."""

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                request_ids: list[str] | None = None) -> list[np.ndarray]:
        out = []
        for tokens, cap in zip(token_ids, max_drafts):
            drafts: list[int] = []
            for prompt, output in self.recorded.items():
                n = len(prompt)
                if len(tokens) >= n and tuple(tokens[:n].tolist()) == prompt:
                    done = len(tokens) - n
                    truth = output[done : done + min(cap, self.num_speculative_tokens)]
                    right = self.rng.random(len(truth)) < self.accept
                    drafts = [t if ok else t + 1 for t, ok in zip(truth, right)]
                    break
            out.append(np.asarray(drafts, dtype=np.int64))
        return out


def run_case(llm: Any, prompts: list[list[int]], max_tokens: int, k: int, accept: float) -> dict[str, Any]:
    from tidal_engine import SamplingParams

    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.proposer = None
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm
    start = time.perf_counter()
    base = llm.generate(prompts, params)
    base_s = time.perf_counter() - start
    recorded = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base)}
    core.proposer = OracleProposer(k, recorded, accept)
    before = llm.engine.get_stats()
    start = time.perf_counter()
    spec = llm.generate(prompts, params)
    spec_s = time.perf_counter() - start
    after = llm.engine.get_stats()
    core.proposer = None
    tokens = sum(len(o.outputs[0].token_ids) for o in spec)
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"accept_target": accept, "k": k, "requests": len(prompts), "max_tokens": max_tokens,
            "same_tokens": [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base],
            "baseline_s": base_s, "spec_s": spec_s, "baseline_tok_s": tokens / base_s, "spec_tok_s": tokens / spec_s,
            "speedup": base_s / spec_s, "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance": accepted / max(1, drafts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    args = ap.parse_args()
    from gpu_bench import make_config_folder

    from tidal_engine import LLM

    folder = make_config_folder(args.shape, Path(args.models))
    spec = {"method": "ngram", "num_speculative_tokens": args.k}  # turns the verifier on; the oracle replaces ngram
    results: dict[str, Any] = {"command": " ".join(sys.argv), "commit": os.environ.get("TIDAL_COMMIT"),
                               "date": os.environ.get("TIDAL_BENCH_DATE"), "shape": args.shape, "cases": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1))

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64,
              speculative_config=spec)
    results["llm_construct_s"] = time.perf_counter() - t0
    vocab = llm.engine.core.vocab_size
    single = [rng.integers(100, vocab - 100, 128).tolist()]
    batch = [rng.integers(100, vocab - 100, 256).tolist() for _ in range(64)]
    run_case(llm, single, 64, args.k, 0.5)  # warm-up: Triton compiles the verify shapes, discarded
    for name, prompts, max_tokens, accept in (("single_k4_acc100", single, 256, 1.0),
                                              ("single_k4_acc50", single, 256, 0.5),
                                              ("single_k4_acc0", single, 256, 0.0),
                                              ("batch64_k4_acc70", batch, 256, 0.7)):
        try:
            results["cases"][name] = run_case(llm, prompts, max_tokens, args.k, accept)
        except Exception as exc:  # noqa: BLE001 - recorded, the other cases still run
            results["cases"][name] = {"error": repr(exc)[:2000]}
        save()
        print(name, json.dumps(results["cases"][name]), flush=True)


if __name__ == "__main__":
    main()
