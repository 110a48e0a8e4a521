"""A draft model on the GPU: the Qwen3-8B shape as target, a Qwen3-0.6B-shape draft (its LM head
untied: a benchmark-only variant; ``--shape``/``--draft-shape``), both random and reshaped into "chain models"
(``spec_decode_oracle.make_chain_model``), k = 4.

A chain model's greedy next token depends on the current token only, through a permutation
sigma of the vocabulary drawn from a seed. Target and draft reshaped with the same seed
therefore continue alike (every draft right: the mechanism at ~100% acceptance, measured); the
draft reshaped with another seed is always wrong (0%: the worst case, the draft's whole cost for
nothing). Greedy tokens must equal the target's without drafts in every case (``same_tokens``).

Each case uses fresh random prompts (no prefix-cache hits). The baseline is the same engine with
the draft turned off (no draft forwards at all) and async scheduling, the GPU default.

  PYTHONPATH=engine TIDAL_COMMIT=$(git rev-parse HEAD) TIDAL_BENCH_DATE=$(date -u +%F) \\
      python benchmarks/spec_decode_draft.py --out r.json
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


def untied_folder(shape: str, root: Path) -> Path:
    """A shape with an untied LM head (the chain reshaping needs one), config only (dummy weights)."""
    import torch
    from gpu_bench import hf_config
    from safetensors.torch import save_file

    folder = root / f"{shape}-untied-config-only"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    cfg["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({"model.norm.weight": torch.ones(cfg["hidden_size"], dtype=torch.bfloat16)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def rechain_head(model: Any, seed: int) -> None:
    """A chain model's LM head for another permutation (its embedding is already scaled)."""
    import torch
    from spec_decode_oracle import HEAD_SCALE

    params = dict(model.named_parameters())
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    head = next(p for n, p in params.items() if n.endswith("lm_head.weight"))
    with torch.no_grad():
        gen = torch.Generator(device=embed.device).manual_seed(seed)
        sigma = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
        head.copy_(embed.index_select(0, sigma) * HEAD_SCALE)


def run_case(llm: Any, prompts: list[list[int]], max_tokens: int, async_scheduling: bool) -> dict[str, Any]:
    from spec_decode_oracle import StepTimer, _first_diff

    from tidal_engine import SamplingParams

    engine = llm.engine
    core, runner = engine.core, engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    proposer, draft = core.proposer, runner.draft
    core.proposer, runner.draft, core.async_scheduling = None, None, True  # no speculation: the GPU default
    start = time.perf_counter()
    with StepTimer(runner) as base_timer:
        base = llm.generate(prompts, params)
    base_s = time.perf_counter() - start
    core.proposer, runner.draft, core.async_scheduling = proposer, draft, async_scheduling
    before = engine.get_stats()
    replays = runner.verify_graphs.num_replays if runner.verify_graphs is not None else 0
    start = time.perf_counter()
    with StepTimer(runner) as spec_timer:
        spec = llm.generate(prompts, params)
    spec_s = time.perf_counter() - start
    after = engine.get_stats()
    base_ids = [o.outputs[0].token_ids for o in base]
    spec_ids = [o.outputs[0].token_ids for o in spec]
    tokens = sum(len(t) for t in spec_ids)
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    verify_rows = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    return {"requests": len(prompts), "max_tokens": max_tokens, "async_scheduling": async_scheduling,
            "same_tokens": spec_ids == base_ids, "first_diff": _first_diff(base_ids, spec_ids),
            "distinct_tokens_first_request": len(set(base_ids[0])),
            "baseline_s": base_s, "spec_s": spec_s, "baseline_tok_s": tokens / base_s, "spec_tok_s": tokens / spec_s,
            "speedup": base_s / spec_s, "verify_rows": verify_rows, "draft_tokens": drafts,
            "accepted_tokens": accepted, "acceptance": accepted / max(1, drafts),
            "tokens_per_verify_row": (accepted + verify_rows) / max(1, verify_rows),
            "verify_graph_replays": (runner.verify_graphs.num_replays - replays) if runner.verify_graphs else None,
            "baseline_steps": base_timer.steps, "spec_steps": spec_timer.steps,
            "baseline_wall_ms_per_step": 1e3 * base_s / max(1, base_timer.steps),
            "spec_wall_ms_per_step": 1e3 * spec_s / max(1, spec_timer.steps),
            "baseline_gpu_ms_per_step": base_timer.ms_per_step(), "spec_gpu_ms_per_step": spec_timer.ms_per_step()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--draft-shape", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="/tmp/tidal-bench-models")
    args = ap.parse_args()
    import torch
    from spec_decode_oracle import make_chain_model

    from tidal_engine import LLM

    target = untied_folder(args.shape, Path(args.models))
    draft = untied_folder(args.draft_shape, Path(args.models))
    results: dict[str, Any] = {"command": " ".join(sys.argv), "commit": os.environ.get("TIDAL_COMMIT"),
                               "date": os.environ.get("TIDAL_BENCH_DATE"), "target_shape": args.shape,
                               "draft_shape": f"{args.draft_shape}, untied LM head", "k": args.k, "cases": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1))

    t0 = time.perf_counter()
    llm = LLM(str(target), load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64,
              speculative_config={"model": str(draft), "num_speculative_tokens": args.k})
    runner = llm.engine.runner
    make_chain_model(runner.model, seed=0)
    make_chain_model(runner.draft.model, seed=0)
    results.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                   llm_construct_s=time.perf_counter() - t0, num_kv_blocks=runner.num_blocks,
                   kv_bytes_per_block={"target": runner.kv_spec.bytes_per_block,
                                       "draft": runner.draft.bytes_per_block},
                   memory=runner.memory_report)
    vocab = llm.engine.core.vocab_size
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(100, vocab - 100, length).tolist() for _ in range(n)]

    run_case(llm, prompts(1, 64), 16, True)  # warm-up, discarded
    run_case(llm, prompts(1, 64), 16, False)
    cases = [("single_acc100_async", 0, 1, True), ("single_acc100_sync", 0, 1, False),
             ("single_acc0_async", 1, 1, True), ("batch16_acc100_async", 0, 16, True)]
    for name, seed, n, async_scheduling in cases:
        rechain_head(runner.draft.model, seed)
        try:
            results["cases"][name] = run_case(llm, prompts(n, 128), 256, async_scheduling)
        except Exception as exc:  # noqa: BLE001 - recorded, the other cases still run
            results["cases"][name] = {"error": repr(exc)[:2000]}
        save()
        print(name, json.dumps(results["cases"][name]), flush=True)


if __name__ == "__main__":
    main()
